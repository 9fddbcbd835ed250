"""IncrementalDetokenizer: streams text token by token, never splits UTF-8, handles stop strings."""

from __future__ import annotations

from services.common.openai.tokenizer import Tokenizer

_CONTEXT = 5  # prompt tokens decoded as context so the first output token renders with its leading space


class IncrementalDetokenizer:
    """Turns a growing token list into text; ``stop`` strings end the text and are never emitted."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stop_str: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add_tokens(self, token_ids: list[int] | tuple[int, ...]) -> str | None:
        """Append tokens; returns the stop string if one was hit (text is then final)."""
        for token in token_ids:
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                before = len(self.text)
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                if self.stop and self._check_stop(before):
                    return self.stop_str
        return None

    def _check_stop(self, new_from: int) -> bool:
        start = max(0, new_from - self.hold_back)
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0:
                self.stop_str = s
                self.text = self.text[: idx + len(s)] if self.include_stop_str else self.text[:idx]
                return True
        return False

    def take_delta(self, final: bool) -> str:
        """Text not yet emitted; unless final, withholds a tail that could still become a stop string."""
        end = (
            len(self.text)
            if (final or self.stop_str is not None)
            else max(self.emitted, len(self.text) - self.hold_back)
        )
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
