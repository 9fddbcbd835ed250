"""Response and chunk shapes: validated against the official ``openai`` types, key by key."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.common.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelList,
    StreamContext,
    TopLogprob,
    Usage,
)


def test_usage_of_fills_total_and_cached() -> None:
    assert Usage.of(7, 3, cached_tokens=4).model_dump() == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_completion_response_shape() -> None:
    logprobs = CompletionLogprobs(
        text_offset=[0, 1],
        token_logprobs=[-0.5, -1.0],
        tokens=["a", "b"],
        top_logprobs=[{"a": -0.5}, {"b": -1.0}],
    )
    choice = CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length")
    response = CompletionResponse(
        model="m", choices=[choice], usage=Usage.of(2, 2, 1), kv_transfer_params={"do_remote_decode": True}
    )
    data = json.loads(response.model_dump_json())
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["kv_transfer_params"] == {"do_remote_decode": True}
    parsed = Completion.model_validate(data)
    assert parsed.choices[0].logprobs.top_logprobs == [{"a": -0.5}, {"b": -1.0}]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1


def test_chat_response_shape() -> None:
    entry = ChatLogprobEntry(
        token="hi",
        logprob=-0.1,
        bytes=[104, 105],
        top_logprobs=[TopLogprob(token="hi", logprob=-0.1, bytes=[104, 105])],
    )
    choice = ChatChoice(
        index=0,
        message=AssistantMessage(content="hi"),
        logprobs=ChatLogprobs(content=[entry]),
        finish_reason="stop",
    )
    data = json.loads(
        ChatCompletionResponse(model="m", choices=[choice], usage=Usage.of(3, 1)).model_dump_json()
    )
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert "kv_transfer_params" in data and data["kv_transfer_params"] is None
    parsed = ChatCompletion.model_validate(data)
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [104, 105]
    assert parsed.usage.total_tokens == 4


def test_chat_stream_sequence() -> None:
    ctx = StreamContext("chat", "m", include_usage=True)
    chunks = [
        ctx.chat_role_chunk(0),
        ctx.chat_chunk(0, "Hel"),
        ctx.chat_chunk(0, "lo"),
        ctx.chat_chunk(0, None, "stop"),
        ctx.usage_chunk(Usage.of(5, 2)),
    ]
    data = [json.loads(c.model_dump_json()) for c in chunks]
    assert {d["id"] for d in data} == {ctx.id} and {d["created"] for d in data} == {ctx.created}
    assert {d["object"] for d in data} == {"chat.completion.chunk"}
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert data[3]["choices"][0]["delta"] == {} and data[3]["choices"][0]["finish_reason"] == "stop"
    assert all(d["usage"] is None for d in data[:-1])
    assert data[-1]["choices"] == [] and data[-1]["usage"]["total_tokens"] == 7
    for d in data:
        ChatCompletionChunk.model_validate(d)


def test_stream_without_include_usage_has_no_usage_key() -> None:
    chat = StreamContext("chat", "m")
    completion = StreamContext("completion", "m")
    assert "usage" not in json.loads(chat.chat_chunk(0, "x").model_dump_json())
    data = json.loads(completion.completion_chunk(0, "x", "length").model_dump_json())
    assert "usage" not in data
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"][0] == {
        "index": 0,
        "text": "x",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    Completion.model_validate(data)


def test_completion_usage_chunk() -> None:
    ctx = StreamContext("completion", "m", include_usage=True, id="cmpl-fixed")
    data = json.loads(ctx.usage_chunk(Usage.of(1, 1)).model_dump_json())
    assert data["id"] == "cmpl-fixed" and data["choices"] == [] and data["usage"]["total_tokens"] == 2


def test_models_list_shape() -> None:
    data = ModelList(data=[ModelCard(id="m", max_model_len=2048)]).model_dump()
    assert data["object"] == "list"
    assert data["data"][0]["id"] == "m" and data["data"][0]["object"] == "model"
    assert data["data"][0]["owned_by"] == "kvferry"
