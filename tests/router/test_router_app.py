"""The router in front of three real aggregated engines and a real Redis: routing, streaming, errors,
Redis stopped mid-test, an engine killed. The destructive tests run last in the module."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.common.kv.hashing import BlockHasher
from services.common.kv.prefix_index import PrefixIndex
from tests.engine.entrypoints.helpers import MODEL, ServerProcess
from tests.redis_server import RedisServer
from tests.router.stack import BLOCK, RouterProcess, start_router

PREFIX_BLOCKS = 4


@pytest.fixture(scope="module")
def routers(
    llama_dir: Path, log_dir: Path, engines: list[ServerProcess], pool_redis: RedisServer
) -> Iterator[list[RouterProcess]]:
    """Two router replicas over the same pool and index."""
    urls = [e.url for e in engines]
    replicas = [start_router(llama_dir, log_dir, urls, redis_url=pool_redis.url) for _ in range(2)]
    yield replicas
    for r in replicas:
        r.stop()


def prefixes(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(count)]


def complete(router: RouterProcess, prompt: list[int], **kw: object) -> httpx.Response:
    with router.http() as http:
        response = http.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
        )
    assert response.status_code == 200, response.text
    return response


def wait_indexed(redis_url: str, prompt: list[int], timeout: float = 10.0) -> None:
    """Until some engine's blocks of ``prompt`` are in the index (publishing is asynchronous)."""
    hashes = BlockHasher(MODEL, BLOCK).hash_tokens(prompt)
    index = PrefixIndex.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            matches = index.lookup(hashes) or {}
            if any(m.longest == len(hashes) for m in matches.values()):
                return
            time.sleep(0.05)
    finally:
        index.close()
    raise AssertionError("the prompt's blocks never showed up in the index")


def test_same_prefix_lands_on_its_holder_and_replicas_agree(
    routers: list[RouterProcess], pool_redis: RedisServer, engines: list[ServerProcess]
) -> None:
    rng = random.Random(7)
    holders = {}
    for i, prefix in enumerate(prefixes(3, seed=1)):
        holders[i] = complete(routers[0], prefix).headers["x-kvferry-endpoint"]
        wait_indexed(pool_redis.url, prefix)
    hits_before = sum(e.metrics().get("kvferry_prefix_cache_hits_total", 0) for e in engines)
    for _ in range(9):
        i = rng.randrange(3)
        suffix = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 20))]
        replica = routers[rng.randrange(2)]
        served = complete(replica, prefixes(3, seed=1)[i] + suffix).headers["x-kvferry-endpoint"]
        assert served == holders[i]
    hits = sum(e.metrics().get("kvferry_prefix_cache_hits_total", 0) for e in engines) - hits_before
    assert hits >= 9 * PREFIX_BLOCKS * BLOCK - 9  # each follow-up hit its whole prefix (capped one short)
    m = routers[0].metrics()
    assert m["kvferry_router_prefix_hit_blocks_total"] >= 4 * PREFIX_BLOCKS - 4
    assert m["kvferry_router_index_lookup_seconds_count"] >= 3


def test_openai_client_streams_chat_and_completions(
    routers: list[RouterProcess], engines: list[ServerProcess]
) -> None:
    client = openai.OpenAI(base_url=f"{routers[1].url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the ferry that carries KV blocks."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    direct = openai.OpenAI(base_url=f"{engines[0].url}/v1", api_key="unused", max_retries=0)
    reference = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert text == reference.choices[0].message.content  # the same tokens on both paths
    assert reference.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    assert plain.choices[0].message.content == text
    assert len(plain.choices[0].logprobs.content) == 6
    assert len(plain.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = client.completions.create(
        model=MODEL, prompt="The router says", max_tokens=5, temperature=0, stream=True
    )
    pieces = list(stream)
    assert pieces[-1].choices[0].finish_reason == "length"
    expected = direct.completions.create(model=MODEL, prompt="The router says", max_tokens=5, temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == expected.choices[0].text


def test_prompt_logprobs_through_the_router(
    routers: list[RouterProcess], engines: list[ServerProcess]
) -> None:
    """echo + logprobs and vLLM's prompt_logprobs pass through; chat gets them at the top level, as vLLM does."""
    client = openai.OpenAI(base_url=f"{routers[0].url}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=f"{engines[0].url}/v1", api_key="unused", max_retries=0)
    kw = {
        "model": MODEL,
        "prompt": "The ferry scores its prompt",
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    routed, plain = client.completions.create(**kw).choices[0], direct.completions.create(**kw).choices[0]
    assert routed.text == plain.text and routed.text.startswith(kw["prompt"])  # the caller's text is echoed
    routed_lp, direct_lp = routed.logprobs, plain.logprobs
    assert routed_lp.tokens == direct_lp.tokens and routed_lp.token_logprobs[0] is None
    assert routed_lp.token_logprobs[1:] == pytest.approx(direct_lp.token_logprobs[1:], abs=1e-5)
    messages = [{"role": "user", "content": "score me"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None and all(1 <= len(e) <= 2 for e in plp[1:])


def test_bad_input_gets_openai_error_json(routers: list[RouterProcess]) -> None:
    with routers[0].http() as http:
        missing = http.post("/v1/completions", json={"max_tokens": 2})
        wrong_model = http.post(
            "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
        )
        too_long = http.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 5000})
        bad_json = http.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    assert (
        too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    )  # the engine's answer
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"


def test_models_tokenize_health_metrics(routers: list[RouterProcess]) -> None:
    with routers[0].http() as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        ids = http.post("/tokenize", json={"prompt": "hello ferry"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("hello ferry")
        assert http.get("/health").json() == {"status": "ok"}
    m = routers[0].metrics()
    assert m["kvferry_router_self_check_ok"] == 1
    assert m["kvferry_router_redis_up"] == 1
    assert m['kvferry_router_requests_total{decision="aggregated"}'] >= 1


def routed(router: RouterProcess) -> float:
    return sum(v for k, v in router.metrics().items() if k.startswith("kvferry_router_requests_total"))


def test_context_length_comes_from_the_engines(
    routers: list[RouterProcess], engines: list[ServerProcess]
) -> None:
    with engines[0].http() as direct:
        limit = direct.get("/v1/models").json()["data"][0]["max_model_len"]
        long = [5] * (limit + 10)
        engine_error = direct.post("/v1/completions", json={"prompt": long, "max_tokens": 1}).json()["error"]
    before = routed(routers[0])
    with routers[0].http() as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == limit
        assert http.post("/tokenize", json={"prompt": "hello ferry"}).json()["max_model_len"] == limit
        too_long = http.post("/v1/completions", json={"prompt": long, "max_tokens": 1})
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "ferry " * limit}], "max_tokens": 1},
        )
        fits = http.post("/v1/completions", json={"prompt": [5] * (limit - 1), "max_tokens": 1})
    assert (
        too_long.status_code == 400 and too_long.json()["error"] == engine_error
    )  # the engine's words and field
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert chat.json()["error"]["message"].startswith(
        f"This model's maximum context length is {limit} tokens"
    )
    assert fits.status_code == 200, fits.text
    assert routed(routers[0]) - before == 1  # the two long prompts never reached an engine


def test_context_length_before_any_engine_answered(llama_dir: Path, log_dir: Path) -> None:
    router = start_router(llama_dir, log_dir, ["http://127.0.0.1:1"], healthy=False)
    try:
        with router.http() as http:
            assert http.post("/tokenize", json={"prompt": "hello"}).json()["max_model_len"] == 0
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] is None
            unchecked = http.post("/v1/completions", json={"prompt": [5] * 5000, "max_tokens": 1})
        assert unchecked.status_code == 503  # not judged by length: no engine to serve it
        assert "kvferry_router_redis_up" not in router.metrics()  # no --redis-url: no Redis to reach
    finally:
        router.stop()


def test_client_disconnect_aborts_the_engine_request(
    routers: list[RouterProcess], engines: list[ServerProcess]
) -> None:
    def aborted() -> float:
        return sum(
            e.metrics().get('kvferry_request_success_total{finish_reason="abort"}', 0) for e in engines
        )

    before = aborted()
    body = {"prompt": prefixes(1, seed=4)[0], "max_tokens": 800, "ignore_eos": True, "stream": True}
    with routers[0].http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 10
    while aborted() == before:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.1)


def test_mismatched_block_size_fails_the_self_check(
    llama_dir: Path, log_dir: Path, engines: list[ServerProcess]
) -> None:
    router = start_router(llama_dir, log_dir, [engines[0].url], "--block-size", "32", healthy=False)
    try:
        deadline = time.monotonic() + 20
        while True:
            health = httpx.get(f"{router.url}/health", timeout=5)
            if "block_size" in health.text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert health.status_code == 503
        assert "block_size=16" in health.json()["error"]["message"]
        assert "SELF-CHECK FAILED" in router.log_text()
    finally:
        router.stop()


def test_redis_stopped_mid_test_routes_by_load(routers: list[RouterProcess], pool_redis: RedisServer) -> None:
    before = routers[0].metrics()['kvferry_router_fallbacks_total{kind="index"}']
    pool_redis.stop()
    try:
        for prefix in prefixes(3, seed=2):
            complete(routers[0], prefix)
        m = routers[0].metrics()
        assert m['kvferry_router_fallbacks_total{kind="index"}'] - before == 3
        assert m["kvferry_router_redis_up"] == 0  # the alert KvferryRedisUnreachable reads this
        assert "prefix index unavailable" in routers[0].log_text()
    finally:
        pool_redis.start()
    assert routers[0].metrics()["kvferry_router_redis_up"] == 1  # each scrape PINGs afresh


def test_killed_engine_mid_stream_then_retried_and_taken_out(
    llama_dir: Path,
    log_dir: Path,
    routers: list[RouterProcess],
    pool_redis: RedisServer,
    engines: list[ServerProcess],
) -> None:
    # A replica that polls rarely still sends requests to the dead engine: they must be retried elsewhere.
    slow = start_router(
        llama_dir, log_dir, [e.url for e in engines], "--poll-interval", "60", redis_url=pool_redis.url
    )
    try:
        prefix = prefixes(1, seed=3)[0]
        holder = complete(slow, prefix).headers["x-kvferry-endpoint"]
        wait_indexed(pool_redis.url, prefix)
        victim = next(e for e in engines if e.url == holder)
        body = {"prompt": prefix + [9], "max_tokens": 600, "ignore_eos": True, "stream": True}
        with slow.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["x-kvferry-endpoint"] == holder
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and '"engine_failed"' not in "".join(rest)  # migrated, then finished
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        for i in range(4):
            served = complete(slow, prefix + [i + 3], stream=bool(i % 2)).headers["x-kvferry-endpoint"]
            assert served != victim.url
        m = slow.metrics()
        # the follow-ups are retried off the victim, or avoid it already: while the migrated stream ran, the
        # victim's index entries expired and its continuation's engine became the prefix's holder
        assert m["kvferry_router_stream_errors_total"] == 0
        assert m['kvferry_router_migrations_total{outcome="resumed"}'] == 1
    finally:
        slow.stop()
    deadline = time.monotonic() + 10
    while routers[0].metrics()["kvferry_router_healthy_endpoints"] != 2:
        assert time.monotonic() < deadline, "the dead engine was never taken out"
        time.sleep(0.2)
    for i in range(3):
        assert complete(routers[1], prefix + [i + 50]).headers["x-kvferry-endpoint"] != victim.url
