"""DraftGate: one request stops proposing for a while when its recent drafts are mostly rejected."""

from __future__ import annotations

_SMOOTHING = 0.5  # weight of the newest round in the running acceptance
_FIRST_PAUSE, _MAX_PAUSE = 4, 128  # steps without drafts after a poor run; doubles while it stays poor


class DraftGate:
    """A running acceptance rate; below ``min_acceptance`` the request pauses (doubling back-off)."""

    def __init__(self, min_acceptance: float) -> None:
        self.min_acceptance = min_acceptance
        self.rate = 1.0
        self.pause_left = 0
        self.next_pause = _FIRST_PAUSE
        self.poor = False  # the last round was below min_acceptance

    @property
    def open(self) -> bool:
        return self.pause_left == 0

    def step(self) -> None:
        """One step passed without proposing."""
        self.pause_left = max(self.pause_left - 1, 0)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """The verified result of one round of ``num_drafts`` proposals."""
        if num_drafts <= 0:
            return
        self.rate = (1 - _SMOOTHING) * self.rate + _SMOOTHING * num_accepted / num_drafts
        self.poor = self.rate < self.min_acceptance
        if not self.poor:
            self.next_pause = _FIRST_PAUSE
            return
        self.pause_left = self.next_pause
        self.next_pause = min(self.next_pause * 2, _MAX_PAUSE)
        self.rate = self.min_acceptance  # a fresh start after the pause: one good round reopens it

    def spawn(self) -> DraftGate:
        """A gate for a new request that starts where this one (every request's rounds) stands: a
        proposer that has been poor lately starts new requests paused, at its current back-off."""
        gate = DraftGate(self.min_acceptance)
        gate.rate, gate.next_pause, gate.poor = self.rate, self.next_pause, self.poor
        gate.pause_left = self.next_pause // 2 if self.poor else 0
        return gate
