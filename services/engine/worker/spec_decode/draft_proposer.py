"""DraftModelProposer: a smaller model with the target's tokenizer drafts greedily over its own paged KV.

Its KV cache is a second tensor indexed by the same block ids as the target's: the scheduler's block
manager allocates for both (with ``lookahead`` slots for the drafts it writes), so prefix-cache hits,
preemption and freed blocks apply to both at once. Each step, for the requests that draft next, it
first catches up on the tokens the target verified since it last ran for them (ragged, one forward for
the batch), then drafts ``k`` tokens one forward at a time; paused requests cost nothing (see
``DraftKVTracker``). KV that came through a connector (P/D, the kvstore) holds no draft KV: the draft
computes it itself on this engine (see ``NewRequestData.num_local_kv_tokens``).
"""

from __future__ import annotations

import torch

from services.engine.worker.models.interface import CausalLM
from services.engine.worker.spec_decode.draft_batch import DraftCache
from services.engine.worker.spec_decode.draft_kv import DraftKVTracker
from services.engine.worker.spec_decode.proposal import Proposal


class DraftModelProposer:
    """Greedy drafts from ``model`` over ``cache``."""

    def __init__(self, model: CausalLM, cache: DraftCache) -> None:
        self.model, self.cache, self.k = model, cache, cache.k
        self.kv = DraftKVTracker(cache.kv_cache.shape[0], cache.block_size)

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        self.kv.forget(req_ids)

    def propose(self, batch: list[Proposal], hidden: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """Catch the draft's KV up with the target's, then draft for the requests that want it."""
        rows: list[tuple[Proposal, int, int]] = []  # (request, first position, end) fed this round
        for p in batch:
            st = p.state
            self.kv.sync(p.req_id, st)
            end = min(len(st.token_ids), self.cache.capacity(p))
            if p.want and end > st.num_draft_computed:
                rows.append((p, st.num_draft_computed, end))
        if not rows:
            return {}
        logits = self._forward([(p, p.state.token_ids[a:b], a) for p, a, b in rows])
        drafting: list[tuple[Proposal, int]] = []  # (request, its next draft position)
        first: list[int] = []
        for i, (p, start, end) in enumerate(rows):
            self.kv.computed(p.state, start, end)
            p.state.num_draft_computed = end
            room = min(self.k, p.max_drafts, self.cache.capacity(p) - end + 1)
            if end == len(p.state.token_ids) and room > 0:
                drafting.append((p, end))
                first.append(i)
        if not drafting:
            return {}
        tokens = logits[first].argmax(dim=-1).tolist()
        drafts: dict[str, list[int]] = {p.req_id: [t] for (p, _), t in zip(drafting, tokens, strict=True)}
        live = drafting
        for step in range(1, self.k):
            live = [(p, pos) for p, pos in live if self._fits(p, pos, step)]
            if not live:
                break
            out = self._forward([(p, [drafts[p.req_id][-1]], pos + step - 1) for p, pos in live])
            for (p, _), t in zip(live, out.argmax(dim=-1).tolist(), strict=True):
                drafts[p.req_id].append(t)
        return {rid: tuple(d) for rid, d in drafts.items()}

    def _fits(self, p: Proposal, pos: int, step: int) -> bool:
        """Draft ``step`` (0-based) is fed at position pos + step - 1; it must stay in the slots and the context."""
        return step < min(p.max_drafts, self.cache.capacity(p) - pos + 1)

    def _forward(self, seqs: list[tuple[Proposal, list[int], int]]) -> torch.Tensor:
        """One draft forward over ragged sequences (tokens fed from a start position); last-row logits."""
        b, c = self.cache.batch(seqs), self.cache
        hidden = self.model(b.input_ids, b.positions, c.kv_cache, b.meta, c.backend)
        return self.model.compute_logits(hidden[b.last])
