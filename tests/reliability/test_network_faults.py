"""Network faults between the router and its engines (FaultProxy on loopback): connections reset or stalled
before the answer are retried once on the other engine, and only once; a stream cut or stalled after its
first token ends with a clean SSE error event when migration is off (``--migration-attempts 0``), every
token it carried in order and none twice; no hang
(the client's own timeout would fail the test), no KV block left behind on the engines."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.reliability.fault_proxy import Fault, FaultProxy
from tests.router.stack import RouterProcess, start_router

READ_TIMEOUT_S = 3  # the router's --engine-read-timeout
BODY = {"model": MODEL, "prompt": list(range(3, 60)), "max_tokens": 40, "temperature": 0, "ignore_eos": True}
MID_STREAM = 1200  # answer bytes: the headers and a few token events


@dataclass
class Pool:
    engines: list[InProcessEngine]
    proxies: list[FaultProxy]
    router: RouterProcess
    reference: list[str]  # the streamed texts of BODY, one per token event, when nothing fails

    def retries(self) -> float:
        return self.router.metrics().get("kvferry_router_retries_total", 0.0)

    def kv_freed(self) -> None:
        for e in self.engines:
            e.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)


def _stream(url: str, body: dict = BODY) -> tuple[list[str], dict | None, bool]:
    """Token texts, the error event (or None) and whether [DONE] came, of one streamed completion."""
    texts, error, done = [], None, False
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:"):
                continue
            if data == "[DONE]":
                done = True
            elif "error" in (event := json.loads(data)):
                error = event["error"]
            else:
                texts.append(event["choices"][0]["text"])
    return texts, error, done


@pytest.fixture(scope="module")
def pool(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    engines = [start_in_process(llama_dir, "--num-kv-blocks", "256") for _ in range(3)]
    proxies = [FaultProxy(int(e.url.rsplit(":", 1)[1])) for e in engines]
    router = start_router(
        llama_dir,
        tmp_path_factory.mktemp("router"),
        [p.url for p in proxies],
        "--strategy",
        "round-robin",
        "--engine-read-timeout",
        str(READ_TIMEOUT_S),
        "--migration-attempts",  # the failure after the first token as clients see it without migration
        "0",  # (test_stream_migration.py: with it)
        "--circuit-failures",  # one armed fault per test on the same proxy: never enough to open its circuit
        "1000",  # (test_circuit_breaker.py: the breaker itself)
    )
    try:
        reference, error, done = _stream(router.url)
        assert error is None and done and len(reference) > 20  # events (a few tokens are held for UTF-8)
        yield Pool(engines, proxies, router, reference)
    finally:
        router.stop()
        for p in proxies:
            p.close()
        for e in engines:
            e.stop()


def _until_faulted(pool: Pool, proxy: FaultProxy, ask) -> None:  # noqa: ANN001
    """Ask until ``proxy`` has faulted one request (round-robin reaches it within a few)."""
    for _ in range(6):
        ask()
        if proxy.faulted:
            return
    raise AssertionError("no request reached the faulty proxy")


@pytest.mark.parametrize(
    "fault",
    [Fault("reset", 0), Fault("reset", 60), Fault("stall", 0)],
    ids=["reset-at-once", "reset-mid-headers", "stalled"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_failure_before_the_answer_is_retried_once(pool: Pool, fault: Fault, stream: bool) -> None:
    bad = pool.proxies[0]
    bad.faulted = 0
    bad.arm(fault, times=1)
    before = pool.retries()

    def ask() -> None:
        if stream:
            texts, error, done = _stream(pool.router.url)
            assert error is None and done and texts == pool.reference  # one clean stream, no token twice
        else:
            r = httpx.post(f"{pool.router.url}/v1/completions", json=BODY, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "".join(pool.reference)

    _until_faulted(pool, bad, ask)
    assert pool.retries() == before + 1
    pool.kv_freed()


def test_retries_are_bounded_when_every_engine_fails(pool: Pool) -> None:
    for p in pool.proxies:
        p.faulted = 0
        p.arm(Fault("reset", 0), times=5)
    try:
        r = httpx.post(f"{pool.router.url}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and "engines failed" in r.json()["error"]["message"], r.text
        assert sum(p.faulted for p in pool.proxies) == 2  # the first try and one retry, not a third
    finally:
        for p in pool.proxies:
            p.arm(None)
    assert httpx.post(f"{pool.router.url}/v1/completions", json=BODY, timeout=30).status_code == 200


@pytest.mark.parametrize("action", ["reset", "stall"])
def test_a_stream_cut_after_its_first_token_ends_with_an_error_event(pool: Pool, action: str) -> None:
    """No retry once tokens went out (the client would see them twice): the tokens so far, in order, then
    an ``engine_failed`` error event and [DONE]; a stall is noticed after --engine-read-timeout."""
    for p in pool.proxies:
        p.faulted = 0
        p.arm(Fault(action, MID_STREAM), times=1)  # whichever engine the stream goes to
    before = pool.retries()
    start = time.monotonic()
    try:
        texts, error, done = _stream(pool.router.url)
    finally:
        for p in pool.proxies:
            p.arm(None)
    took = time.monotonic() - start
    assert error is not None and error["code"] == "engine_failed" and done, (error, done)
    assert 0 < len(texts) < len(pool.reference) and texts == pool.reference[: len(texts)]
    assert pool.retries() == before
    if action == "stall":
        assert took >= READ_TIMEOUT_S  # ended by the read timeout, not by anything else
    pool.kv_freed()  # the engine saw its client go and freed the request's blocks


def test_the_openai_client_raises_on_a_cut_stream(pool: Pool) -> None:
    """What an application sees: the official client raises APIError naming the failure, no hang."""
    for p in pool.proxies:
        p.arm(Fault("reset", MID_STREAM), times=1)
    client = openai.OpenAI(base_url=f"{pool.router.url}/v1", api_key="none", timeout=30, max_retries=0)
    received = []
    try:
        with pytest.raises(openai.APIError, match="engine failed while streaming"):
            args = {k: v for k, v in BODY.items() if k != "ignore_eos"}
            for chunk in client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}):
                received.append(chunk.choices[0].text)
    finally:
        for p in pool.proxies:
            p.arm(None)
    assert received == pool.reference[: len(received)]
