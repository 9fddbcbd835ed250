"""The compute backends a model runs on (torch, Triton) and the choice between them."""

from __future__ import annotations

import logging

import torch

from services.engine.worker.attention.backend import ComputeBackend
from services.engine.worker.attention.metadata import AttentionMetadata, build_metadata

log = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "ComputeBackend", "build_metadata", "select_backend"]


def select_backend(device: torch.device, override: str | None = None) -> ComputeBackend:
    """Triton kernels on CUDA, plain torch elsewhere; ``override`` forces one ('torch' | 'triton')."""
    choice = override or ("triton" if device.type == "cuda" else "torch")
    backend: ComputeBackend
    if choice == "torch":
        from services.engine.worker.attention.torch_backend import TorchBackend

        backend = TorchBackend()
    elif choice == "triton":
        from services.engine.worker.attention.triton_backend import TritonBackend

        backend = TritonBackend()
    else:
        raise ValueError(f"attention_backend={choice!r} is unknown (choose 'torch' or 'triton')")
    log.info("kvferry backend: %s (%s) on %s", backend.name, backend.description, device)
    return backend
