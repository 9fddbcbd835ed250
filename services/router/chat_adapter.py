"""ChatAdapter: an engine's ``/v1/completions`` answers (token-id prompts) reshaped as chat completions.

Streams follow the engine's own chat shape: a role chunk per choice, content chunks, an empty-delta
chunk with ``finish_reason`` per choice, the usage chunk, then ``[DONE]``. Chat logprobs are rebuilt
from completions logprobs: each token's text and logprob, the first ``top_logprobs`` alternatives of
its top dict (the engine lists them best first), UTF-8 bytes of the token text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from services.common.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    StreamContext,
    TopLogprob,
    Usage,
)
from services.common.sse import SSEEvent, sse_event


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(logprobs: dict[str, Any] | None, top_n: int | None) -> ChatLogprobs | None:
    """Completions logprobs (parallel lists) -> chat logprobs (one entry per token)."""
    if top_n is None or not logprobs:
        return None
    entries = []
    tops = logprobs.get("top_logprobs") or []
    for i, (token, lp) in enumerate(zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []), strict=False)):
        alternatives = list((tops[i] if i < len(tops) and tops[i] else {}).items())[:top_n]
        head = _top(token, lp if lp is not None else 0.0)
        entries.append(ChatLogprobEntry(**head.model_dump(), top_logprobs=[_top(t, v) for t, v in alternatives]))
    return ChatLogprobs(content=entries)


class ChatAdapter:
    """Reshapes one request's completion answer (or stream) into chat form under ``model``."""

    def __init__(self, model: str, request_id: str, top_n: int | None = None, n: int = 1,
                 include_usage: bool = False) -> None:
        self.model = model
        self.top_n = top_n
        self.n = n
        self.stream_ctx = StreamContext("chat", model, include_usage, id=f"chatcmpl-{request_id}")

    def response(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed ``chat.completion`` from a ``text_completion``."""
        choices = [ChatChoice(index=c["index"], message=AssistantMessage(content=c["text"]),
                              logprobs=chat_logprobs(c.get("logprobs"), self.top_n),
                              finish_reason=c.get("finish_reason"), stop_reason=c.get("stop_reason"))
                   for c in completion.get("choices", [])]
        usage = Usage.model_validate(completion["usage"]) if completion.get("usage") else None
        first = (completion.get("choices") or [{}])[0]
        out = ChatCompletionResponse(id=self.stream_ctx.id, created=self.stream_ctx.created, model=self.model,
                                     choices=choices, usage=usage, prompt_logprobs=first.get("prompt_logprobs"))
        return out.model_dump(mode="json")

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
            logprobs = chat_logprobs(c.get("logprobs"), self.top_n)
            if c.get("text") or logprobs:
                out.append(sse_event(ctx.chat_chunk(c["index"], c.get("text") or "", logprobs=logprobs)))
            if c.get("finish_reason"):
                out.append(sse_event(ctx.chat_chunk(c["index"], None, c["finish_reason"],
                                                    stop_reason=c.get("stop_reason"))))
        return out

    async def stream(self, events: AsyncIterator[SSEEvent]) -> AsyncIterator[bytes]:
        """Role chunks, then every engine event reshaped."""
        for chunk in self.role_chunks():
            yield chunk
        async for event in events:
            for chunk in self.chunk(event):
                yield chunk
