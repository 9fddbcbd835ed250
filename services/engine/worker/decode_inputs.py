"""DecodeInputs: consecutive decode-only steps of the same requests update the last step's arrays in place.

In steady decoding the batch is the same requests, one token each, step after step: positions and
sequence lengths grow by one, a request crosses into a new block every ``block_size`` tokens. So
instead of rebuilding every tensor from Python lists, the arrays of the previous step are advanced
(and a new block id written into its row). Any other step (a request joins or leaves, a prefill
chunk, prompt logprobs, a backend with its own per-step plan) rebuilds, and the result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.core.outputs import SchedulerOutput
from services.engine.worker.attention import AttentionMetadata, ComputeBackend, build_metadata
from services.engine.worker.device_copy import to_device
from services.engine.worker.input_batch import CachedRequestState, StepInputs, build_inputs

_SPARE_BLOCKS = 8  # block-table columns kept free so a growing batch rarely forces a rebuild


@dataclass
class _Arrays:
    """The host arrays one decode step is made of (tensors share their memory)."""

    order: tuple[str, ...]
    ids: np.ndarray  # [B] int64: the token each request feeds
    positions: np.ndarray  # [B] int64
    slots: np.ndarray  # [B] int64
    seq_lens: np.ndarray  # [B] int32
    table: np.ndarray  # [B, width] int32
    num_blocks: np.ndarray  # [B] int64: filled columns of each table row


class DecodeInputs:
    """``build`` returns the same StepInputs ``build_inputs`` would, in place where the step allows it."""

    def __init__(self, backend: ComputeBackend, block_size: int, device: torch.device) -> None:
        self.backend, self.block_size, self.device = backend, block_size, device
        self._generic = getattr(backend, "build_metadata", None) is build_metadata
        self._prev: _Arrays | None = None
        self.num_updated = 0  # steps served in place (for tests)

    def invalidate(self) -> None:
        """A block table lost its tail (freed draft slots): the next step rebuilds its arrays."""
        self._prev = None

    def build(self, sched: SchedulerOutput, states: dict[str, CachedRequestState]) -> StepInputs:
        order = tuple(r for r, _ in sched.num_scheduled_tokens)
        decode_only = bool(order) and not sched.spec_token_ids
        decode_only = decode_only and all(n == 1 for _, n in sched.num_scheduled_tokens)
        decode_only = decode_only and all(
            states[r].num_computed + 1 == len(states[r].token_ids) for r in order
        )
        if not (
            self._generic
            and decode_only
            and not any(states[r].params.prompt_logprobs is not None for r in order)
        ):
            self._prev = None
            return build_inputs(sched, states, self.backend, self.block_size, self.device)
        prev = self._prev
        if prev is None or prev.order != order or not self._advance(prev, states):
            prev = self._prev = self._fresh(order, states)
        else:
            self.num_updated += 1
        return self._inputs(prev)

    def _fresh(self, order: tuple[str, ...], states: dict[str, CachedRequestState]) -> _Arrays:
        bs, rows = self.block_size, [states[r] for r in order]
        width = max(len(st.block_ids) for st in rows) + _SPARE_BLOCKS
        table = np.zeros((len(rows), width), dtype=np.int32)
        for i, st in enumerate(rows):
            table[i, : len(st.block_ids)] = st.block_ids
        positions = np.fromiter((st.num_computed for st in rows), dtype=np.int64, count=len(rows))
        blocks = table[np.arange(len(rows)), positions // bs].astype(np.int64)
        return _Arrays(
            order=order,
            ids=np.fromiter((st.token_ids[-1] for st in rows), dtype=np.int64, count=len(rows)),
            positions=positions,
            slots=blocks * bs + positions % bs,
            seq_lens=(positions + 1).astype(np.int32),
            table=table,
            num_blocks=np.fromiter((len(st.block_ids) for st in rows), dtype=np.int64, count=len(rows)),
        )

    def _advance(self, prev: _Arrays, states: dict[str, CachedRequestState]) -> bool:
        """One token further for every request; False when a row outgrew the table (rebuild)."""
        bs = self.block_size
        for i, rid in enumerate(prev.order):
            st = states[rid]
            if st.num_computed != prev.positions[i] + 1:
                return False
            n = len(st.block_ids)
            if n != prev.num_blocks[i]:
                if n > prev.table.shape[1]:
                    return False
                prev.table[i, prev.num_blocks[i] : n] = st.block_ids[prev.num_blocks[i] :]
                prev.num_blocks[i] = n
            prev.ids[i] = st.token_ids[-1]
        prev.positions += 1
        prev.seq_lens += 1
        rows = np.arange(len(prev.order))
        prev.slots[:] = prev.table[rows, prev.positions // bs].astype(np.int64) * bs + prev.positions % bs
        return True

    def _inputs(self, a: _Arrays) -> StepInputs:
        dev, batch = self.device, len(a.order)

        def as_tensor(x: np.ndarray) -> torch.Tensor:  # the arrays change next step: copied (pinned) now
            return to_device(torch.from_numpy(x), dev)

        table = torch.from_numpy(a.table)
        meta = AttentionMetadata(
            slot_mapping=as_tensor(a.slots),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens=as_tensor(a.seq_lens),
            block_tables=as_tensor(a.table),
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=int(a.seq_lens.max()),
            q_lens_host=[1] * batch,
            seq_lens_host=a.seq_lens.tolist(),
            block_tables_host=table,
        )
        return StepInputs(
            input_ids=as_tensor(a.ids),
            positions=as_tensor(a.positions),
            meta=meta,
            sample_rows=list(range(batch)),
            logits_idx=torch.arange(batch, dtype=torch.long, device=dev),
        )
