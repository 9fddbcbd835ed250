"""KV migration on drain: an engine (decode, or aggregated with a NIXL agent) that gets SIGTERM leases its running
streams' KV and ends them with kv_transfer_params; the router continues each on another engine of the role, which
READs that KV over NIXL instead of recomputing it, and the client sees the undisturbed stream. The drained engine
waits for the read, then exits."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import start_router

# 63 tokens: once 3 tokens were streamed, 65 have KV, so 4 full blocks of 16 hold it (the 4th with output)
PROMPT = list(range(3, 66))
# 120 tokens: long enough to be drained mid-way, short enough that no near-tie of the random model flips
# a greedy token between the moved tail's recompute and the undisturbed decode
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
RECEIVED = 'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'


def _stream(url: str, on_tokens: tuple[int, threading.Event] | None = None) -> tuple[str, str | None, int]:
    """(text, finish_reason, migrations) of one streamed completion; sets the event after N text chunks."""
    text, finish, migrations, chunks = "", None, 0, 0
    body = {**GREEDY, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": kvferry-migrations "):
                migrations = int(line.split()[-1])
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line.removeprefix("data:"))
            assert "error" not in event and "kv_transfer_params" not in event, event
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
                chunks += 1
            if on_tokens is not None and chunks == on_tokens[0]:
                on_tokens[1].set()
    return text, finish, migrations


def _drain_when(event: threading.Event, engines: list[InProcessEngine], codes: list[int]) -> threading.Thread:
    """SIGTERM (as the harness's stop does) whichever engine holds the stream once ``event`` is set."""

    def run() -> None:
        event.wait(60)
        busy = [e for e in engines if e.metrics()["kvferry_num_requests_running"] > 0]
        codes.append(busy[0].stop() if busy else -1)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("role", ["decode", "both"])
def test_a_drained_engine_hands_its_streams_kv_to_another(llama_dir: Path, tmp_path: Path, role: str) -> None:
    # no prefix caching: the survivor cannot find the prefix locally (it served the reference), so it must READ
    common = ("--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "512", "--no-prefix-caching")
    decodes = [start_in_process(llama_dir, "--role", role, *common) for _ in range(2)]
    urls = [d.url for d in decodes]
    if role == "decode":
        router = start_router(llama_dir, tmp_path, [], *[a for u in urls for a in ("--decode", u)])
    else:
        router = start_router(llama_dir, tmp_path, urls)
    try:
        reference = _stream(router.url)
        assert reference[1] == "length" and reference[2] == 0
        started, codes = threading.Event(), []
        stopper = _drain_when(started, decodes, codes)
        seen = _stream(router.url, (3, started))
        stopper.join(60)
        assert seen == (reference[0], "length", 1)
        assert codes == [0]  # the drained engine waited for the read, then stopped cleanly
        moved = router.metrics()
        assert moved['kvferry_router_migrations_total{outcome="moved"}'] == 1
        assert moved['kvferry_router_migrations_total{outcome="resumed"}'] == 0
        survivor = next(d for d in decodes if d._thread.is_alive())
        m = survivor.metrics()
        assert m[RECEIVED] >= 4  # the prompt's blocks and one with generated tokens: read, not recomputed
        assert sum(v for k, v in m.items() if k.startswith("kvferry_kv_transfer_failures_total")) == 0
        survivor.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=30)
    finally:
        router.stop()
        for d in decodes:
            d.stop()


def test_without_nixl_a_drained_aggregated_engines_streams_are_replayed(
    llama_dir: Path, tmp_path: Path
) -> None:
    """--no-nixl: nothing moves; the drain timeout fails the stream and the router recomputes it elsewhere."""
    common = ("--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "512", "--no-nixl")
    engines = [start_in_process(llama_dir, *common, "--drain-timeout", "0") for _ in range(2)]
    router = start_router(llama_dir, tmp_path, [e.url for e in engines])
    try:
        reference = _stream(router.url)
        started, codes = threading.Event(), []
        stopper = _drain_when(started, engines, codes)
        seen = _stream(router.url, (3, started))
        stopper.join(60)
        assert seen == (reference[0], "length", 1)
        m = router.metrics()
        assert m['kvferry_router_migrations_total{outcome="resumed"}'] == 1
        assert m['kvferry_router_migrations_total{outcome="moved"}'] == 0
        survivor = next(e for e in engines if e._thread.is_alive())
        assert survivor.metrics().get(RECEIVED, 0.0) == 0
    finally:
        router.stop()
        for e in engines:
            e.stop()
