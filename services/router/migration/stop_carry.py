"""StopCarry: finds a stop string that spans the splice of two engines' texts.

The failed engine held back the tail of its text that could begin a stop string (``held``); the resuming
engine checks only its own text. Until no stop string can start inside ``held`` any more, the resumed text
is buffered here and searched for a stop string that starts there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopCarry:
    """``push`` new text; it answers the text safe to send and the stop string found (if any)."""

    stops: tuple[str, ...]
    buffer: str  # text not sent yet: first the failed engine's held-back tail, then resumed text
    span: int  # the held-back tail's length: a stop starting before it spans the splice

    @property
    def active(self) -> bool:
        return self.span > 0

    def push(self, text: str) -> tuple[str, str | None]:
        """(text to send now, the spanning stop string found or None); once inactive it passes text through."""
        if not self.active:
            return text, None
        self.buffer += text
        hits = [(self.buffer.find(s), s) for s in self.stops]
        spanning = [(i, s) for i, s in hits if 0 <= i < self.span]
        if spanning:
            i, stop = min(spanning)
            out, self.buffer, self.span = self.buffer[:i], "", 0
            return out, stop
        keep = next(
            (i for i in range(self.span) if any(s.startswith(self.buffer[i:]) for s in self.stops)), None
        )
        if keep is None:  # no stop can start in the tail any more: the resuming engine checks the rest
            out, self.buffer, self.span = self.buffer, "", 0
            return out, None
        out, self.buffer = self.buffer[:keep], self.buffer[keep:]
        self.span -= keep
        return out, None

    def flush(self) -> str:
        """All buffered text (the resumed stream ended)."""
        out, self.buffer, self.span = self.buffer, "", 0
        return out
