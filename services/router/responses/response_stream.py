"""ResponsesStream: a chat completion stream (chunk dicts) re-told as Responses API events."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.router.responses import chat_bridge as cb


def sse(payload: dict[str, Any]) -> bytes:
    """One Responses event on the wire: ``event: <type>`` and its JSON ``data``."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def chunk_json(raw: bytes) -> Any:
    """The JSON of one chat SSE event as the router's chat adapter formats it (None for ``[DONE]``)."""
    data = "".join(line[6:] for line in raw.decode().split("\n") if line.startswith("data: "))
    return None if data == "[DONE]" else json.loads(data)


@dataclass
class _Open:
    """An output item being streamed."""

    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)


class ResponsesStream:
    """Feed it the chat chunks of one choice; it returns the events to send. ``finish`` closes the open
    items and gives the final response object (``response.completed`` is the caller's, after storing)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.sequence = 0
        self.items: list[_Open] = []
        self._message: _Open | None = None
        self._reasoning: _Open | None = None
        self._calls: dict[int, _Open] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def _open(self, item: dict[str, Any]) -> tuple[_Open, list[dict[str, Any]]]:
        opened = _Open(len(self.items), item)
        self.items.append(opened)
        return opened, [self.event("response.output_item.added", output_index=opened.index, item=item)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (an ``error`` chunk is kept for ``failed``)."""
        if "error" in chunk:
            self.error = chunk["error"]
            return []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning_delta(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._reasoning is None:
            self._reasoning, out = self._open(
                {"type": "reasoning", "id": cb.new_id("rs"), "summary": [], "content": []}
            )
        self._reasoning.text.append(text)
        ids = {
            "item_id": self._reasoning.item["id"],
            "output_index": self._reasoning.index,
            "content_index": 0,
        }
        return [*out, self.event("response.reasoning_text.delta", delta=text, **ids)]

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._message is None:
            self._message, out = self._open(cb.message_item(cb.new_id("msg"), None, "in_progress"))
            ids = {
                "item_id": self._message.item["id"],
                "output_index": self._message.index,
                "content_index": 0,
            }
            out.append(self.event("response.content_part.added", part=cb.output_text(""), **ids))
        self._message.text.append(text)
        ids = {"item_id": self._message.item["id"], "output_index": self._message.index, "content_index": 0}
        return [*out, self.event("response.output_text.delta", delta=text, logprobs=[], **ids)]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        opened = self._calls.get(call.get("index", 0))
        fn = call.get("function") or {}
        if opened is None:
            item = cb.function_call_item(
                cb.new_id("fc"), call.get("id") or cb.new_id("call"), fn.get("name", ""), "", "in_progress"
            )
            opened, out = self._open(item)
            self._calls[call.get("index", 0)] = opened
        if fn.get("arguments"):
            opened.text.append(fn["arguments"])
            ids = {"item_id": opened.item["id"], "output_index": opened.index}
            out.append(self.event("response.function_call_arguments.delta", delta=fn["arguments"], **ids))
        return out

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events of every open item, and the final response (completed, incomplete or failed)."""
        out: list[dict[str, Any]] = []
        output = []
        for opened in self.items:
            text, kind = "".join(opened.text), opened.item["type"]
            ids = {"item_id": opened.item["id"], "output_index": opened.index}
            if kind == "message":
                done = cb.message_item(opened.item["id"], text, "completed")
                out.append(
                    self.event("response.output_text.done", content_index=0, text=text, logprobs=[], **ids)
                )
                out.append(
                    self.event(
                        "response.content_part.done", content_index=0, part=cb.output_text(text), **ids
                    )
                )
            elif kind == "reasoning":
                done = cb.reasoning_item(opened.item["id"], text)
                out.append(self.event("response.reasoning_text.done", content_index=0, text=text, **ids))
            else:
                done = dict(opened.item, arguments=text, status="completed")
                out.append(
                    self.event(
                        "response.function_call_arguments.done", arguments=text, name=done["name"], **ids
                    )
                )
            out.append(self.event("response.output_item.done", output_index=opened.index, item=done))
            output.append(done)
        if self.error is not None:
            failed = dict(
                self.response,
                status="failed",
                output=output,
                error={"code": "server_error", "message": str(self.error.get("message", self.error))},
            )
            return out, failed
        return out, cb.finish(self.response, output, self.finish_reason, self.usage)
