"""Request validation: every bad input names the right field; good inputs round-trip."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from services.common.openai.errors import validation_error_response
from services.common.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

MSG = [{"role": "user", "content": "hi"}]

BAD: list[tuple[type[BaseModel], dict[str, Any], str]] = [
    (CompletionRequest, {}, "prompt"),
    (CompletionRequest, {"prompt": ""}, "prompt"),
    (CompletionRequest, {"prompt": []}, "prompt"),
    (CompletionRequest, {"prompt": [""]}, "prompt"),
    (CompletionRequest, {"prompt": [[]]}, "prompt"),
    (CompletionRequest, {"prompt": [1, -2]}, "prompt"),
    (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),
    (CompletionRequest, {"prompt": [True]}, "prompt"),
    (CompletionRequest, {"prompt": 5}, "prompt"),
    (CompletionRequest, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "temperature": -0.1}, "temperature"),
    (CompletionRequest, {"prompt": "x", "temperature": "1"}, "temperature"),
    (CompletionRequest, {"prompt": "x", "temperature": float("inf")}, "temperature"),
    (CompletionRequest, {"prompt": "x", "top_p": float("nan")}, "top_p"),
    (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p"),
    (CompletionRequest, {"prompt": "x", "top_p": 1.01}, "top_p"),
    (CompletionRequest, {"prompt": "x", "n": 0}, "n"),
    (CompletionRequest, {"prompt": "x", "top_k": -2}, "top_k"),
    (CompletionRequest, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (CompletionRequest, {"prompt": "x", "min_p": -0.1}, "min_p"),
    (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (CompletionRequest, {"prompt": "x", "logprobs": -1}, "logprobs"),
    (CompletionRequest, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    (CompletionRequest, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (CompletionRequest, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (CompletionRequest, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.[0]"),
    (CompletionRequest, {"prompt": "x", "stream": "yes"}, "stream"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (
        CompletionRequest,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    ),
    (CompletionRequest, {"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params"),
    (CompletionRequest, {"prompt": "x", "seed": 1.5}, "seed"),
    (CompletionRequest, {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    (ChatCompletionRequest, {}, "messages"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]}, "messages.[0].tool_call_id"),
    (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages.[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 3}]}, "messages.[0].content"),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages.[0].content",
    ),
    (ChatCompletionRequest, {"messages": [*MSG, {"content": "x"}]}, "messages.[1].role"),
    (ChatCompletionRequest, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    (ChatCompletionRequest, {"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": MSG, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
    (ChatCompletionRequest, {"messages": MSG, "logprobs": 1}, "logprobs"),
    (ChatCompletionRequest, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": MSG, "temperature": -1}, "temperature"),
    (ChatCompletionRequest, {"messages": MSG, "top_p": 0.0}, "top_p"),
    (ChatCompletionRequest, {"messages": MSG, "n": -1}, "n"),
    (ChatCompletionRequest, {"messages": MSG, "add_generation_prompt": "no"}, "add_generation_prompt"),
    (TokenizeRequest, {}, "prompt"),
    (TokenizeRequest, {"prompt": "a", "messages": MSG}, "prompt"),
    (TokenizeRequest, {"messages": []}, "messages"),
    (DetokenizeRequest, {"tokens": [1, -1]}, "tokens.[1]"),
    (DetokenizeRequest, {}, "tokens"),
]


@pytest.mark.parametrize(
    ("model", "body", "param"), BAD, ids=[f"{m.__name__}-{p}-{i}" for i, (m, _, p) in enumerate(BAD)]
)
def test_bad_input_names_the_field(model: type[BaseModel], body: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    status, error = validation_error_response(info.value)
    assert status == 400
    assert error["error"]["param"] == param
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"{param}: ")


GOOD_COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "hello"},
    {"prompt": ["a", "b"], "n": 2, "max_tokens": 1},
    {"prompt": [1, 2, 3], "logprobs": 0, "echo": True},
    {"prompt": [[1], [2, 3]], "logprobs": 20},
    {
        "model": "m",
        "prompt": "x",
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 1,
        "seed": -3,
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": True},
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "user": "u",
        "top_k": -1,
        "min_p": 0,
        "repetition_penalty": 1.1,
        "min_tokens": 7,
        "ignore_eos": True,
        "stop_token_ids": [0, 2],
        "cache_salt": "salt",
        "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": [1, 2]},
        "priority": -1,
        "request_id": "r1",
    },
    {"prompt": "x", "top_k": 0},
    {"prompt": "x", "top_k": 40, "temperature": 5.0},
]


@pytest.mark.parametrize("body", GOOD_COMPLETIONS)
def test_good_completion_requests_round_trip(body: dict[str, Any]) -> None:
    request = CompletionRequest.model_validate(body)
    assert request.model_dump(exclude_unset=True) == body
    assert CompletionRequest.model_validate_json(request.model_dump_json()) == request


def test_completion_defaults_and_helpers() -> None:
    request = CompletionRequest.model_validate({"prompt": "hi", "stop": "x"})
    assert request.max_tokens == 16 and request.n == 1 and not request.stream
    assert request.model is None and request.max_output_tokens() == 16
    assert request.stop_strings() == ["x"]
    assert request.prompts() == ["hi"]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompts() == [[5, 6]]
    assert CompletionRequest.model_validate({"prompt": [[5], [6]]}).prompts() == [[5], [6]]
    assert not request.include_usage_in_stream()


def test_unknown_fields_are_ignored() -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "a_field_from_the_future": {"1": 2}})
    assert "a_field_from_the_future" not in request.model_dump()


def test_logit_bias_is_kept_with_integer_ids() -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": 2, "50256": -100}})
    assert request.token_bias() == {1: 2.0, 50256: -100.0}
    for bad in ({"one": 2}, {"-1": 2}, {"1": 101}, {"1": "2"}):
        with pytest.raises(ValidationError, match="logit_bias"):
            CompletionRequest.model_validate({"prompt": "x", "logit_bias": bad})


def test_chat_request_helpers() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": ""},
        ],
        "max_tokens": 9,
        "max_completion_tokens": 4,
        "logprobs": True,
        "top_logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = ChatCompletionRequest.model_validate(body)
    assert request.model_dump(exclude_unset=True) == body
    assert request.max_output_tokens() == 4
    assert request.add_generation_prompt is True
    assert request.include_usage_in_stream()
    assert request.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    legacy = ChatCompletionRequest.model_validate({"messages": MSG, "max_tokens": 9})
    assert legacy.max_output_tokens() == 9
    assert ChatCompletionRequest.model_validate({"messages": MSG}).max_output_tokens() is None


def test_json_body_parses_like_a_dict() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "max_tokens": 3}'
    request = ChatCompletionRequest.model_validate_json(raw)
    assert request.temperature == 1.0 and request.max_tokens == 3


def test_tokenize_bodies() -> None:
    assert TokenizeRequest.model_validate({"prompt": ""}).add_special_tokens is True
    assert TokenizeRequest.model_validate({"messages": MSG}).messages[0].text() == "hi"
    assert DetokenizeRequest.model_validate({"tokens": []}).tokens == []
