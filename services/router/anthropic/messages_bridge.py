"""Anthropic Messages <-> chat: a Messages request as a chat request, a chat completion as a Message."""

from __future__ import annotations

import json
import secrets
from typing import Any

from services.common.openai.errors import bad_request
from services.router.anthropic.messages_protocol import (
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _user_messages(blocks: list[Any], index: int, known: set[str]) -> list[dict[str, Any]]:
    """A user turn: tool results become tool messages (first, as they answer the previous turn), the
    rest one user message of text and image parts."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in known:
                raise bad_request(
                    f"tool_result tool_use_id {block.tool_use_id!r} names no tool_use of the conversation",
                    f"messages[{index}].content[{j}].tool_use_id",
                )
            text = ("Error: " if block.is_error else "") + block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            try:
                url = block.source.data_url()
            except ValueError as exc:
                raise bad_request(str(exc), f"messages[{index}].content[{j}].source") from None
            parts.append({"type": "image_url", "image_url": {"url": url}})
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    system = body.system_text()
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    known: set[str] = set()
    for i, message in enumerate(body.messages):
        blocks = message.blocks()
        if message.role == "user":
            out += _user_messages(blocks, i, known)
            continue
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        calls: list[dict[str, Any]] = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        known.update(c["id"] for c in calls)
        out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    return out


def _tool_choice(body: MessagesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_body(body: MessagesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "max_completion_tokens": body.max_tokens,
        "stream": body.stream,
    }
    if body.stream:
        out["stream_options"] = {"include_usage": True}
    if body.tools:
        out["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
        if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    optional = {
        "tool_choice": _tool_choice(body),
        "stop": body.stop_sequences,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def stop_reason(finish: str | None, matched: Any) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for a chat finish_reason / stop_reason."""
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "", finish), None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    return {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as Anthropic's ``input`` object (arguments that are no JSON object are
    kept whole under ``"arguments"``, never dropped)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message_object(model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A Message from a non-streamed chat completion."""
    choice = chat["choices"][0]
    m = choice["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for call in m.get("tool_calls") or []:
        args = tool_input(call["function"]["arguments"])
        content.append(
            {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args}
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat.get("usage")),
    }
