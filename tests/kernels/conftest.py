"""Kernel tests run in Triton's CPU interpreter when no CUDA device is present; one torch thread."""

import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports kernels (and triton.jit)
torch.set_num_threads(1)

import kvkernels.cpu as kc  # noqa: E402 - after TRITON_INTERPRET is set


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip @pytest.mark.gpu tests without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_new_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty / empty_like return NaN-filled floats, so any output element a kernel skips shows up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    """The compiled C++ extension; a module that needs it for every test says
    ``pytestmark = pytest.mark.usefixtures("ops")`` and is skipped (with the reason) when it cannot be built."""
    module = kc.load()
    if module is None:
        pytest.skip(f"kvkernels.cpu unavailable: {kc.unavailable_reason()}")
    return module


@pytest.fixture(params=["auto", "avx512_bf16", "generic"])
def decode_kernel(request: pytest.FixtureRequest, ops: ModuleType) -> Iterator[str]:
    """Runs a test with each decode kernel choice for bf16 caches: the fastest (AMX scores for GQA where
    built in), the AVX512-BF16 dot products (where built in) and the generic at::vec ones. A choice the
    build lacks falls back to the next one, so every choice is valid everywhere."""
    previous = ops._set_decode_kernel(request.param)
    yield request.param
    ops._set_decode_kernel(previous)
