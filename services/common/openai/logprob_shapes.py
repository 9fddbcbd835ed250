"""Chat-shaped logprobs (one entry per token, its alternatives, UTF-8 bytes) for the engine and the router.

The engine builds them from its own per-token logprobs; the router rebuilds them from an engine's
completions logprobs (parallel lists, ``top_logprobs`` dicts listed best first). Both build each
entry here, so the two shapes cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from services.common.openai.protocol_chat import ChatLogprobEntry, ChatLogprobs, TopLogprob


def top_logprob(token: str, logprob: float) -> TopLogprob:
    """One token's text, logprob and UTF-8 bytes."""
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprob_entry(
    token: str, logprob: float, alternatives: Iterable[tuple[str, float]]
) -> ChatLogprobEntry:
    """The chat entry of one sampled token and its ``(text, logprob)`` alternatives, best first."""
    head = top_logprob(token, logprob)
    return ChatLogprobEntry(**head.model_dump(), top_logprobs=[top_logprob(t, v) for t, v in alternatives])


def chat_logprobs_from_completion(
    logprobs: Mapping[str, Any] | None, top_n: int | None
) -> ChatLogprobs | None:
    """Completions logprobs (the JSON of parallel lists) -> chat logprobs; None when not asked or absent.

    Each token keeps the first ``top_n`` entries of its ``top_logprobs`` dict; a token without a
    logprob (``null``) reads 0.0.
    """
    if top_n is None or not logprobs:
        return None
    tops: Sequence[Mapping[str, float] | None] = logprobs.get("top_logprobs") or []
    entries = []
    for i, (token, lp) in enumerate(
        zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []), strict=False)
    ):
        top = tops[i] if i < len(tops) else None
        alternatives = list((top or {}).items())[:top_n]
        entries.append(chat_logprob_entry(token, lp if lp is not None else 0.0, alternatives))
    return ChatLogprobs(content=entries)
