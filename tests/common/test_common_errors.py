"""OpenAI error bodies, parameter paths and request parsing."""

from __future__ import annotations

import pytest

from services.common.openai.errors import (
    OpenAIError,
    bad_request,
    model_not_found,
    not_ready,
    param_path,
    parse_body,
    server_error,
    unauthorized,
    validation_error_response,
)
from services.common.openai.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        ((), None),
        (("max_tokens",), "max_tokens"),
        (("body", "max_tokens"), "max_tokens"),
        (("messages", 0, "content", "str"), "messages.[0].content"),
        (("messages", 2, "content", "list[TextContentPart]", 1, "type"), "messages.[2].content.[1].type"),
        (("stop", "list[str]", 0), "stop.[0]"),
        (("body",), None),
    ],
)
def test_param_path(loc: tuple, expected: str | None) -> None:
    assert param_path(loc) == expected


@pytest.mark.parametrize(
    ("error", "status", "type_", "code"),
    [
        (bad_request("too long", "max_tokens"), 400, "invalid_request_error", None),
        (unauthorized(), 401, "invalid_request_error", "invalid_api_key"),
        (model_not_found("nope"), 404, "invalid_request_error", "model_not_found"),
        (not_ready(), 503, "server_error", "service_unavailable"),
        (server_error(), 500, "server_error", None),
    ],
)
def test_error_helpers(error: OpenAIError, status: int, type_: str, code: str | None) -> None:
    got_status, body = error.as_tuple()
    assert got_status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (type_, code)


def test_parse_body_accepts_bytes_str_and_dict() -> None:
    for raw in (b'{"prompt": "x"}', '{"prompt": "x"}', {"prompt": "x"}):
        assert parse_body(CompletionRequest, raw).prompt == "x"


@pytest.mark.parametrize("raw", [b'{"prompt": ', b"not json", b""])
def test_malformed_json_is_a_400_without_param(raw: bytes) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_body(CompletionRequest, raw)
    assert info.value.status == 400
    assert info.value.info.param is None
    assert "could not parse the JSON body" in info.value.info.message


def test_non_object_body_is_a_400() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_body(ChatCompletionRequest, b"[1, 2]")
    assert info.value.status == 400


def test_several_errors_report_the_first_and_a_count() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_body(CompletionRequest, {"prompt": "x", "max_tokens": 0, "n": 0, "top_p": 2})
    assert info.value.info.param == "max_tokens"
    assert info.value.info.message.endswith("(and 2 more errors)")


def test_fastapi_style_error_list() -> None:
    errors = [{"type": "greater_than_equal", "loc": ("body", "n"), "msg": "Input should be >= 1"}]
    status, body = validation_error_response(errors)
    assert status == 400 and body["error"]["param"] == "n"
    status, body = validation_error_response([{"type": "json_invalid", "loc": ("body", 5), "msg": "bad"}])
    assert body["error"]["param"] is None
