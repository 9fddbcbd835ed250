"""DraftBatch: one ragged forward of a draft (model or head) over requests' token runs in the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.worker.attention import AttentionMetadata, ComputeBackend


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
