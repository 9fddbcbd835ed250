"""``/v1/completions`` through the official openai client against a real ``kvferry serve``."""

from __future__ import annotations

import random

import httpx
import openai

from tests.engine.entrypoints.helpers import MODEL

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def unique_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other test uses (so prefix-cache numbers are exact)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


def test_usage_matches_token_counts(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "the quick brown fox jumps over the lazy dog"
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, logprobs=0, **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 7
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n_prompt,
        7,
        n_prompt + 7,
    )


def test_cached_tokens_are_reported(client: openai.OpenAI) -> None:
    prompt = unique_prompt(40, seed=1)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # two full 16-token blocks
    assert first.choices[0].text == second.choices[0].text


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    prompt = unique_prompt(10, seed=2)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_n2_with_seed_uses_seed_plus_i(client: openai.OpenAI) -> None:
    prompt = unique_prompt(6, seed=3)
    kw = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    pair = client.completions.create(n=2, seed=1234, **kw)
    again = client.completions.create(n=2, seed=1234, **kw)
    second = client.completions.create(n=1, seed=1235, **kw)
    texts = [c.text for c in sorted(pair.choices, key=lambda c: c.index)]
    assert [c.index for c in pair.choices] == [0, 1]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[1] == second.choices[0].text
    assert texts[0] != texts[1]
    assert pair.usage.completion_tokens == 16 and pair.usage.prompt_tokens == 6


def test_n2_stream_has_both_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=unique_prompt(5, 4),
            max_tokens=5,
            n=2,
            stream=True,
            seed=7,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    prompt = unique_prompt(8, seed=5)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY).choices[0].text
    candidates = [
        full[i : i + 2]
        for i in range(2, len(full) - 2)
        if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
    ]
    assert candidates, full
    stop = candidates[len(candidates) // 2]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY).choices[
        0
    ]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop


def test_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)  # top-3 plus the sampled token, by text
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_and_batched_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["hello world", "the lazy dog"], max_tokens=3, echo=True, **GREEDY
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("hello world") and out.choices[1].text.startswith("the lazy dog")
    assert out.usage.completion_tokens == 6


def test_token_id_prompts_batch(client: openai.OpenAI) -> None:
    prompts = [unique_prompt(4, 6), unique_prompt(9, 7)]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, **GREEDY)
    assert out.usage.prompt_tokens == 13 and len(out.choices) == 2


def test_models_version_tokenize(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert models.data[0].model_extra["quantization"] == "none"  # a float checkpoint, run as it is
    assert "version" in http.get("/version").json()
    ids = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert ids["count"] == len(ids["tokens"]) == len(ids["token_strs"])
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


def test_request_id_header_is_echoed(http: httpx.Client) -> None:
    body = {"prompt": "hello", "max_tokens": 1}
    response = http.post("/v1/completions", json=body, headers={"X-Request-Id": "my-id-42"})
    assert response.headers["x-request-id"] == "my-id-42"
    assert response.json()["id"] == "cmpl-my-id-42"
    generated = http.post("/v1/completions", json=body).headers["x-request-id"]
    assert len(generated) >= 16


def test_return_token_ids_streams_each_chunks_new_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    """``return_token_ids``: streamed chunks carry their new token ids (together the non-streamed ones); a
    ``resumed_output_tokens`` longer than the prompt is a 400 naming the field."""
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert len(whole["token_ids"]) == 9 and "token_ids" not in plain
    stream = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=9,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = [t for chunk in stream for t in chunk.choices[0].model_extra.get("token_ids", [])]
    assert ids == whole["token_ids"]
    bad = http.post("/v1/completions", json={**body, "resumed_output_tokens": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "resumed_output_tokens", bad.text
