"""Fixtures for the image tests (marker `images`, run by `make test-images` after `make images`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pool_operator.container_tool import ContainerTool
from pool_operator.images import ImageSet
from tests.images.containers import have_runtime


@pytest.fixture(scope="session")
def image() -> Callable[[str], str]:
    """The reference `make images` gave ``component``; skips when it is not built here."""
    why = have_runtime()
    if why:
        pytest.skip(f"cannot start containers: {why}")
    tool = ContainerTool("buildah")

    def get(component: str) -> str:
        ref = ImageSet().image(component)
        if not tool.exists(ref):
            pytest.skip(f"{ref} is not built (make images IMAGES={component})")
        return ref

    return get


@pytest.fixture(scope="session")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, readable by the images' user (pytest's own folders are the owner's only)."""
    model = tmp_path_factory.mktemp("model-for-images") / "tiny-llama"
    shutil.copytree(llama_dir, model)
    for path in (model, *model.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model
