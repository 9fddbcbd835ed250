"""OpenAI ``POST /v1/chat/completions``: messages, the request, ``chat.completion`` and its chunks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from services.common.openai.protocol_common import (
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
from services.common.openai.protocol_tools import (
    MessageToolCall,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    ToolDefinition,
)

Role = Literal["system", "developer", "user", "assistant", "tool"]


class TextContentPart(RequestModel):
    """A ``{"type": "text", "text": ...}`` content part (the only kind a text model accepts)."""

    type: Literal["text"]
    text: str


class ImageUrl(RequestModel):
    """Where an image is: a ``data:image/...;base64,`` URL (or ``file://`` where the server allows it)."""

    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlContentPart(RequestModel):
    """A ``{"type": "image_url", "image_url": {"url": ...}}`` content part (vision-language models)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(RequestModel):
    """Where a video is: a ``data:video/...;base64,`` URL (or ``file://`` where the server allows it)."""

    url: Annotated[str, Field(min_length=1)]


class VideoUrlContentPart(RequestModel):
    """A ``{"type": "video_url", "video_url": {"url": ...}}`` content part (models that take videos)."""

    type: Literal["video_url"]
    video_url: VideoUrl


ContentPart = Annotated[
    TextContentPart | ImageUrlContentPart | VideoUrlContentPart, Field(discriminator="type")
]


class ChatMessage(RequestModel):
    """One input message; ``content`` is a string or a list of parts (None only beside tool calls)."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise field_error("tool_call_id", "is required in a message with role 'tool'")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise field_error(
                "content", "is required (it may be null only in an assistant message with tool_calls)"
            )
        if self.tool_calls and self.role != "assistant":
            raise field_error("tool_calls", "only assistant messages carry tool_calls")
        return self

    def text(self, image_marker: str | None = None, video_marker: str | None = None) -> str:
        """The content as one string (parts joined by newlines, as vLLM does); an image (video) part is the
        model's placeholder ``image_marker`` (``video_marker``); ValueError without one."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str | None] = []
        for part in self.content:
            if isinstance(part, TextContentPart):
                parts.append(part.text)
            elif isinstance(part, ImageUrlContentPart) and image_marker is None:
                raise ValueError(
                    "image_url content parts need a vision-language model; this one takes text only"
                )
            elif isinstance(part, VideoUrlContentPart) and video_marker is None:
                raise ValueError("video_url content parts need a model that takes videos; this one does not")
            else:
                parts.append(image_marker if isinstance(part, ImageUrlContentPart) else video_marker)
        return "\n".join(p for p in parts if p is not None)

    def has_media(self) -> bool:
        """Whether it has an image or video part."""
        media = (ImageUrlContentPart, VideoUrlContentPart)
        return isinstance(self.content, list) and any(isinstance(p, media) for p in self.content)

    def template_parts(self) -> list[dict[str, str]]:
        """The content as a chat template's parts, in order: text, ``{"type": "image"}``, ``{"type": "video"}``."""
        kinds = {ImageUrlContentPart: "image", VideoUrlContentPart: "video"}
        out: list[dict[str, str]] = []
        for part in self.content if isinstance(self.content, list) else []:
            if isinstance(part, TextContentPart):
                out.append({"type": "text", "text": part.text})
            elif type(part) in kinds:
                out.append({"type": kinds[type(part)]})
        return out

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageUrlContentPart)]

    def video_urls(self) -> list[str]:
        """The URLs of its video parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.video_url.url for p in self.content if isinstance(p, VideoUrlContentPart)]


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
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # extra variables of the chat template (e.g. Qwen3's {"enable_thinking": false}), as vLLM takes them
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> ChatCompletionRequest:
        reserved = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}
        for key in self.chat_template_kwargs or {}:
            if not key.isidentifier() or key in reserved:
                raise field_error(
                    "chat_template_kwargs", f"{key!r} is not a template variable a request may set"
                )
        return self

    @model_validator(mode="after")
    def _check_detail(self) -> ChatCompletionRequest:
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                detail = part.image_url.detail if isinstance(part, ImageUrlContentPart) else None
                if detail in ("low", "high"):
                    raise field_error(
                        f"messages[{i}].content[{j}].image_url.detail",
                        f"{detail!r} is not served: the model's processor sees every image at its own fixed "
                        "resolution; leave detail out or send 'auto'",
                    )
        return self

    @model_validator(mode="after")
    def _check_parallel(self) -> ChatCompletionRequest:
        if not self.parallel_tool_calls and self.tools and self.effective_tool_choice() == "auto":
            raise field_error(
                "parallel_tool_calls",
                "false is honoured with tool_choice 'required' or a named tool only; with 'auto' the model "
                "may call several tools in one answer",
            )
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise field_error("tool_choice", "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error(
                "tool_choice", f"names {choice.function.name!r}, which is not one of the tools {names}"
            )
        if len(set(names)) != len(names):
            raise field_error("tools", "tool names must be unique")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: 'auto' when tools are given, else 'none'."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as dicts with string content (and tool calls / ids), for a chat template."""
        return conversation(self.messages)


def conversation(
    messages: Sequence[ChatMessage],
    image_marker: str | None = None,
    video_marker: str | None = None,
    parts: bool = False,
) -> list[dict[str, Any]]:
    """Messages as chat-template dicts: ``{"role", "content"}`` plus ``tool_calls`` (arguments parsed to
    objects, as HF templates expect) and ``tool_call_id``; ``developer`` is rendered as ``system``;
    image (video) parts as ``image_marker`` (``video_marker``), the model's placeholder tokens; with
    ``parts``, a message with media keeps its parts in order (``{"type": "text" | "image" | "video"}``)
    for a template that places them itself, as HF processors do."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content: Any = m.template_parts() if parts and m.has_media() else m.text(image_marker, video_marker)
        item: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON (templates render them with tojson)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class AssistantMessage(ResponseModel):
    """``choices[i].message`` of a chat completion (``tool_calls``, ``reasoning_content`` only when present)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


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
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's incremental shape: index, id, function

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
