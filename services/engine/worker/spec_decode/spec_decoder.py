"""SpecDecoder: the runner's side of speculative decoding: who drafts, with which proposer, how it went."""

from __future__ import annotations

from typing import Protocol

import torch

from services.engine.core.spec_config import SpeculativeConfig
from services.engine.core.spec_stats import draft_room
from services.engine.worker.input_batch import CachedRequestState
from services.engine.worker.spec_decode.draft_gate import DraftGate
from services.engine.worker.spec_decode.proposal import Proposal

StepResult = tuple[str, CachedRequestState, bool, int, int]  # req_id, state, sampled, hidden row, first pos


class Proposer(Protocol):
    """Drafts for the requests of one step (only those with ``want`` set; others may update state).

    ``hidden``: the target's final hidden states of the step's tokens (an EAGLE head reads them).
    """

    def propose(self, batch: list[Proposal], hidden: torch.Tensor) -> dict[str, tuple[int, ...]]: ...

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        """The requests left the runner (finished or preempted)."""


class SpecDecoder:
    """Gates requests (eligibility, acceptance back-off, batch size) and asks the proposer for drafts.

    Structured-output requests and embeddings never draft: their tokens go through the grammar mask
    one at a time, or nothing is sampled.
    """

    proposes = True  # (NoSpec, its stand-in without speculation, proposes nothing)

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        assert config.min_acceptance is not None  # resolved by the config's validator
        self.min_acceptance = config.min_acceptance
        self.gates: dict[str, DraftGate] = {}
        self.overall = DraftGate(self.min_acceptance)  # every request's rounds: new requests start from it

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        for rid in req_ids:
            self.gates.pop(rid, None)
        self.proposer.forget(req_ids)

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified round: the request's gate learns how many of its drafts were right."""
        self.overall.record(num_drafts, num_accepted)
        self._gate(req_id).record(num_drafts, num_accepted)

    def _gate(self, req_id: str) -> DraftGate:
        gate = self.gates.get(req_id)
        if gate is None:
            gate = self.gates[req_id] = self.overall.spawn()
        return gate

    def propose(
        self, steps: list[StepResult], hidden: torch.Tensor
    ) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Drafts for the next step of each scheduled request (its state holds this step's tokens)."""
        limit = self.config.disable_by_batch_size
        on = limit is None or len(steps) <= limit
        batch = []
        for rid, st, sampled, row, start in steps:
            if st.pooling is not None:
                continue
            gate = self._gate(rid)
            eligible = on and sampled and st.params.structured_outputs is None
            room = draft_room(len(st.token_ids), len(st.output_ids), st.params.max_tokens, self.max_model_len)
            want = eligible and gate.open and room > 0
            if eligible and not gate.open:
                gate.step()
            batch.append(Proposal(rid, st, st.num_computed, sampled, want, room, row, start))
        drafts = self.proposer.propose(batch, hidden)
        return tuple((p.req_id, drafts[p.req_id]) for p in batch if p.req_id in drafts)
