"""ImageBuild: `make images` builds each component image from the Dockerfile and prints its size and packages.

Names come from ImageSet (the operator renders the same ones). With no registry base image reachable,
the debootstrapped DebianBase stands in through the Dockerfile's BASE_IMAGE argument: one recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pool_operator.container_tool import ContainerTool
from pool_operator.debian_base import DebianBase, kvferry_home
from pool_operator.images import COMPONENTS, REGISTRY, ImageSet

REPO = Path(__file__).resolve().parents[2]
HASH_LABEL = "io.kvferry.source-hash"
# What the Dockerfile reads from the build context (its .dockerignore leaves out the rest).
SOURCES = ("Dockerfile", "pyproject.toml", "README.md", "services", "kvkernels", "operator")
# Run in each image as its user: the Python distributions and Debian packages it ships.
PACKAGES_SCRIPT = """import importlib.metadata as m, subprocess
py = sorted({f"{d.metadata['Name']}=={d.version}" for d in m.distributions()}, key=str.lower)
deb = subprocess.run(["dpkg-query", "-W", "-f=${Package}\\n"], capture_output=True, text=True).stdout.split()
print(f"python ({len(py)}): {' '.join(py)}")
print(f"debian ({len(deb)}): {' '.join(sorted(deb))}")
"""


def dockerfile_arg(name: str, context: Path = REPO) -> str:
    """The default of ``ARG name=...`` in the Dockerfile (the one place such defaults live)."""
    match = re.search(rf"^ARG {name}=(\S+)$", (context / "Dockerfile").read_text(), flags=re.M)
    if match is None:
        raise ValueError(f"Dockerfile has no `ARG {name}=` default")
    return match.group(1).strip('"')


def source_hash(context: Path, extra: Iterable[str]) -> str:
    """sha256 of every file the build reads plus the build arguments: an unchanged image is not rebuilt."""
    digest = hashlib.sha256()
    paths: list[Path] = []
    for name in SOURCES:
        path = context / name
        if path.is_dir():
            paths += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            paths.append(path)
    paths += sorted((context / "wheels").glob("*.whl"))
    for path in paths:
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        digest.update(str(path.relative_to(context)).encode() + b"\0")
        digest.update(path.read_bytes() if path.suffix != ".whl" else str(path.stat().st_size).encode())
    digest.update("\0".join(extra).encode())
    return digest.hexdigest()[:16]


def stage_local_torch(context: Path, version: str) -> bool:
    """Copy a local CPU torch wheel (pip's find-links on this machine) into wheels/; True when there is one.

    --no-index: only files already on this machine count, nothing is downloaded."""
    wheels = context / "wheels"
    if list(wheels.glob(f"torch-{version}+cpu-cp311-*.whl")):
        return True
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-index", "--no-deps"]
    argv += ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    argv += ["--platform", "manylinux_2_28_x86_64", "--dest", str(wheels), f"torch=={version}+cpu"]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


@dataclass
class ImageBuild:
    """Builds the requested components with one tool, one base, one set of build arguments."""

    tool: ContainerTool
    images: ImageSet
    context: Path = REPO
    force: bool = False
    build_args: dict[str, str] = field(default_factory=dict)

    def prepare(self, base: str | None) -> None:
        """Choose the base image (registry, else debootstrapped) and the torch source; pass the proxy CA."""
        base = base or dockerfile_arg("BASE_IMAGE", self.context)
        if not self.tool.pull(base):
            print(f"images: {base} cannot be pulled; using the debootstrapped Debian base", flush=True)
            base = DebianBase(kvferry_home()).ensure(self.tool)
        self.build_args["BASE_IMAGE"] = base
        if stage_local_torch(self.context, dockerfile_arg("TORCH_VERSION", self.context)):
            self.build_args["TORCH_CPU_INDEX"] = ""  # the local wheel; no index to reach
        variants = os.environ.get("CPU_KERNEL_VARIANTS")
        if variants:
            self.build_args["CPU_KERNEL_VARIANTS"] = variants

    def secrets(self) -> dict[str, Path]:
        cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
        return {"pip-ca": Path(cert)} if cert and Path(cert).is_file() else {}

    def build(self, component: str) -> str:
        """Build one component unless an image of the same sources is there; returns its reference."""
        ref = self.images.image(component)
        digest = source_hash(
            self.context, [component, *(f"{k}={v}" for k, v in sorted(self.build_args.items()))]
        )
        if not self.force and self.tool.label(ref, HASH_LABEL) == digest:
            print(f"images: {ref} is up to date", flush=True)
            return ref
        argv = self.tool.build_argv(
            self.context, component, ref, self.build_args, {HASH_LABEL: digest}, self.secrets()
        )
        print(f"images: building {ref} ({self.tool.kind})", flush=True)
        subprocess.run(argv, check=True)
        return ref

    def describe(self, ref: str) -> str:
        """Size and package lists of a built image, as `make images` prints them."""
        packages = self.tool.run_capture(ref, ["python", "-c", PACKAGES_SCRIPT])
        lines = [f"{ref}  {self.tool.size(ref)}"] + [f"  {line}" for line in packages.splitlines()]
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make images", description=__doc__)
    parser.add_argument("components", nargs="*", help=f"default: all of {' '.join(COMPONENTS)}")
    parser.add_argument("--registry", default=REGISTRY)
    parser.add_argument("--tag", default="", help="default: kvferry's version")
    parser.add_argument("--base", default="", help="BASE_IMAGE (default: the Dockerfile's, else debootstrap)")
    parser.add_argument("--force", action="store_true", help="rebuild images whose sources did not change")
    args = parser.parse_args(argv)
    unknown = [c for c in args.components if c not in COMPONENTS]
    if unknown:
        parser.error(f"unknown component(s) {', '.join(unknown)}; choose from {', '.join(COMPONENTS)}")
    try:
        build = ImageBuild(ContainerTool.detect(), ImageSet(args.registry, args.tag), force=args.force)
        build.prepare(args.base or None)
        refs = [build.build(c) for c in args.components or COMPONENTS]
        print("\n".join(build.describe(ref) for ref in refs))
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as error:
        print(f"images: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
