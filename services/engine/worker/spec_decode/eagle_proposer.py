"""EagleProposer: an EAGLE head drafts from the target's hidden states, one head forward per draft.

Draft position p holds (token p + 1, target feature at p); the head's output there is its guess of the
feature at p + 1, which the target's LM head scores. After a verified step the head catches up on the
positions the target computed in that step (their features are this step's hidden states), then
drafts autoregressively on its own predicted features. Its KV (one layer) shares the target's block
ids like a draft model's. KV that came through a connector has no features here: the head skips
those positions (its drafts for such a request see less context, so fewer are accepted).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.worker.models.eagle import EagleHead
from services.engine.worker.models.interface import CausalLM
from services.engine.worker.spec_decode.draft_batch import DraftCache
from services.engine.worker.spec_decode.proposal import Proposal


class EagleProposer:
    """Greedy drafts from ``head`` over ``cache``, scored by the target's LM head."""

    def __init__(self, head: EagleHead, target: CausalLM, cache: DraftCache) -> None:
        self.head, self.target, self.cache, self.k = head, target, cache, cache.k
        embed = getattr(target, "embed_tokens", None)
        if not isinstance(embed, nn.Module):
            raise ValueError("speculative_config: EAGLE needs a target with a token embedding (embed_tokens)")
        self.embed = embed

    def forget(self, req_ids: frozenset[str] | set[str]) -> None:
        """Nothing per request is kept here."""

    def propose(self, batch: list[Proposal], hidden: torch.Tensor) -> dict[str, tuple[int, ...]]:
        runs: list[tuple[Proposal, int, int]] = []  # (request, first draft position, end)
        for p in batch:
            first = max(p.state.num_draft_computed, p.step_start)  # features exist from step_start on
            end = min(p.computed_end, self.cache.capacity(p))
            if end > first:
                runs.append((p, first, end))
            p.state.num_draft_computed = max(p.state.num_draft_computed, end)
        if not runs:
            return {}
        rows = [p.hidden_row + q - p.step_start for p, first, end in runs for q in range(first, end)]
        feats = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        out, last = self._forward([(p, p.state.token_ids[a + 1 : b + 1], a) for p, a, b in runs], feats)
        live = [
            (i, p, end)
            for i, (p, _, end) in enumerate(runs)
            if p.want and p.sampled and end == len(p.state.token_ids) - 1 and p.max_drafts > 0
        ]
        if not live:
            return {}
        idx = torch.tensor([i for i, _, _ in live], dtype=torch.long, device=out.device)
        feat = out[last[idx]]
        tokens = self.target.compute_logits(feat).argmax(dim=-1).tolist()
        drafts = {p.req_id: [t] for (_, p, _), t in zip(live, tokens, strict=True)}
        steps = [(p, end, f) for (_, p, end), f in zip(live, feat, strict=True)]
        for s in range(1, self.k):  # draft s + 1 reads (draft s, predicted feature) at position end + s - 1
            steps = [
                (p, end, f)
                for p, end, f in steps
                if s < p.max_drafts and end + s - 1 < self.cache.capacity(p)
            ]
            if not steps:
                break
            runs2 = [(p, [drafts[p.req_id][-1]], end + s - 1) for p, end, _ in steps]
            out, last = self._forward(runs2, torch.stack([f for _, _, f in steps]))
            feat = out[last]
            for (p, _, _), t in zip(
                steps, self.target.compute_logits(feat).argmax(dim=-1).tolist(), strict=True
            ):
                drafts[p.req_id].append(t)
            steps = [(p, end, f) for (p, end, _), f in zip(steps, feat, strict=True)]
        return {rid: tuple(d) for rid, d in drafts.items()}

    def _forward(
        self, seqs: list[tuple[Proposal, list[int], int]], features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over ragged runs (token ids with their features); all output rows and each run's last row."""
        b, c = self.cache.batch(seqs), self.cache
        out = self.head(self.embed(b.input_ids), features, b.positions, c.kv_cache, b.meta, c.backend)
        return out, b.last
