"""MessagesStream: a chat completion stream (chunk dicts) re-told as Anthropic Messages events."""

from __future__ import annotations

import json
from typing import Any

from services.router.anthropic import messages_bridge as mb


def sse(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class MessagesStream:
    """One content block open at a time (Anthropic's order): thinking, text, then each tool_use."""

    def __init__(self, model: str) -> None:
        self.message: dict[str, Any] = {
            "id": mb.new_id("msg"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        self.blocks = 0
        self.open: str | None = None  # "thinking", "text" or "tool:<index>"
        self.finish: tuple[str | None, Any] = (None, None)
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message}]

    def _switch(self, key: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self.open == key:
            return []
        out = self._close()
        self.open = key
        out.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        return out

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        self.blocks += 1
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks, "delta": delta}

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            self.error = str((chunk["error"] or {}).get("message", chunk["error"]))
            return []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                out += self._switch("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                out += self._tool(call)
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _tool(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function") or {}
        block = {
            "type": "tool_use",
            "id": call.get("id") or mb.new_id("toolu"),
            "name": fn.get("name", ""),
            "input": {},
        }
        out = self._switch(f"tool:{call.get('index', 0)}", block)
        if fn.get("arguments"):
            out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def end(self) -> list[dict[str, Any]]:
        """The closing events (an ``error`` event when the engine failed mid-stream)."""
        out = self._close()
        if self.error is not None:
            return [*out, {"type": "error", "error": {"type": "api_error", "message": self.error}}]
        reason, sequence = mb.stop_reason(*self.finish)
        usage = mb.usage(self.usage)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [*out, {"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]
