"""Every client mistake gets an OpenAI error body with the right status, type and param; never a 5xx."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, ServerProcess

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
INVALID = "invalid_request_error"

CASES = [
    # (id, path, body, status, param)
    ("max_tokens negative", CMPL, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens zero", CMPL, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens float", CMPL, {"prompt": "a", "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens string", CMPL, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature negative", CMPL, {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("top_p zero", CMPL, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p above one", CMPL, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("n zero", CMPL, {"prompt": "a", "n": 0}, 400, "n"),
    ("n huge", CMPL, {"prompt": "a", "n": 10**6, "max_tokens": 1}, 400, "n"),
    ("prompt + max_tokens over max_model_len", CMPL, {"prompt": "a", "max_tokens": 1024}, 400, "max_tokens"),
    ("prompt alone too long", CMPL, {"prompt": [5] * 1024, "max_tokens": 1}, 400, "prompt"),
    ("empty prompt", CMPL, {"prompt": ""}, 400, "prompt"),
    ("token id out of vocab", CMPL, {"prompt": [1, 10**6]}, 400, "prompt"),
    ("logprobs too many", CMPL, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    (
        "stream_options without stream",
        CMPL,
        {"prompt": "a", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("stop_token_ids out of vocab", CMPL, {"prompt": "a", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("missing prompt", CMPL, {"max_tokens": 2}, 400, "prompt"),
    (
        "min_tokens over max_tokens",
        CMPL,
        {"prompt": "a", "max_tokens": 2, "min_tokens": 3},
        400,
        "min_tokens",
    ),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.[0].role"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "chat max_completion_tokens over context",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 5000},
        400,
        "max_tokens",
    ),
    ("chat temperature string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("tokenize prompt and messages", "/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [10**6]}, 400, "tokens"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input(http: httpx.Client, path: str, body: dict, status: int, param: str | None) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == INVALID
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b'"text"',
        b"\xff\xfe",
        b'{"prompt": "a", "messages": [], "temperature": NaN}',
        b'{"prompt": "a", "messages": [], "top_p": Infinity}',
    ],
)
def test_malformed_body_is_400(http: httpx.Client, path: str, raw: bytes) -> None:
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == INVALID


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_unknown_model_is_404(http: httpx.Client, path: str) -> None:
    body = {"model": "gpt-17", "prompt": "a", "messages": MSG}
    response = http.post(path, json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", INVALID)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic sk-kvferry-test", "sk-kvferry-test"])
def test_bad_api_key_is_401(server: ServerProcess, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth else {}
    for path, method in ((CMPL, "POST"), ("/v1/models", "GET")):
        response = httpx.request(method, server.url + path, json={"prompt": "a"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", headers=headers).status_code == 200  # ops routes stay open
    assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    missing = http.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == INVALID
    wrong = http.get(CMPL)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_model_name_may_be_given_or_omitted(http: httpx.Client) -> None:
    for body in ({"model": MODEL, "prompt": "a", "max_tokens": 1}, {"prompt": "a", "max_tokens": 1}):
        assert http.post(CMPL, json=body).status_code == 200
