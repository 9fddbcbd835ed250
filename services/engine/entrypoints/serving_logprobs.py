"""Engine logprobs in OpenAI's two shapes: completions' parallel lists and chat's per-token entries."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.openai.logprob_shapes import chat_logprob_entry
from services.common.openai.protocol_chat import ChatLogprobs
from services.common.openai.protocol_common import PromptLogprob, PromptLogprobs
from services.common.openai.protocol_completions import CompletionLogprobs
from services.common.openai.tokenizer import Tokenizer
from services.engine.core.outputs import Logprobs


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token as OpenAI shows it in logprobs (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[Logprobs | None],
    text_offset: int,
    top_n: int | None = None,
) -> CompletionLogprobs:
    """Completions logprobs of ``token_ids``; a ``None`` entry (the first prompt token) has no logprob.

    ``top_logprobs`` holds the top-n alternatives (at most ``top_n``) plus the token itself, as vLLM returns them.
    """
    out = CompletionLogprobs()
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.token_logprob)
        top: dict[str, float] = {}
        for t, v in (*lp.top[:top_n], (token_id, lp.token_logprob)):
            top.setdefault(token_text(tokenizer, t), v)  # distinct ids may share a text: keep the best
        out.top_logprobs.append(top)
    return out


def prompt_logprobs_json(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], logprobs: Sequence[Logprobs | None], top_n: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token {token id: logprob, rank, text} for it and its top-n."""
    out: PromptLogprobs = []
    for token_id, lp in zip(prompt_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            token_id: PromptLogprob(
                logprob=lp.token_logprob, rank=lp.rank, decoded_token=token_text(tokenizer, token_id)
            )
        }
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(t, PromptLogprob(logprob=v, rank=rank, decoded_token=token_text(tokenizer, t)))
        out.append(entry)
    return out


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[Logprobs], top_n: int
) -> ChatLogprobs:
    """Chat logprobs: one entry per token with its ``top_n`` alternatives."""
    return ChatLogprobs(
        content=[
            chat_logprob_entry(
                token_text(tokenizer, token_id),
                lp.token_logprob,
                [(token_text(tokenizer, t), v) for t, v in lp.top[:top_n]],
            )
            for token_id, lp in zip(token_ids, logprobs, strict=True)
        ]
    )
