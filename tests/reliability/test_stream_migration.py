"""Request migration: a stream whose engine fails mid-way (reset, stall) is resumed on another engine with
prompt + its tokens so far, and the client sees exactly the undisturbed stream (greedy, seeded sampling with
penalties and logprobs, stop strings spanning the splice, chat); bounded attempts, a clean error event when
no engine can take it, and a client leaving during a migration frees every engine's blocks."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.reliability.fault_proxy import Fault, FaultProxy
from tests.router.stack import RouterProcess, start_router

STALL_S = 2  # the router's --migration-stall-timeout
PROMPT = list(range(3, 60))
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
SEEDED = {
    **GREEDY,
    "temperature": 1.0,
    "seed": 11,
    "frequency_penalty": 0.6,
    "presence_penalty": 0.4,
    "repetition_penalty": 1.2,
    "logprobs": 2,
    "stream_options": {"include_usage": True},
}
CUTS = (900, 1300, 1900)  # answer bytes before the cut: the headers and a few token events


@dataclass
class Seen:
    """What a client saw of one stream."""

    text: str = ""
    finish: str | None = None
    stop_reason: Any = None
    usage: dict | None = None
    tokens: list[str] = field(default_factory=list)  # logprobs' tokens
    offsets: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: dict | None = None
    done: bool = False
    migrations: int = 0


def _stream(url: str, body: dict, path: str = "/v1/completions") -> Seen:
    seen = Seen()
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": kvferry-migrations "):
                seen.migrations = int(line.split()[-1])
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                seen.done = True
                continue
            event = json.loads(data)
            seen.error = event.get("error", seen.error)
            seen.usage = event.get("usage") or seen.usage
            for choice in event.get("choices") or []:
                assert "token_ids" not in choice  # the router asked for them, the client did not
                seen.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                seen.finish = choice.get("finish_reason") or seen.finish
                seen.stop_reason = choice.get("stop_reason") or seen.stop_reason
                if lp := choice.get("logprobs"):
                    seen.tokens += lp["tokens"]
                    seen.offsets += lp["text_offset"]
                    seen.logprobs += lp["token_logprobs"]
    return seen


@dataclass
class Pool:
    engines: list[InProcessEngine]
    proxies: list[FaultProxy]
    router: RouterProcess

    def migrations(self, outcome: str) -> float:
        return self.router.metrics().get(f'kvferry_router_migrations_total{{outcome="{outcome}"}}', 0.0)

    def fault_all(self, faults: list[Fault | None]) -> None:
        """The pool's next POSTs meet these faults in order, whichever engines they go to."""
        shared = list(faults)
        for p in self.proxies:
            p.queue(shared)

    def clear(self) -> None:
        for p in self.proxies:
            p.arm(None)

    def kv_freed(self) -> None:
        for e in self.engines:
            e.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)


@pytest.fixture(scope="module")
def pool(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    engines = [start_in_process(llama_dir, "--num-kv-blocks", "256") for _ in range(3)]
    proxies = [FaultProxy(int(e.url.rsplit(":", 1)[1])) for e in engines]
    router = start_router(
        llama_dir,
        tmp_path_factory.mktemp("router"),
        [p.url for p in proxies],
        "--migration-stall-timeout",
        str(STALL_S),
    )
    try:
        yield Pool(engines, proxies, router)
    finally:
        router.stop()
        for p in proxies:
            p.close()
        for e in engines:
            e.stop()


def _migrated(pool: Pool, body: dict, fault: Fault, path: str = "/v1/completions") -> Seen:
    """The stream of ``body`` with its first engine failing by ``fault`` (whichever engine it goes to)."""
    before = pool.migrations("resumed")
    pool.fault_all([fault])
    try:
        seen = _stream(pool.router.url, body, path)
    finally:
        pool.clear()
    assert seen.error is None and seen.done, seen
    assert seen.migrations == 1 and pool.migrations("resumed") == before + 1
    return seen


@pytest.mark.parametrize("cut", CUTS)
def test_a_greedy_stream_cut_mid_way_is_the_undisturbed_stream(pool: Pool, cut: int) -> None:
    reference = _stream(pool.router.url, GREEDY)
    assert reference.migrations == 0 and reference.finish == "length"
    seen = _migrated(pool, GREEDY, Fault("reset", cut))
    assert (seen.text, seen.finish) == (reference.text, reference.finish)
    pool.kv_freed()


def test_a_seeded_stream_with_penalties_and_logprobs_resumes_its_draws(pool: Pool) -> None:
    """Same tokens, logprobs (to float noise), offsets and usage; a stall counts as a failure too."""
    reference = _stream(pool.router.url, SEEDED)
    for fault in (Fault("reset", 1500), Fault("stall", 1100)):
        started = time.monotonic()
        seen = _migrated(pool, SEEDED, fault)
        assert (seen.text, seen.tokens, seen.offsets) == (reference.text, reference.tokens, reference.offsets)
        assert seen.logprobs == pytest.approx(reference.logprobs, abs=1e-3)
        assert seen.usage is not None and reference.usage is not None
        assert (seen.usage["prompt_tokens"], seen.usage["completion_tokens"]) == (len(PROMPT), 40)
        if fault.action == "stall":
            assert time.monotonic() - started >= STALL_S
    pool.kv_freed()


def test_stop_strings_after_the_splice_end_the_stream_as_they_would_have(pool: Pool) -> None:
    """Stop strings from the undisturbed text past the splice: each ends the migrated stream at the same
    character with the same stop reason and usage."""
    cut = CUTS[1]
    full = _stream(pool.router.url, GREEDY).text
    for start in (len(full) // 4, len(full) // 2):
        stop = full[start : start + 6]
        body = {**GREEDY, "stop": [stop], "stream_options": {"include_usage": True}}
        reference = _stream(pool.router.url, body)
        assert reference.finish == "stop" and reference.stop_reason == stop, reference
        seen = _migrated(pool, body, Fault("reset", cut))
        assert (seen.text, seen.finish, seen.stop_reason) == (reference.text, "stop", stop)
        assert seen.usage is not None and reference.usage is not None
        assert seen.usage["completion_tokens"] == reference.usage["completion_tokens"], (seen.usage, cut)


def _chunk_texts(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    return [json.loads(d)["choices"][0]["text"] for d in lines if d != "[DONE]" and json.loads(d)["choices"]]


def test_a_stop_string_the_failed_engine_had_begun_is_found_across_the_splice(pool: Pool) -> None:
    """Stop strings placed where the first engine was cut: one starts in the text it held back (so neither
    engine can see it whole) and the router ends the stream there, as the undisturbed stream ends."""
    cut = 1300
    texts = _chunk_texts(pool.router.url, GREEDY)  # about one token per chunk
    full = "".join(texts)
    _migrated(pool, GREEDY, Fault("reset", cut))
    tokens = int(re.findall(r"failed after (\d+) tokens", pool.router.log_text())[-1])
    at = len("".join(texts[:tokens]))  # where the first engine's text ended at the cut
    for start in range(max(at - 6, 1), at + 3):
        stop = full[start : start + 6]
        body = {**GREEDY, "stop": [stop], "stream_options": {"include_usage": True}}
        reference = _stream(pool.router.url, body)
        before = pool.router.log_text().count("spans the splice")
        seen = _migrated(pool, body, Fault("reset", cut))
        assert (seen.text, seen.finish, seen.stop_reason) == (reference.text, "stop", reference.stop_reason)
        assert seen.usage is not None and reference.usage is not None
        assert seen.usage["completion_tokens"] == reference.usage["completion_tokens"]
        if pool.router.log_text().count("spans the splice") > before:
            return  # one stop string spanned the splice (the earlier ones did not: the engines saw them)
    raise AssertionError("no stop string spanned the splice: the test did not test it")


def test_a_chat_stream_is_migrated(pool: Pool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 30}
    body |= {"temperature": 0, "ignore_eos": True}
    reference = _stream(pool.router.url, body, "/v1/chat/completions")
    seen = _migrated(pool, body, Fault("reset", 1500), "/v1/chat/completions")
    assert (seen.text, seen.finish) == (reference.text, reference.finish) and reference.text


def test_migrations_are_bounded(pool: Pool) -> None:
    """Every engine failing mid-stream: two migrations, then an engine_failed error event and [DONE]."""
    before = pool.migrations("exhausted")
    pool.fault_all([Fault("reset", 1100)] * 3)
    try:
        seen = _stream(pool.router.url, GREEDY)
    finally:
        pool.clear()
    assert seen.error is not None and seen.error["code"] == "engine_failed" and seen.done, seen
    assert pool.migrations("exhausted") == before + 1
    pool.kv_freed()


def test_a_client_leaving_during_a_migration_frees_everything(pool: Pool) -> None:
    """The first engine stalls, the stream moves, the next engine stalls too; the client leaves meanwhile:
    no engine keeps a block, and the router serves on."""
    pool.fault_all([Fault("stall", 1100)] * 2)
    try:
        with httpx.stream("POST", f"{pool.router.url}/v1/completions", json={**GREEDY, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines)
            time.sleep(STALL_S + 1.5)  # the first stall is noticed, the stream moved, and stalls again
    finally:
        pool.clear()
    pool.kv_freed()
    assert httpx.post(f"{pool.router.url}/v1/completions", json=GREEDY, timeout=60).status_code == 200


def test_no_engine_to_migrate_to_is_a_clean_error_event(pool: Pool, tmp_path: Path, llama_dir: Path) -> None:
    """A router with one engine: the continuation has nowhere to go, the client gets an error event."""
    alone = start_router(llama_dir, tmp_path, [pool.proxies[0].url])
    try:
        pool.proxies[0].queue([Fault("reset", 1100)])
        started = time.monotonic()
        seen = _stream(alone.url, GREEDY)
        assert seen.error is not None and seen.error["code"] == "engine_failed" and seen.done, seen
        assert "migration failed" in seen.error["message"] and time.monotonic() - started < 20
        assert alone.metrics()['kvferry_router_migrations_total{outcome="refused"}'] == 1
    finally:
        pool.clear()
        alone.stop()
    pool.kv_freed()


def test_a_failed_decode_is_migrated_to_another_decode_through_prefill(
    llama_dir: Path, tmp_path: Path
) -> None:
    """P/D: the continuation (prompt + the tokens so far) is prefilled and handed to the other decode over
    NIXL, and the client still sees the undisturbed stream."""
    common = ("--block-size", "16", "--num-kv-blocks", "256")
    prefill = start_in_process(llama_dir, "--role", "prefill", "--kv-lease", "20", *common)
    decodes = [start_in_process(llama_dir, "--role", "decode", *common) for _ in range(2)]
    proxies = [FaultProxy(int(d.url.rsplit(":", 1)[1])) for d in decodes]
    args = [
        "--pd-threshold",
        "0",
        "--prefill",
        prefill.url,
        *[a for p in proxies for a in ("--decode", p.url)],
    ]
    router = start_router(llama_dir, tmp_path, [], *args)
    try:
        reference = _stream(router.url, GREEDY)
        before = router.metrics()['kvferry_router_requests_total{decision="disaggregated"}']
        shared: list[Fault | None] = [Fault("reset", 1300)]
        for p in proxies:
            p.queue(shared)
        seen = _stream(router.url, GREEDY)
        assert seen.error is None and seen.migrations == 1, seen
        assert (seen.text, seen.finish) == (reference.text, "length")
        m = router.metrics()
        assert (
            m['kvferry_router_requests_total{decision="disaggregated"}'] - before == 2
        )  # the continuation too
        assert m['kvferry_router_migrations_total{outcome="resumed"}'] == 1
        for engine in (prefill, *decodes):
            engine.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)
    finally:
        router.stop()
        for p in proxies:
            p.close()
        for e in (prefill, *decodes):
            e.stop()
