"""Session fixtures: tiny random-weight checkpoints built offline, thread limits, the Triton interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as services.engine does, before torch loads
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:  # The Triton interpreter must be chosen before anything imports triton.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(2)
except ImportError:  # torch-free installs (router/operator images) still run their tests
    torch = None

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.checkpoints import build_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch is not None and torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny checkpoints of the other families (tests.checkpoints.FAMILY_KINDS), built once on first use."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_checkpoint(tmp_path_factory.mktemp(f"tiny-{kind}"), kind)
        return built[kind]

    return get
