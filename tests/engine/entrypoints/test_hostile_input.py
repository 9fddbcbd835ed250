"""Hostile input against the real server: oversized bodies, NaN / Infinity, invalid UTF-8, absurd limits:
each a 400 naming the problem, answered at once (no tokenizing a text that cannot fit), engine alive."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL

CASES = {
    "10 MB of prompt text": (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "a" * 10_000_000, "max_tokens": 1}),
        "refused without tokenizing",
    ),
    "10,000 chat messages": (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_000}),
        "refused without tokenizing",
    ),
    "a 1M-token prompt": (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": [5] * 1_000_000, "max_tokens": 1}),
        "maximum context length is 1024 tokens",
    ),
    "NaN": ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "temperature": NaN}}', "temperature"),
    "Infinity": ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "top_p": Infinity}}', "top_p"),
    "invalid UTF-8": ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}', "error parsing the body"),
    "a token id past 2**64": (  # found by schemathesis: the tokenizer overflowed (500)
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": [5, 2**64], "max_tokens": 1}),
        "token ids must be in [0, ",
    ),
    "max_tokens 1e20": (
        "/v1/completions",
        f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": {10**20}}}',
        "max_tokens",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_body_is_a_named_400(http: httpx.Client, name: str) -> None:
    path, body, says = CASES[name]
    content = body.encode() if isinstance(body, str) else body
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text[:300]
    assert http.get("/health").status_code == 200


def test_a_client_too_slow_with_its_headers_is_dropped(server, http: httpx.Client) -> None:  # noqa: ANN001
    """Slow-loris: half-sent headers held open. The connection is closed after HEADER_TIMEOUT_S, while
    other clients are served meanwhile; a normal keep-alive client is not affected."""
    import socket
    import time

    from services.common.openai.http_protocol import HEADER_TIMEOUT_S

    host, port = server.url.removeprefix("http://").split(":")
    slow = [socket.create_connection((host, int(port))) for _ in range(20)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    assert http.get("/health").status_code == 200  # 20 stuck clients block nobody
    slow[0].settimeout(HEADER_TIMEOUT_S + 10)
    assert slow[0].recv(100) == b""  # closed by the server, without an answer
    assert HEADER_TIMEOUT_S - 1 <= time.monotonic() - start <= HEADER_TIMEOUT_S + 10
    for s in slow:
        s.close()
    assert http.get("/health").status_code == 200
