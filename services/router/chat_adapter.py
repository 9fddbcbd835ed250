"""ChatAdapter: an engine's ``/v1/completions`` answers (token-id prompts) reshaped as chat completions.

Streams follow the engine's own chat shape: a role chunk per choice, content chunks, an empty-delta
chunk with ``finish_reason`` per choice, the usage chunk, then ``[DONE]``. Chat logprobs are rebuilt
from completions logprobs: each token's text and logprob, the first ``top_logprobs`` alternatives of
its top dict (the engine lists them best first), UTF-8 bytes of the token text.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from services.common.openai.chat_tools import ChatDeltas, ChatPlan, FinalMessage, finish_reason
from services.common.openai.logprob_shapes import chat_logprobs_from_completion
from services.common.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    StreamContext,
    Usage,
)
from services.common.openai.protocol_tools import ToolCall
from services.common.openai.sse import SSEEvent, sse_event


class ChatAdapter:
    """Reshapes one request's completion answer (or stream) into chat form under ``model``."""

    def __init__(
        self,
        model: str,
        request_id: str,
        top_n: int | None = None,
        n: int = 1,
        include_usage: bool = False,
        plan: ChatPlan | None = None,
    ) -> None:
        self.model = model
        self.top_n = top_n
        self.n = n
        self.stream_ctx = StreamContext("chat", model, include_usage, id=f"chatcmpl-{request_id}")
        self.plan = plan
        self._deltas: dict[int, ChatDeltas] = {}

    def response(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed ``chat.completion`` from a ``text_completion``."""
        choices = [self._choice(c) for c in completion.get("choices", [])]
        usage = Usage.model_validate(completion["usage"]) if completion.get("usage") else None
        first = (completion.get("choices") or [{}])[0]
        out = ChatCompletionResponse(
            id=self.stream_ctx.id,
            created=self.stream_ctx.created,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_logprobs=first.get("prompt_logprobs"),
        )
        return out.model_dump(mode="json")

    def _choice(self, c: dict[str, Any]) -> ChatChoice:
        message = self.plan.finish(c["text"]) if self.plan else FinalMessage(c["text"])
        calls = [ToolCall.model_validate(t) for t in message.tool_calls] if message.tool_calls else None
        return ChatChoice(
            index=c["index"],
            message=AssistantMessage(
                content=message.content, reasoning_content=message.reasoning_content, tool_calls=calls
            ),
            logprobs=chat_logprobs_from_completion(c.get("logprobs"), self.top_n),
            finish_reason=finish_reason(c.get("finish_reason"), message),
            stop_reason=c.get("stop_reason"),
        )

    def role_chunks(self) -> list[bytes]:
        """The opening chunk of every choice."""
        return [sse_event(self.stream_ctx.chat_role_chunk(i)) for i in range(self.n)]

    def chunk(self, event: SSEEvent) -> list[bytes]:
        """The chat events for one engine event (errors and ``[DONE]`` pass as they are)."""
        if event.is_done:
            return [sse_event(event.data)]
        data = event.json()
        if not isinstance(data, dict) or "choices" not in data:
            return [sse_event(event.data)]
        ctx = self.stream_ctx
        if not data["choices"] and data.get("usage"):
            return [sse_event(ctx.usage_chunk(Usage.model_validate(data["usage"])))]
        out = []
        for c in data["choices"]:
            out += self._choice_chunks(c)
        return out

    def _choice_chunks(self, c: dict[str, Any]) -> list[bytes]:
        ctx, index = self.stream_ctx, c["index"]
        logprobs = chat_logprobs_from_completion(c.get("logprobs"), self.top_n)
        if self.plan is None or (self.plan.mode == "none" and self.plan.reasoning is None):
            out = (
                [sse_event(ctx.chat_chunk(index, c.get("text") or "", logprobs=logprobs))]
                if (c.get("text") or logprobs)
                else []
            )
            if c.get("finish_reason"):
                out.append(
                    sse_event(
                        ctx.chat_chunk(index, None, c["finish_reason"], stop_reason=c.get("stop_reason"))
                    )
                )
            return out
        deltas = self._deltas.setdefault(index, ChatDeltas(self.plan))
        parts = deltas.feed(c["text"]) if c.get("text") else []
        out = [sse_event(ctx.chat_chunk(index, "", logprobs=logprobs))] if logprobs is not None else []
        out += [sse_event(ctx.chat_delta_chunk(index, p)) for p in parts]
        if c.get("finish_reason"):
            out += [sse_event(ctx.chat_delta_chunk(index, p)) for p in deltas.finish()]
            reason: Any = (
                "tool_calls" if c["finish_reason"] == "stop" and deltas.saw_tool_calls else c["finish_reason"]
            )
            out.append(sse_event(ctx.chat_delta_chunk(index, {}, reason, c.get("stop_reason"))))
        return out

    async def stream(self, events: AsyncIterator[SSEEvent]) -> AsyncGenerator[bytes, None]:
        """Role chunks, then every engine event reshaped."""
        for chunk in self.role_chunks():
            yield chunk
        async for event in events:
            for chunk in self.chunk(event):
                yield chunk
