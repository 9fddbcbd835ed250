"""Proposal: what a proposer is told about one scheduled request after the target's step."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.worker.input_batch import CachedRequestState


@dataclass
class Proposal:
    """One scheduled request: its state (this step's sampled tokens appended) and what it may draft."""

    req_id: str
    state: CachedRequestState
    computed_end: int  # tokens whose target KV is written after this step
    sampled: bool  # it sampled (its prompt is done): its last token has no KV yet
    want: bool  # drafts are wanted (eligible and its gate is open)
    max_drafts: int  # how many fit in its context (the scheduler caps by max_tokens too)
    hidden_row: int = 0  # row of the step's hidden states holding its first computed position
    step_start: int = 0  # its first position computed in this step


def accepted_prefix(targets: list[int], drafts: tuple[int, ...] | list[int]) -> int:
    """How many drafts the target's own tokens confirm (the rule of greedy and of point-mass drafts).

    ``targets[j]`` is the target's token at draft position j, sampled from the target's distribution
    given the sequence with drafts[:j]. Accepting draft j exactly when it equals targets[j], and else
    emitting targets[j], is the standard accept / resample rule for a draft that proposes one token
    with certainty (q = 1): accept with probability p(d), on rejection sample from p without d. So the
    emitted tokens follow the target's distribution, and with per-request seeds they are the tokens
    non-speculative decoding would draw.
    """
    n = 0
    for t, d in zip(targets, drafts, strict=False):
        if t != d:
            break
        n += 1
    return n
