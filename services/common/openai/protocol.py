"""The OpenAI-compatible protocol in one import: completions, chat, models, tokenize, errors.

Request bodies ignore unknown fields (OpenAI and vLLM do the same) and use strict types; see
``protocol_common`` for the shared fields and ``errors`` for the 400 body built from a
``ValidationError``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.common.openai.errors import (
    ErrorInfo,
    ErrorResponse,
    OpenAIError,
    bad_request,
    error_response,
    model_not_found,
    not_ready,
    param_path,
    parse_body,
    server_error,
    unauthorized,
    validation_error_response,
)
from services.common.openai.protocol_chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TextContentPart,
    TopLogprob,
)
from services.common.openai.protocol_common import (
    MAX_LOGPROBS,
    FinishReason,
    PromptTokensDetails,
    RequestModel,
    ResponseModel,
    SamplingRequest,
    StreamOptions,
    TokenId,
    Usage,
    field_error,
    now,
    random_id,
)
from services.common.openai.protocol_completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from services.common.openai.protocol_stream import StreamContext


class ModelCard(ResponseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvferry"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    quantization: str | None = None  # kvferry: how the weights are held (e.g. gguf(Q4_1x210,Q8_0x1), int8)


class ModelList(ResponseModel):
    """Body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(RequestModel):
    """Body of ``POST /tokenize`` (vLLM): exactly one of ``prompt`` or ``messages``.

    With ``messages`` the chat template is applied first (``add_generation_prompt`` as in chat).
    """

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise field_error("prompt", "exactly one of prompt or messages is required")
        return self


class TokenizeResponse(ResponseModel):
    """Body answered by ``POST /tokenize``."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """Body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    """Body answered by ``POST /detokenize``."""

    prompt: str


__all__ = [
    "MAX_LOGPROBS",
    "AssistantMessage",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatLogprobEntry",
    "ChatLogprobs",
    "ChatMessage",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FinishReason",
    "ModelCard",
    "OpenAIError",
    "ModelList",
    "PromptTokensDetails",
    "RequestModel",
    "ResponseModel",
    "SamplingRequest",
    "StreamContext",
    "StreamOptions",
    "TextContentPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "TopLogprob",
    "Usage",
    "bad_request",
    "error_response",
    "field_error",
    "model_not_found",
    "not_ready",
    "param_path",
    "parse_body",
    "random_id",
    "server_error",
    "unauthorized",
    "validation_error_response",
]
