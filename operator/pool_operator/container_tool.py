"""ContainerTool: docker where a daemon answers, else daemonless buildah (chroot isolation, vfs storage)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# buildah as root without a daemon, kernel overlay or user namespaces: vfs storage, chroot isolation.
BUILDAH = ("buildah", "--storage-driver", "vfs")
ISOLATION = ("--isolation", "chroot")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


@dataclass(frozen=True)
class ContainerTool:
    """The image builder and runner of this machine: ``docker`` or ``buildah``."""

    kind: str

    @classmethod
    def detect(cls) -> ContainerTool:
        """docker when `docker info` succeeds (a client without a daemon is common), else buildah."""
        if shutil.which("docker") and _run(["docker", "info"], check=False).returncode == 0:
            return cls("docker")
        if shutil.which("buildah"):
            return cls("buildah")
        raise RuntimeError(
            "neither a docker daemon nor buildah here: install buildah (apt-get install buildah)"
        )

    def base(self) -> tuple[str, ...]:
        return ("docker",) if self.kind == "docker" else BUILDAH

    def build_argv(
        self,
        context: Path,
        target: str,
        tag: str,
        build_args: Mapping[str, str],
        labels: Mapping[str, str],
        secrets: Mapping[str, Path],
    ) -> list[str]:
        """The build command of one Dockerfile target (buildah: no layer cache, each vfs layer is a copy)."""
        argv = [*self.base(), "build"] if self.kind == "docker" else [*BUILDAH, "bud", *ISOLATION]
        argv += ["--target", target, "--tag", tag, "--file", str(context / "Dockerfile")]
        if self.kind == "buildah":
            argv += ["--network", "host"]
        for key, value in build_args.items():
            argv += ["--build-arg", f"{key}={value}"]
        for key, value in labels.items():
            argv += ["--label", f"{key}={value}"]
        for name, path in secrets.items():
            argv += ["--secret", f"id={name},src={path}"]
        return [*argv, str(context)]

    def exists(self, ref: str) -> bool:
        if self.kind == "docker":
            return _run(["docker", "image", "inspect", ref], check=False).returncode == 0
        return _run([*BUILDAH, "inspect", "--type", "image", ref], check=False).returncode == 0

    def label(self, ref: str, key: str) -> str | None:
        """An image label, or None (no image or no such label)."""
        template = f'{{{{index .Config.Labels "{key}"}}}}'
        if self.kind == "docker":
            argv = ["docker", "image", "inspect", "--format", template, ref]
        else:
            argv = [
                *BUILDAH,
                "inspect",
                "--type",
                "image",
                "--format",
                f'{{{{index .OCIv1.Config.Labels "{key}"}}}}',
                ref,
            ]
        done = _run(argv, check=False)
        value = done.stdout.strip()
        return value if done.returncode == 0 and value and value != "<no value>" else None

    def pull(self, ref: str) -> bool:
        """Whether ``ref`` is here or could be pulled."""
        if self.exists(ref):
            return True
        return _run([*self.base(), "pull", "--quiet", ref], check=False).returncode == 0

    def import_tar(self, tarball: Path, ref: str) -> None:
        """A root filesystem tarball as image ``ref`` (buildah: a scratch container with it added)."""
        if self.kind == "docker":
            _run(["docker", "import", str(tarball), ref])
            return
        container = _run([*BUILDAH, "from", "scratch"]).stdout.strip()
        try:
            _run([*BUILDAH, "add", container, str(tarball), "/"])
            _run([*BUILDAH, "config", "--cmd", "/bin/bash", container])
            _run([*BUILDAH, "commit", "--quiet", container, ref])
        finally:
            _run([*BUILDAH, "rm", container], check=False)

    def size(self, ref: str) -> str:
        """The image's size as the tool prints it (e.g. '412 MB')."""
        return _run([*self.base(), "images", "--format", "{{.Size}}", ref]).stdout.strip().splitlines()[0]

    def run_capture(self, ref: str, argv: Sequence[str], user: str = "10001:10001") -> str:
        """stdout of ``argv`` run in a throwaway container of ``ref`` (no entrypoint); raises on failure."""
        if self.kind == "docker":
            return _run(
                ["docker", "run", "--rm", "--user", user, "--entrypoint", argv[0], ref, *argv[1:]]
            ).stdout
        container = _run([*BUILDAH, "from", "--pull=never", ref]).stdout.strip()
        try:
            return _run([*BUILDAH, "run", *ISOLATION, "--user", user, container, "--", *argv]).stdout
        finally:
            _run([*BUILDAH, "rm", container], check=False)
