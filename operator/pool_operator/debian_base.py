"""DebianBase: a `debootstrap --variant=minbase bookworm` root filesystem standing in for debian:bookworm-slim."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pool_operator.container_tool import ContainerTool

LOCAL_BASE = "localhost/kvferry-debian:bookworm-minbase"
MIRROR = "http://deb.debian.org/debian"
# What debian:bookworm-slim leaves out (its dpkg path excludes), so later apt installs stay as small.
DPKG_EXCLUDES = """path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""
SOURCES = """deb {mirror} bookworm main
deb {mirror} bookworm-updates main
deb {security} bookworm-security main
"""


def kvferry_home() -> Path:
    return Path(os.environ.get("KVFERRY_HOME") or Path.home() / ".cache" / "kvferry")


@dataclass(frozen=True)
class DebianBase:
    """Bookworm minbase, debootstrapped once into $KVFERRY_HOME/images and imported as LOCAL_BASE."""

    home: Path
    mirror: str = MIRROR

    @property
    def tarball(self) -> Path:
        return self.home / "images" / "debian-bookworm-minbase.tar"

    def ensure(self, tool: ContainerTool) -> str:
        """LOCAL_BASE in the tool's storage (debootstraps only when the cached tarball is missing)."""
        if tool.exists(LOCAL_BASE):
            return LOCAL_BASE
        if not self.tarball.is_file():
            self.bootstrap()
        tool.import_tar(self.tarball, LOCAL_BASE)
        return LOCAL_BASE

    def bootstrap(self) -> None:
        """debootstrap into a temporary folder, trim it like the slim image, tar it into place (~2 min)."""
        if shutil.which("debootstrap") is None:
            raise RuntimeError("no registry base image and no debootstrap: apt-get install debootstrap")
        self.tarball.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.tarball.parent) as work:
            root = Path(work) / "root"
            print(f"images: debootstrap --variant=minbase bookworm from {self.mirror}", flush=True)
            subprocess.run(
                ["debootstrap", "--variant=minbase", "bookworm", str(root), self.mirror],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            self._trim(root)
            partial = Path(work) / "base.tar"
            subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], check=True)
            partial.replace(self.tarball)

    def _trim(self, root: Path) -> None:
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for path in (root / junk).glob("*"):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.name != "lock":
                    path.unlink()
        (root / "etc/dpkg/dpkg.cfg.d/excludes").write_text(DPKG_EXCLUDES)
        security = self.mirror.replace("/debian", "/debian-security")
        (root / "etc/apt/sources.list").write_text(SOURCES.format(mirror=self.mirror, security=security))
