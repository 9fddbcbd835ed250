"""ComputeBackend: the per-layer ops a model calls (norm, rotary, activation, paged attention), as a Protocol."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from services.engine.worker.attention.metadata import AttentionMetadata


class ComputeBackend(Protocol):
    """What a model needs from a backend. Not only attention: RMSNorm, rotary and SiLU-and-mul too, so that
    one backend (plain torch, a C++ extension, Triton kernels) owns every op that touches activations."""

    name: str
    description: str

    def build_metadata(
        self,
        q_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slots: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """The step's metadata (and any per-step plan the backend keeps in a subclass of it)."""
        ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual) with HF Llama semantics."""
        ...

    def rope_inputs(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> Any:
        """Whatever ``rotary`` needs for this step's positions, built once for all layers."""
        ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated (neox / rotate-half convention)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[:, :I]) * x[:, I:] for x [T, 2I]."""
        ...

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
        """The experts of a MoE layer: sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k].

        x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, K] -> [T, H].
        With scales ([E, 2I] / [E, H], x's dtype) w13 / w2 are int8 codes scaled per (expert, row)."""
        ...

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
        """Write this step's k/v [T, Hkv, D] into the paged cache, then attend: q [T, Hq, D] -> [T, Hq, D].

        window > 0: sliding-window attention, a query at position p sees positions (p - window, p] and
        nothing before them is read (those blocks may already be freed and reused).
        sinks [Hq] (fp32): gpt-oss attention sinks, each head's softmax runs over [scores, sinks[h]] and the
        sink's column is dropped (it only adds exp(sinks[h]) to the denominator); None: plain softmax."""
        ...
