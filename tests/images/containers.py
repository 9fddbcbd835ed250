"""Containers of the built images, started two ways: as a plain `buildah run` (writable root, the image's
own files) and as a pod does (an OCI runtime, runc, as under a kubelet: UID 10001, read-only root, /tmp
and /dev/shm empty volumes).

Both use the host network, so a container's server is reachable on 127.0.0.1 and reaches the others there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pool_operator.container_tool import BUILDAH, ISOLATION

UID = 10001
RUNTIME = "runc"  # crun 1.8 refuses this machine's hybrid cgroups


@dataclass(frozen=True)
class Mount:
    """A host folder in the container, read-only unless ``writable``."""

    source: Path
    target: str
    writable: bool = False


def _buildah(*args: str) -> str:
    return subprocess.run([*BUILDAH, *args], capture_output=True, text=True, check=True).stdout.strip()


def image_config(ref: str) -> dict:
    """The image's OCI config (Env, Entrypoint, Cmd, User, WorkingDir)."""
    return json.loads(_buildah("inspect", "--type", "image", ref))["OCIv1"]["config"]


@dataclass
class Container:
    """One started container; ``stop()`` ends it and removes what it left (container, bundle)."""

    proc: subprocess.Popen
    log: Path
    cleanup: list[list[str]]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for argv in self.cleanup:
            subprocess.run(argv, capture_output=True, check=False)


def _popen(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as sink:
        return subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def buildah_run(ref: str, argv: Sequence[str], log: Path, mounts: Sequence[Mount] = ()) -> Container:
    """A plain `buildah run` of ``argv`` as UID 10001 with the host network and only ``mounts``."""
    name = f"kvferry-test-{uuid.uuid4().hex[:8]}"
    _buildah("from", "--pull=never", "--name", name, ref)
    opts = [f"--mount=type=bind,src={m.source},dst={m.target},{'rw' if m.writable else 'ro'}" for m in mounts]
    command = [*BUILDAH, "run", *ISOLATION, "--network", "host", "--user", f"{UID}:{UID}", *opts, name]
    return Container(_popen([*command, "--", *argv], log), log, [[*BUILDAH, "rm", name]])


def _spec(
    bundle: Path, rootfs: str, ref: str, argv: Sequence[str], mounts: Sequence[Mount], env: dict
) -> None:
    """An OCI config like the one a kubelet asks for: the operator's securityContext and emptyDirs."""
    subprocess.run([RUNTIME, "spec", "--bundle", str(bundle)], check=True, capture_output=True)
    spec = json.loads((bundle / "config.json").read_text())
    config = image_config(ref)
    image_env = [e for e in config.get("Env", []) if e.split("=", 1)[0] not in env]
    spec["root"] = {"path": rootfs, "readonly": True}
    spec["process"].update(
        terminal=False,
        user={"uid": UID, "gid": UID},
        args=list(argv),
        env=image_env + [f"{k}={v}" for k, v in env.items()],
        cwd=config.get("WorkingDir") or "/",
    )
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
    spec["linux"].pop("resources", None)
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"] not in ("/dev/shm", "/sys/fs/cgroup")]
    for target in ("/tmp", "/dev/shm"):  # the operator's emptyDirs (tmp; shm with medium Memory)
        spec["mounts"].append(
            {
                "destination": target,
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777"],
            }
        )
    for m in mounts:
        options = ["rbind", "rw" if m.writable else "ro"]
        spec["mounts"].append(
            {"destination": m.target, "type": "bind", "source": str(m.source), "options": options}
        )
    (bundle / "config.json").write_text(json.dumps(spec))


def pod_run(
    ref: str, argv: Sequence[str], log: Path, mounts: Sequence[Mount] = (), env: dict | None = None
) -> Container:
    """``argv`` as the operator's pods run it: UID 10001, read-only root, /tmp and /dev/shm as empty
    volumes, ``mounts`` (e.g. the model, read-only), host network, runc as the OCI runtime."""
    name = f"kvferry-test-{uuid.uuid4().hex[:8]}"
    _buildah("from", "--pull=never", "--name", name, ref)
    rootfs = _buildah("mount", name)
    bundle = log.parent / f"{name}-bundle"
    bundle.mkdir()
    cleanup = [[RUNTIME, "delete", "--force", name], [*BUILDAH, "umount", name], [*BUILDAH, "rm", name]]
    try:
        _spec(bundle, rootfs, ref, argv, mounts, env or {})
    except Exception:
        for step in cleanup:
            subprocess.run(step, capture_output=True, check=False)
        raise
    argv_run = [RUNTIME, "run", "--bundle", str(bundle), name]
    return Container(_popen(argv_run, log), log, [*cleanup, ["rm", "-rf", str(bundle)]])


@contextlib.contextmanager
def started(container: Container) -> Iterator[Container]:
    try:
        yield container
    finally:
        container.stop()


def run_to_end(container: Container, timeout: float = 120.0) -> tuple[int, str]:
    """Wait for a one-shot container; its exit code and output."""
    with started(container):
        code = container.wait(timeout)
    return code, container.log_text()


def wait_until(predicate, container: Container, timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail with the container's log when it exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not container.alive():
            raise AssertionError(
                f"{what}: the container exited {container.proc.returncode}:\n{container.log_text()}"
            )
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s:\n{container.log_text()[-4000:]}")


def have_runtime() -> str | None:
    """Why these tests cannot start containers here, or None."""
    missing = [tool for tool in ("buildah", RUNTIME) if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed" if missing else None
