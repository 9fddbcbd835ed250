"""OpenAI ``POST /v1/chat/completions``: messages, the request, ``chat.completion`` and its chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from services.common.protocol_common import (
    MAX_LOGPROBS,
    FinishReason,
    PositiveInt,
    PromptLogprobsCarrier,
    RequestModel,
    ResponseModel,
    SamplingRequest,
    StreamChunkModel,
    Usage,
    field_error,
    now,
    random_id,
)

Role = Literal["system", "user", "assistant"]


class TextContentPart(RequestModel):
    """A ``{"type": "text", "text": ...}`` content part (the only kind a text model accepts)."""

    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    """One input message; ``content`` is a string or a list of text parts."""

    role: Role
    content: str | list[TextContentPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` (the current OpenAI name) wins over the legacy ``max_tokens``;
    ``top_logprobs`` requires ``logprobs: true`` as in OpenAI.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "requires logprobs to be true")
        return self

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts with string content, for a chat template."""
        return conversation(self.messages)


def conversation(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as ``{"role", "content"}`` dicts with string content, for a chat template."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class AssistantMessage(ResponseModel):
    """``choices[i].message`` of a chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None


class TopLogprob(ResponseModel):
    """One alternative token with its log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    """One generated token's log-probability plus the ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    """``choices[i].logprobs`` of a chat completion: ``{"content": [entry, ...]}``."""

    content: list[ChatLogprobEntry] | None = None


class ChatChoice(ResponseModel):
    """One choice of a (non-streamed) chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(PromptLogprobsCarrier):
    """A ``chat.completion`` object, with vLLM's top-level ``kv_transfer_params``."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(ResponseModel):
    """``choices[i].delta`` of a chunk: only the keys that are present are sent (``{}`` at the end)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(ResponseModel):
    """One choice of a chat completion chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(StreamChunkModel):
    """A ``chat.completion.chunk``; the same ``id`` and ``created`` on every chunk of a stream."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
