"""Token ids of a chat request or a /tokenize body, and the /tokenize and /detokenize answers (router and engine).

The router tokenizes every request itself and the engine serves the same endpoints; both go
through these functions, so a prompt is the same ids wherever it is tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.openai.errors import bad_request
from services.common.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.common.openai.protocol_chat import ChatMessage, conversation
from services.common.openai.tokenizer import ChatTemplateError, Tokenizer


def encode_messages(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    image_marker: str | None = None,
    video_marker: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The chat template applied to ``messages`` (and ``tools``, and ``template_kwargs``), encoded; 400
    (param ``messages``) when the template refuses, or when a model without the marker gets images (videos)."""
    try:
        chat = conversation(messages, image_marker, video_marker)
        if any(m.has_media() for m in messages) and tokenizer.renders_content_parts():
            ids = _parts_rendered(
                tokenizer, messages, add_generation_prompt, tools, image_marker, video_marker, template_kwargs
            )
            if ids is not None:
                return ids
        return tokenizer.encode_chat(chat, add_generation_prompt, tools, template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


def _parts_rendered(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    image_marker: str | None,
    video_marker: str | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int] | None:
    """The ids when the model's template places the media parts itself (as HF's processor renders them),
    provided it wrote exactly one of the model's markers per part; else None (the markers are joined in)."""
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    text = tokenizer.apply_chat_template(conversation(messages, parts=True), add_generation_prompt, **extra)
    for marker, kind in ((image_marker, "image"), (video_marker, "video")):
        wanted = sum(p["type"] == kind for m in messages for p in m.template_parts())
        if wanted and (marker is None or text.count(marker) != wanted):
            return None
    return tokenizer.encode(text, add_special_tokens=False)


def image_urls(body: ChatCompletionRequest) -> list[str]:
    """Every image part's URL, in message order."""
    return [url for m in body.messages for url in m.image_urls()]


def video_urls(body: ChatCompletionRequest) -> list[str]:
    """Every video part's URL, in message order."""
    return [url for m in body.messages for url in m.video_urls()]


def chat_prompt_ids(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    image_marker: str | None = None,
    video_marker: str | None = None,
) -> list[int]:
    """The prompt ids of a chat completions request (``tools``: what its template shows the model;
    ``image_marker`` / ``video_marker``: a vision-language model's placeholders, one per image / video part)."""
    return encode_messages(
        tokenizer,
        body.messages,
        body.add_generation_prompt,
        tools,
        image_marker,
        video_marker,
        body.chat_template_kwargs,
    )


def chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    """The completions ``logprobs`` a chat request asks for: None (none), else its ``top_logprobs`` (0..20)."""
    return (body.top_logprobs or 0) if body.logprobs else None


def tokenize_ids(tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
    """The ids of a /tokenize body: its messages through the chat template, or its prompt."""
    if body.messages is not None:
        return encode_messages(tokenizer, body.messages, body.add_generation_prompt)
    return tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)


def tokenize_response(tokenizer: Tokenizer, body: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
    """The answer to a /tokenize body (``token_strs`` when it asks for them)."""
    ids = tokenize_ids(tokenizer, body)
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize_response(tokenizer: Tokenizer, body: DetokenizeRequest, vocab_size: int) -> DetokenizeResponse:
    """The text of a /detokenize body's ids; 400 (param ``tokens``) for ids outside ``[0, vocab_size)``."""
    if any(t >= vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab_size})", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))
