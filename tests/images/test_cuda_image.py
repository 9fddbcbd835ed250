"""The CUDA engine image: torch (a CUDA build), triton (the version that torch pins) and nixl import as
the image's user, with a read-only root."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.images.containers import pod_run, run_to_end

pytestmark = pytest.mark.images

PROBE = """import importlib.metadata as m
import nixl, torch, triton
pinned = [r for r in m.requires("torch") or [] if r.startswith("triton")]
print("cuda", torch.version.cuda, "torch", torch.__version__, "triton", triton.__version__, "pinned", pinned)
print("nixl", m.version("nixl"))
"""


def test_cuda_engine_image_imports_torch_triton_and_nixl(image: Callable[[str], str], tmp_path: Path) -> None:
    code, out = run_to_end(pod_run(image("engine"), ["python", "-c", PROBE], tmp_path / "probe.log"), 300)
    assert code == 0, out
    assert "cuda 1" in out and "torch 2.13.0+cu" in out, out  # a CUDA build, not the CPU wheel
    triton = out.split(" triton ", 1)[1].split()[0]
    assert f"triton=={triton}" in out, out
    assert "nixl 1.5.1" in out, out
