"""Responses <-> chat: a Responses request and its conversation as a chat request, a chat completion as
Responses output items, and the response object itself."""

from __future__ import annotations

import secrets
import time
from typing import Any

from services.common.openai.errors import OpenAIError, bad_request
from services.router.responses.response_protocol import InputItem, MessageItem, ResponsesRequest

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def item_dicts(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as stored (every one with an ``id``)."""
    out = []
    for item in items:
        d = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        d["type"] = item.type
        d.setdefault("id", new_id(_ID_PREFIX[item.type]))
        if isinstance(item, MessageItem):  # text parts, as OpenAI lists input items
            part = "output_text" if item.role == "assistant" else "input_text"
            d["content"] = [{"type": part, "text": item.text()}]
        out.append(d)
    return out


def _message(role: str, content: str | None, **extra: Any) -> dict[str, Any]:
    return {"role": "system" if role == "developer" else role, "content": content, **extra}


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a conversation (stored item dicts); a ``function_call_output`` whose call id
    names no earlier ``function_call`` is a 400."""
    messages = [_message("system", instructions)] if instructions else []
    calls: set[str] = set()
    for index, d in enumerate(items):
        kind = d["type"]
        if kind == "message":
            messages.append(_message(d["role"], MessageItem.model_validate(d).text()))
        elif kind == "function_call":
            call = {
                "id": d["call_id"],
                "type": "function",
                "function": {"name": d["name"], "arguments": d["arguments"]},
            }
            calls.add(d["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append(_message("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            if d["call_id"] not in calls:
                raise bad_request(
                    f"function_call_output call_id {d['call_id']!r} names no function_call of this conversation",
                    f"input[{index}].call_id",
                )
            messages.append(_message("tool", d["output"], tool_call_id=d["call_id"]))
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("the conversation has no message to answer", "input")
    return messages


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a name and a schema", "text.format")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]], model: str | None) -> dict[str, Any]:
    """The chat completions request the router serves for ``body``."""
    out: dict[str, Any] = {"model": model, "messages": messages, "stream": body.stream}
    if body.stream:
        out["stream_options"] = {"include_usage": True}
    if body.tools:
        out["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
        out["parallel_tool_calls"] = body.parallel_tool_calls
    optional = {
        "tool_choice": _tool_choice(body),
        "response_format": _response_format(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's message as Responses output items: reasoning, the text message, function calls."""
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        out.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
    return out


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }


def response_object(
    body: ResponsesRequest, response_id: str, model: str, created_at: int | None = None
) -> dict[str, Any]:
    """The response object of ``body`` before any output (``status`` in_progress)."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at or int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice.model_dump()
        if not isinstance(body.tool_choice, str | None)
        else (body.tool_choice or "auto"),
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": {"format": fmt},
        "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "user": body.user,
        "metadata": body.metadata or {},
        "usage": None,
        "error": None,
        "incomplete_details": None,
    }


def finish(
    response: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: str | None,
    chat_usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """``response`` completed (or incomplete at the token limit) with ``output``."""
    done = dict(response, output=output, usage=usage(chat_usage))
    if finish_reason == "length":
        done.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        done["status"] = "completed"
    return done


def not_found(response_id: str, expired: bool) -> OpenAIError:
    why = "expired (past the store's TTL)" if expired else "not found"
    return OpenAIError(
        404,
        f"Response with id {response_id!r} {why}.",
        "invalid_request_error",
        "response_id",
        "response_not_found",
    )
