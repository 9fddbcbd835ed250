"""TritonBackend: the engine's compute ops as Triton kernels (kvkernels/), the path on CUDA GPUs."""

from __future__ import annotations

from typing import cast

import torch

from services.engine.worker.attention.metadata import AttentionMetadata, build_metadata


class TritonBackend:
    """RMSNorm(+residual), rotary, SiLU-and-mul, cache write and paged attention via kvkernels/."""

    name = "triton"
    description = "Triton kernels: paged decode (split-K) and prefill attention, fused RMSNorm, rotary"

    build_metadata = staticmethod(build_metadata)  # the kernels read the generic metadata directly

    def __init__(self) -> None:
        from kvkernels.activation import silu_and_mul
        from kvkernels.paged_decode_attention import paged_decode_attention
        from kvkernels.paged_prefill_attention import paged_prefill_attention
        from kvkernels.reshape_and_cache import reshape_and_cache
        from kvkernels.rms_norm import rms_norm
        from kvkernels.rotary import rotary_embedding

        self._silu_and_mul, self._rms_norm, self._rotary = silu_and_mul, rms_norm, rotary_embedding
        self._cache, self._decode, self._prefill = (
            reshape_and_cache,
            paged_decode_attention,
            paged_prefill_attention,
        )

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return cast(torch.Tensor, self._rms_norm(x, weight, eps)), x
        return cast(tuple[torch.Tensor, torch.Tensor], self._rms_norm(x, weight, eps, residual))

    @staticmethod
    def rope_inputs(
        positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, cos_sin_cache

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cache = rope
        return self._rotary(positions, q, k, cache, is_neox=True)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x)

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
        from kvkernels.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)

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
        """Write this step's K/V, then decode attention (all queries 1 token) or prefill attention."""
        key_cache, value_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
        self._cache(k, v, key_cache, value_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            return self._decode(
                q,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                window=window,
                sinks=sinks,
            )
        return self._prefill(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            max_query_len=meta.max_query_len,
            window=window,
            sinks=sinks,
        )
