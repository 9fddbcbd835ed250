"""WorkerStats: what tests, benchmarks and the metrics may read of a built worker, without its internals."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.worker.loader.model_loader import weight_bytes
from services.engine.worker.model_runner import ModelRunner
from services.engine.worker.multimodal.vision_step import VisionStep


@dataclass(frozen=True)
class WorkerStats:
    """This rank's resident weights and KV cache, the kinds of layer it built, and its feature counters."""

    weight_bytes: int  # packed bytes for quantized layers
    kv_cache_bytes: int
    kv_cache_shape: tuple[int, ...]  # [blocks, layers, 2, block_size, kv_heads, head_dim] on this rank
    kv_bytes_per_token: int  # one token's KV over all of this rank's layers (MLA: its latents)
    layer_kinds: frozenset[str]  # class names of the model's modules (e.g. "Int8Linear", "TPRowLinear")
    speculative: bool  # a proposer drafts tokens here (rank 0)
    graph_replays: int  # decode steps replayed from a CUDA graph, since start
    encoder_calls: int  # vision tower batches, since start (0 for a text model)
    encoded_items: int  # images and videos encoded, since start
    encoder_cache_items: int  # images and videos whose features the encoder cache holds now

    @classmethod
    def of(cls, model: torch.nn.Module, runner: ModelRunner) -> WorkerStats:
        cache = runner.kv_cache
        vision = runner.vision
        calls, items, held = (
            (vision.cache.encoder_calls, vision.cache.encoded_items, len(vision.cache.entries))
            if isinstance(vision, VisionStep)
            else (0, 0, 0)
        )
        return cls(
            weight_bytes=weight_bytes(model),
            kv_cache_bytes=cache.numel() * cache.element_size(),
            kv_cache_shape=tuple(cache.shape),
            kv_bytes_per_token=_bytes_per_token(cache),
            layer_kinds=frozenset(type(m).__name__ for m in model.modules()),
            speculative=runner.spec.proposes,
            graph_replays=runner.graphs.replays,
            encoder_calls=calls,
            encoded_items=items,
            encoder_cache_items=held,
        )


def _bytes_per_token(cache: torch.Tensor) -> int:
    """One token's bytes in a block-major cache [blocks, layers, 2, block_size, heads, dim] (0: no cache)."""
    if cache.dim() != 6:
        return 0
    blocks, layers, _, block_size, heads, dim = cache.shape
    return layers * 2 * heads * dim * cache.element_size()
