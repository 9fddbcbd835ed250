"""SpecDecodingStats: drafts proposed and accepted since start (vLLM's spec_decode counters)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counted by the scheduler as each verified step comes back."""

    num_drafts: int = 0  # verification rounds: (request, step) pairs that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: rounds whose draft i+1 was accepted

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def draft_room(num_tokens: int, num_output: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many draft tokens a request may verify: a step emits up to one more token than it drafted,
    so drafts never carry it past max_tokens or the context length."""
    room = max_model_len - num_tokens - 1
    if max_tokens is not None:
        room = min(room, max_tokens - num_output - 1)
    return max(room, 0)
