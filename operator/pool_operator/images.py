"""ImageSet: the one naming scheme of kvferry's container images (render, chart and Dockerfile agree)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from dataclasses import dataclass
from pathlib import Path

REGISTRY = "ghcr.io/kvferry"
# Dockerfile target == component name; image == f"{REGISTRY}/kvferry-{component}:{version}".
# engine: CUDA (GPU pods); engine-cpu: CPU pods, the C++ kernels prebuilt for every x86-64 level.
COMPONENTS = ("engine", "engine-cpu", "router", "kvstore", "operator")
_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def package_version() -> str:
    """kvferry's version: the installed distribution's, else pyproject.toml's, else 0.1.0."""
    try:
        return importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(tomllib.loads(_PYPROJECT.read_text(encoding="utf-8"))["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0.1.0"


@dataclass(frozen=True)
class ImageSet:
    """Image references of one kvferry release."""

    registry: str = REGISTRY
    version: str = ""

    def tag(self) -> str:
        return self.version or package_version()

    def repository(self, component: str) -> str:
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
        return f"{self.registry}/kvferry-{component}"

    def image(self, component: str) -> str:
        """Full reference, e.g. ghcr.io/kvferry/kvferry-engine:0.1.0."""
        return f"{self.repository(component)}:{self.tag()}"
