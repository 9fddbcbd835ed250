"""The compute backends a model runs on (torch, Triton) and the choice between them."""

from __future__ import annotations

import logging

import torch

from services.engine.worker.attention.backend import ComputeBackend
from services.engine.worker.attention.metadata import AttentionMetadata, build_metadata

log = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "ComputeBackend", "build_metadata", "select_backend"]


def select_backend(device: torch.device, override: str | None = None) -> ComputeBackend:
    """Triton kernels on CUDA, the C++ kernels on CPU (plain torch when they cannot be built);
    ``override`` forces one ('cpu' | 'torch' | 'triton': an unavailable forced backend is an error)."""
    choice = override or ("triton" if device.type == "cuda" else "cpu")
    backend: ComputeBackend
    if choice == "cpu":
        backend = _cpu_backend(required=override == "cpu")
    elif choice == "torch":
        from services.engine.worker.attention.torch_backend import TorchBackend

        backend = TorchBackend()
    elif choice == "triton":
        from services.engine.worker.attention.triton_backend import TritonBackend

        backend = TritonBackend()
    else:
        raise ValueError(f"attention_backend={choice!r} is unknown (choose 'cpu', 'torch' or 'triton')")
    log.info("kvferry backend: %s (%s) on %s", backend.name, backend.description, device)
    return backend


def _cpu_backend(required: bool) -> ComputeBackend:
    """The C++ kernels when they build here, else the torch backend (with a line saying why)."""
    import kvkernels.cpu as cpu_ops

    if cpu_ops.available():
        from services.engine.worker.attention.cpu_backend import CpuBackend

        return CpuBackend(cpu_ops)
    reason = cpu_ops.unavailable_reason()
    if required:
        raise ValueError(f"attention_backend='cpu': the C++ CPU kernels are unavailable ({reason})")
    log.warning("kvferry CPU kernels unavailable (%s); using the plain torch backend", reason)
    from services.engine.worker.attention.torch_backend import TorchBackend

    return TorchBackend()
