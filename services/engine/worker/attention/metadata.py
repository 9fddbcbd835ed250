"""AttentionMetadata: what every backend needs for one step, built once and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.worker.device_copy import to_device


@dataclass
class AttentionMetadata:
    """What every backend needs for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    q_lens_host: list[int]  # the same lengths on the host, for backends that plan per sequence
    seq_lens_host: list[int]
    block_tables_host: torch.Tensor  # [B, max_blocks] int32 on the CPU

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slots: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build metadata from per-sequence query lengths, total lengths, block ids and token slots."""
    max_blocks = max((len(b) for b in block_tables), default=1) or 1
    table = torch.zeros((len(block_tables), max_blocks), dtype=torch.int32)
    for i, ids in enumerate(block_tables):
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    table.clamp_(min=0)  # -1: a block freed before the sliding window (never read; any valid id will do)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), device),
        query_start_loc=to_device(torch.tensor(starts, dtype=torch.int32), device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        block_tables=to_device(table, device) if device.type != "cpu" else table,
        block_size=block_size,
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        q_lens_host=q_lens,
        seq_lens_host=seq_lens,
        block_tables_host=table,
    )
