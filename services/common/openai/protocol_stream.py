"""Builds the chunks of one streamed response with a shared id, ``created`` and usage convention."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.openai.protocol_chat import (
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
)
from services.common.openai.protocol_common import FinishReason, Usage, now, random_id
from services.common.openai.protocol_completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionStreamResponse,
)

StreamKind = Literal["completion", "chat"]
Chunk = CompletionStreamResponse | ChatCompletionStreamResponse


@dataclass(frozen=True)
class StreamContext:
    """Per-stream constants. A chat stream is: one role chunk per choice, content chunks, a chunk
    with an empty delta and ``finish_reason`` per choice, then (with ``include_usage``) one usage
    chunk with empty choices. Every chunk carries ``"usage": null`` when ``include_usage`` is on.
    """

    kind: StreamKind
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=now)

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", random_id("cmpl" if self.kind == "completion" else "chatcmpl"))

    def _header(self) -> dict[str, Any]:
        head: dict[str, Any] = {"id": self.id, "created": self.created, "model": self.model}
        if self.include_usage:
            head["usage"] = None
        return head

    def completion_chunk(
        self,
        index: int,
        text: str,
        finish_reason: FinishReason | None = None,
        logprobs: CompletionLogprobs | None = None,
        stop_reason: int | str | None = None,
    ) -> CompletionStreamResponse:
        """A ``text_completion`` chunk carrying new text of choice ``index``."""
        choice = CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
        )
        return CompletionStreamResponse(choices=[choice], **self._header())

    def moved_chunk(self, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """A drained engine's last chunk: no choices, where the stream's KV waits for the next engine (a
        kvferry extension only routers that set ``migrate_on_drain`` see)."""
        chunk = CompletionStreamResponse(choices=[], **self._header()).model_dump(mode="json")
        return {**chunk, "kv_transfer_params": kv_transfer_params}

    def chat_role_chunk(self, index: int) -> ChatCompletionStreamResponse:
        """The first chunk of chat choice ``index``: ``delta = {"role": "assistant", "content": ""}``."""
        delta = DeltaMessage(role="assistant", content="")
        return ChatCompletionStreamResponse(
            choices=[ChatStreamChoice(index=index, delta=delta)], **self._header()
        )

    def chat_chunk(
        self,
        index: int,
        text: str | None = None,
        finish_reason: FinishReason | None = None,
        logprobs: ChatLogprobs | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionStreamResponse:
        """A chat chunk with new ``text`` (or ``text=None`` and a ``finish_reason``: the last one)."""
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=text),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return ChatCompletionStreamResponse(choices=[choice], **self._header())

    def chat_delta_chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: FinishReason | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionStreamResponse:
        """A chat chunk carrying any delta fields (content, reasoning_content, tool_calls)."""
        choice = ChatStreamChoice(
            index=index, delta=DeltaMessage(**delta), finish_reason=finish_reason, stop_reason=stop_reason
        )
        return ChatCompletionStreamResponse(choices=[choice], **self._header())

    def usage_chunk(self, usage: Usage) -> Chunk:
        """The final chunk sent when ``stream_options.include_usage`` is on: no choices, the usage."""
        head = self._header() | {"usage": usage}
        if self.kind == "completion":
            return CompletionStreamResponse(choices=[], **head)
        return ChatCompletionStreamResponse(choices=[], **head)
