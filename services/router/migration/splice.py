"""Splice: one client stream made of several engines' streams (completion-shaped SSE events, one choice).

It records what each engine sent (token ids, text) and rewrites the resuming engine's events so the client
sees one stream: the first engine's ``id`` and ``created``, logprob text offsets continued, usage counted
from the original prompt, a stop string spanning the splice honoured, token ids only when asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.openai.sse import SSEEvent
from services.common.openai.tokenizer import Tokenizer
from services.router.migration.stop_carry import StopCarry

_CONTEXT = 5  # prompt tokens the engines decode as context of the first output token (as the engines do)
_BACK = 8  # tokens a resume point may step back to start at a whole character
_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass
class Splice:
    """State of one migratable stream across its engines."""

    prompt: list[int]
    stops: tuple[str, ...]
    client_wants_ids: bool
    skip_special: bool = True
    ids: list[int] = field(default_factory=list)  # output token ids the engines reported
    text: str = ""  # output text sent to the client
    finished: bool = False  # a choice carried its finish_reason
    migrated: bool = False
    resumed: int = 0  # output tokens the current engine got as prompt
    offset_shift: int = 0  # where the current engine's text starts in the output (logprob offsets)
    skip_tokens: int = 0  # tokens the current engine draws again (their logprobs and ids were sent)
    skip_chars: int = 0  # characters of its text the client already has
    header: dict[str, Any] | None = None  # the first engine's id and created
    carry: StopCarry | None = None
    tokenizer: Tokenizer | None = None  # set at the first resume
    stop_tokens: int | None = None  # output tokens up to the end of a stop string found across the splice

    def resume(self, tokenizer: Tokenizer) -> int:
        """A new engine takes over: the output tokens it gets as prompt (it draws the rest again, the same
        tokens: draws are keyed by position), chosen so its text starts at a whole character. What the failed
        engine held back (text the client has not seen) is carried, and searched for a stop string."""
        self.tokenizer = tokenizer
        k, text = len(self.ids), ""
        for k in range(len(self.ids), max(len(self.ids) - _BACK, 0) - 1, -1):
            text = self._text(k)
            if not text.endswith("\ufffd") and (text.startswith(self.text) or self.text.startswith(text)):
                break
        held = text[len(self.text) :] if text.startswith(self.text) else ""
        self.skip_chars = max(len(self.text) - len(text), 0)
        self.skip_tokens = len(self.ids) - k
        self.ids = self.ids[:k]
        self.migrated, self.resumed, self.offset_shift = True, k, len(text)
        self.carry = StopCarry(self.stops, held, len(held)) if held else None  # sent with the next text
        return k

    def _text(self, tokens: int) -> str:
        """The output text of the first ``tokens`` output tokens, decoded as the engines decode it."""
        assert self.tokenizer is not None
        context = self.prompt[-_CONTEXT:]
        base = len(self.tokenizer.decode(context, skip_special_tokens=self.skip_special))
        return self.tokenizer.decode(context + self.ids[:tokens], skip_special_tokens=self.skip_special)[
            base:
        ]

    def _tokens_to(self, chars: int) -> int:
        """The fewest output tokens whose text reaches ``chars`` characters (the engines' token count at a
        stop string: the resuming engine has drawn a few more, their text held back)."""
        return next(
            (j for j in range(self.resumed, len(self.ids) + 1) if len(self._text(j)) >= chars), len(self.ids)
        )

    def rewrite(self, event: SSEEvent) -> tuple[list[SSEEvent], str | None]:
        """The events to send for one engine event, and the spanning stop string if one ended the stream."""
        data = json.loads(event.data)
        if self.header is None:
            self.header = {k: data.get(k) for k in ("id", "object", "created", "model")}
        elif self.migrated:
            data.update({k: v for k, v in self.header.items() if v is not None})
        if data.get("usage") and self.resumed:
            usage = data["usage"]
            usage["prompt_tokens"] -= self.resumed
            usage["completion_tokens"] += self.resumed
        stop = None
        for choice in data.get("choices") or []:
            stop = self._choice(choice) or stop
        return self._events(data), stop

    def _choice(self, choice: dict[str, Any]) -> str | None:
        new_ids = choice.get("token_ids") or []
        self.ids += new_ids
        if drop := min(self.skip_tokens, len(new_ids)):  # drawn again: the client has them
            self.skip_tokens -= drop
            choice["token_ids"] = new_ids[drop:]
            if lps := choice.get("logprobs"):
                for key in _LOGPROB_KEYS:
                    lps[key] = (lps.get(key) or [])[drop:]
                choice["logprobs"] = lps if lps["tokens"] else None
        if not self.client_wants_ids:
            choice.pop("token_ids", None)
        text = choice.get("text") or ""
        if self.skip_chars:
            cut = min(self.skip_chars, len(text))
            text, self.skip_chars = text[cut:], self.skip_chars - cut
        stop = None
        if self.carry is not None:
            sent, stop = self.carry.push(text)
            if choice.get("finish_reason") and stop is None:
                sent += self.carry.flush()
            text = sent
            if stop is not None:
                choice.update(finish_reason="stop", stop_reason=stop)
                self.stop_tokens = self._tokens_to(len(self.text) + len(text) + len(stop))
        if (lps := choice.get("logprobs")) and self.offset_shift:
            lps["text_offset"] = [o + self.offset_shift for o in lps.get("text_offset") or []]
        choice["text"] = text
        self.text += text
        self.finished = self.finished or bool(choice.get("finish_reason"))
        return stop

    def _events(self, data: dict[str, Any]) -> list[SSEEvent]:
        choices = data.get("choices")
        empty = choices and all(
            not c.get("text")
            and not c.get("finish_reason")
            and not c.get("logprobs")
            and "token_ids" not in c
            for c in choices
        )
        return [] if empty else [SSEEvent(json.dumps(data, separators=(",", ":"), ensure_ascii=False))]

    def finish_event(self, reason: str) -> SSEEvent:
        """The last chunk an engine that failed after the stream's last token did not send."""
        self.finished = True
        text = self.carry.flush() if self.carry is not None else ""
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        return SSEEvent(json.dumps({**(self.header or {}), "choices": [choice]}, separators=(",", ":")))

    def usage_event(self, prompt_tokens: int) -> SSEEvent:
        """The usage chunk of a stream the router ended (a stop string spanning the splice)."""
        tokens = len(self.ids) if self.stop_tokens is None else self.stop_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        }
        data = {**(self.header or {}), "choices": [], "usage": usage}
        return SSEEvent(json.dumps(data, separators=(",", ":")))
