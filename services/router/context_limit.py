"""The pool's context length (the smallest max_model_len its engines report) and the 400 for prompts over it."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.openai.errors import bad_request
from services.router.prompt import PreparedRequest
from services.router.scheduling import Endpoint


def pool_max_model_len(endpoints: Sequence[Endpoint]) -> int | None:
    """The smallest max_model_len of the engines taking requests; while none is, the smallest ever
    reported by a known engine; None before any engine answered."""
    serving = [e.max_model_len for e in endpoints if e.healthy and not e.draining and e.max_model_len]
    known = serving or [e.max_model_len for e in endpoints if e.max_model_len]
    return min(known) if known else None


def disagreement(endpoints: Sequence[Endpoint]) -> str | None:
    """A description of the healthy engines' differing max_model_len values, or None if they agree."""
    lengths = {e.url: e.max_model_len for e in endpoints if e.healthy and e.max_model_len}
    if len(set(lengths.values())) < 2:
        return None
    listed = ", ".join(f"{url}={n}" for url, n in sorted(lengths.items()))
    return f"engines disagree on max_model_len ({listed}); the router reports and enforces the smallest"


def check_prompt_fits(req: PreparedRequest, max_model_len: int | None) -> None:
    """400 naming ``prompt`` (or ``messages``) for a prompt that leaves no room for output, in the
    engine's words (services/engine/serving.py ``output_budget``); nothing while the length is unknown."""
    if max_model_len is None:
        return
    for ids in req.prompts:
        if len(ids) >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                f"has {len(ids)} tokens (at least one must be left for the output).",
                "messages" if req.kind == "chat" else "prompt",
            )
