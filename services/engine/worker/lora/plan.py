"""LoRAPlan: a step's rows grouped by adapter slot (segments), built once and reused by every LoRA layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAPlan:
    """Rows under an adapter, grouped by slot: ``rows[seg_start[g]:seg_start[g + 1]]`` use ``seg_slot[g]``.

    Rows of the base model are in no segment. ``row_slot`` is each grouped row's slot; the ``*_host``
    lists are the same segments on the host (loops and launch grids need them without a device sync).
    """

    rows: torch.Tensor  # int64 [P]: row indices, grouped by slot, ascending within a slot
    row_slot: torch.Tensor  # int64 [P]
    seg_start: torch.Tensor  # int64 [G + 1]
    seg_slot: torch.Tensor  # int64 [G]
    seg_start_host: tuple[int, ...]
    seg_slot_host: tuple[int, ...]
    num_rows: int  # rows of the activations the plan indexes (T), grouped or not

    @property
    def max_segment(self) -> int:
        """The longest segment's row count."""
        return max(b - a for a, b in zip(self.seg_start_host, self.seg_start_host[1:], strict=False))


def segment_plan(slot_of_row: list[int], device: torch.device) -> LoRAPlan | None:
    """The plan for rows whose adapter slots are ``slot_of_row`` (-1: the base model); None if no row has one."""
    order = sorted((slot, row) for row, slot in enumerate(slot_of_row) if slot >= 0)
    if not order:
        return None
    seg_slot: list[int] = []
    seg_start: list[int] = []
    for i, (slot, _) in enumerate(order):
        if not seg_slot or slot != seg_slot[-1]:
            seg_slot.append(slot)
            seg_start.append(i)
    seg_start.append(len(order))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return LoRAPlan(
        rows=tensor([row for _, row in order]),
        row_slot=tensor([slot for slot, _ in order]),
        seg_start=tensor(seg_start),
        seg_slot=tensor(seg_slot),
        seg_start_host=tuple(seg_start),
        seg_slot_host=tuple(seg_slot),
        num_rows=len(slot_of_row),
    )
