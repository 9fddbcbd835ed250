"""CpuBackend: the engine's compute ops as C++ CPU kernels (kvkernels/cpu): paged attention read in place.

One ``paged_attention`` call per layer serves the whole mixed batch (decodes and prefill chunks):
K/V blocks are read where they lie in the block-major cache (no gather copy), the query heads of a
KV head are processed together so each block is read once, softmax is online, and long single-token
decodes are split across threads with a reduce pass. RMSNorm(+residual), rotary and SiLU-and-mul
are fused kernels with the torch path's exact roundings.
"""

from __future__ import annotations

from types import ModuleType

import torch

from services.engine.worker.attention.metadata import AttentionMetadata, build_metadata
from services.engine.worker.grouped_moe import grouped_moe


class CpuBackend:
    """Ops through ``kvkernels.cpu`` (build it with ``python -m kvkernels.cpu.build``; ``make setup`` does)."""

    name = "cpu"
    description = "C++ CPU kernels: in-place paged attention (GQA-grouped, split-KV), fused norm/rotary/SiLU"

    build_metadata = staticmethod(build_metadata)  # the kernel reads the generic metadata directly

    def __init__(self, ops: ModuleType) -> None:
        self._ops = ops  # kvkernels.cpu (its wrappers), already checked to be available
        # per cache tensor (a draft model has its own): its layers' (key, value) views (microseconds each)
        self._views: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._ops.rms_norm(x, weight, eps), x
        normed, summed = self._ops.fused_add_rms_norm(x, residual, weight, eps)
        return normed, summed

    @staticmethod
    def rope_inputs(
        positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, cos_sin_cache

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on the q/k views of the fused qkv projection (they are fresh activations)."""
        positions, cache = rope
        self._ops.rotary_embedding(positions, q, k, cache, True)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return grouped_moe(x, w13, w2, topk_weights, topk_ids, self.silu_and_mul, w13_scale, w2_scale)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the layer's blocks, then attend every query row of the batch."""
        key_cache, value_cache = self._layer_caches(kv_cache, layer)
        self._ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        return self._ops.paged_attention(
            out,
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            window=window,
            sinks=sinks,
        )

    def _layer_caches(self, kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value cache views of ``kv_cache``, cut once per cache tensor."""
        cache, views = self._views.get(id(kv_cache), (None, []))
        if cache is not kv_cache:
            views = [(kv_cache[:, i, 0], kv_cache[:, i, 1]) for i in range(kv_cache.shape[1])]
            if len(self._views) >= 4:  # caches replaced (re-profiled, re-sized): forget the old ones
                self._views.clear()
            self._views[id(kv_cache)] = (kv_cache, views)
        return views[layer]
