"""OpenAI logit_bias end to end: a +100 bias forces its token under greedy decoding, a -100 bias removes the
greedy choice, and ids outside the vocabulary (or malformed maps) are a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

PROMPT = [5, 6, 7, 8]


def _tokens(http: httpx.Client, **body: object) -> list[str]:
    """The greedy output's tokens (their texts, from logprobs)."""
    r = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _text(http: httpx.Client, token_id: int) -> str:
    return http.post("/detokenize", json={"tokens": [token_id]}).json()["prompt"]


def test_a_large_bias_forces_its_token_and_a_negative_one_removes_it(http: httpx.Client) -> None:
    greedy = _tokens(http)
    forced = next(t for t in range(40, 60) if _text(http, t) not in greedy)
    assert _tokens(http, logit_bias={str(forced): 100}) == [_text(http, forced)] * 4
    other = next(t for t in range(forced + 1, 80) if _text(http, t) not in (*greedy, _text(http, forced)))
    both = {str(forced): 100, str(other): 90}
    assert _tokens(http, logit_bias=both) == [_text(http, forced)] * 4
    assert _tokens(http, logit_bias={**both, str(forced): -100}) == [_text(http, other)] * 4  # -100: gone
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
              "logprobs": True, "logit_bias": {str(forced): 100}},
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [_text(http, forced)] * 3


@pytest.mark.parametrize("bias", [{"10000000": 5}, {"abc": 1}, {"1": 100.5}])
def test_a_bad_logit_bias_is_a_400_naming_it(http: httpx.Client, bias: dict) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
