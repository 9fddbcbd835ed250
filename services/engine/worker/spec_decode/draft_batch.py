"""DraftCache / DraftBatch: a draft's (model or head) paged KV and one ragged forward's inputs over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.worker.attention import AttentionMetadata, ComputeBackend
from services.engine.worker.spec_decode.proposal import Proposal


@dataclass
class DraftBatch:
    """Flattened inputs: ``last`` holds the row of each run's last token (where its next draft is read)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last: torch.Tensor


def build_draft_batch(
    runs: list[tuple[list[int], list[int], int]],
    block_size: int,
    backend: ComputeBackend,
    device: torch.device,
) -> DraftBatch:
    """``runs``: (block ids, tokens, position of the first token) per request; KV goes to those slots."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    q_lens, seq_lens, tables, last = [], [], [], []
    for blocks, toks, start in runs:
        positions = range(start, start + len(toks))
        ids.extend(toks)
        pos.extend(positions)
        slots.extend(blocks[q // bs] * bs + q % bs for q in positions)
        q_lens.append(len(toks))
        seq_lens.append(start + len(toks))
        tables.append(blocks)
        last.append(len(ids) - 1)
    return DraftBatch(
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(pos, dtype=torch.long, device=device),
        backend.build_metadata(q_lens, seq_lens, tables, slots, bs, device),
        torch.tensor(last, dtype=torch.long, device=device),
    )


@dataclass(frozen=True)
class DraftCache:
    """Where a draft model or head runs: its KV tensor [num_blocks, layers, 2, block, kv heads, dim]
    (indexed by the target's block ids), the drafts per step ``k``, and the context bound."""

    kv_cache: torch.Tensor
    k: int
    block_size: int
    backend: ComputeBackend
    device: torch.device
    max_model_len: int

    def capacity(self, p: Proposal) -> int:
        """Positions the request's blocks (and the context) have room for."""
        return min(len(p.state.block_ids) * self.block_size, self.max_model_len)

    def batch(self, runs: list[tuple[Proposal, list[int], int]]) -> DraftBatch:
        """``runs``: (request, tokens, position of the first token) -> one forward's inputs."""
        blocks = [(p.state.block_ids, toks, start) for p, toks, start in runs]
        return build_draft_batch(blocks, self.block_size, self.backend, self.device)
