"""Chaos: kill -9 an engine mid-stream behind the router. Its in-flight streams end with an SSE error event
(no hang), new requests go to the surviving engine, nothing else is disturbed, and the engine restarted
on its address is back in rotation."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx

from tests.engine.entrypoints.helpers import MODEL, start_server
from tests.engine_harness import start_in_process
from tests.router.stack import start_router


async def _stream(client: httpx.AsyncClient, prompt: list[int], started: asyncio.Event) -> dict:
    """One stream to its end: the engine that served it, whether it ended with [DONE] or an error event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    out = {"done": False, "error": None, "endpoint": None, "chunks": 0}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        out["endpoint"] = response.headers.get("x-kvferry-endpoint")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                out["done"] = True
            elif "error" in (event := json.loads(data)):
                out["error"] = event["error"]
            else:
                out["chunks"] += 1
                started.set()
    return out


async def _kill_during_streams(router_url: str, victim_url: str, victim_pid: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(base_url=router_url, timeout=60) as client:
        started = asyncio.Event()
        tasks = [
            asyncio.create_task(_stream(client, [3 + (i * 31 + j) % 390 for j in range(40 + i)], started))
            for i in range(6)
        ]
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.3)
        os.kill(victim_pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return results, time.monotonic() - killed


def test_kill_9_an_engine_mid_stream(llama_dir: Path, tmp_path: Path) -> None:
    args = ("--num-kv-blocks", "256", "--max-num-seqs", "8")
    engines = [start_server(llama_dir, tmp_path, *args) for _ in range(2)]
    router = start_router(llama_dir, tmp_path, [e.url for e in engines], "--strategy", "round-robin")
    try:
        victim = engines[0]
        results, took = asyncio.run(_kill_during_streams(router.url, victim.url, victim.proc.pid))
        on_victim = [r for r in results if r["endpoint"] == victim.url]
        assert on_victim, results  # round-robin put some streams on the victim
        for r in results:  # the victim's streams move to the survivor and finish; the others are undisturbed
            assert r["done"] and r["error"] is None, r
        assert took < 10, took
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert 'kvferry_router_migrations_total{outcome="resumed"}' in metrics
        deadline = time.monotonic() + 20
        with router.http() as http:
            body = {"model": MODEL, "prompt": list(range(3, 50)), "max_tokens": 4, "temperature": 0}
            for _ in range(4):  # new requests all go to the survivor (after at most a failed try)
                while True:
                    answer = http.post("/v1/completions", json=body)
                    if answer.status_code == 200 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-kvferry-endpoint"] == engines[1].url
            port = int(victim.url.rsplit(":", 1)[1])  # restarted on its address: back in rotation
            engines[0] = start_server(llama_dir, tmp_path, *args, port=port)
            served = set()
            deadline = time.monotonic() + 30
            while len(served) < 2 and time.monotonic() < deadline:
                answer = http.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                served.add(answer.headers["x-kvferry-endpoint"])
            assert served == {engines[0].url, engines[1].url}
    finally:
        router.stop()
        for e in engines:
            if e.proc.poll() is None:
                e.stop()


def test_a_hung_prefill_costs_decode_a_recompute_not_a_hang(llama_dir: Path, tmp_path: Path) -> None:
    """SIGSTOP prefill after it answered: decode's handshake times out, decode recomputes the prompt
    (counted as handshake_failed) and answers the tokens aggregated decoding gives."""
    common = ("--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "512")
    prefill = start_server(llama_dir, tmp_path, "--role", "prefill", "--kv-lease", "20", *common)
    decode = start_in_process(llama_dir, "--role", "decode", *common)
    aggregated = start_in_process(llama_dir, *common)
    prompt = list(range(3, 100))
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    try:
        first = httpx.post(
            f"{prefill.url}/v1/completions",
            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            timeout=30,
        ).json()
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        params = first["kv_transfer_params"]
        out = httpx.post(
            f"{decode.url}/v1/completions",
            json={**body, "max_tokens": 8, "kv_transfer_params": params},
            timeout=60,
        )
        took = time.monotonic() - start
        ref = httpx.post(f"{aggregated.url}/v1/completions", json={**body, "max_tokens": 8}, timeout=30)
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        assert decode.metrics()['kvferry_kv_transfer_failures_total{reason="handshake_failed"}'] == 1
        assert took < 20, took  # well within prefill's lease
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
        prefill.stop()
        assert decode.stop() == 0 and aggregated.stop() == 0


def _metric(router, name: str) -> float:  # noqa: ANN001 - a RouterProcess
    return sum(v for k, v in router.metrics().items() if k.startswith(name))


def test_redis_killed_and_restarted_under_load(llama_dir: Path, tmp_path: Path) -> None:
    """Redis down: routing falls back to load (counted), every request still answered; Redis back (empty):
    the engines rewrite their blocks into it and prefix hits return."""
    from tests.redis_server import RedisServer

    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    args = ("--redis-url", redis_server.url, "--num-kv-blocks", "256")
    engines = [start_in_process(llama_dir, *args) for _ in range(2)]
    router = start_router(llama_dir, tmp_path, [e.url for e in engines], redis_url=redis_server.url)
    prefix = list(range(3, 200))  # 12 full blocks
    try:
        with router.http() as http:

            def ask(tail: int) -> httpx.Response:
                body = {"model": MODEL, "prompt": prefix + [tail], "max_tokens": 2, "temperature": 0}
                answer = http.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                return answer

            def hits_return(tail: int) -> bool:
                before = _metric(router, "kvferry_router_prefix_hit_blocks_total")
                ask(tail)
                return _metric(router, "kvferry_router_prefix_hit_blocks_total") > before

            ask(0)
            assert _until(lambda: hits_return(1), 15), "no prefix hit before the outage"
            redis_server.stop()
            for tail in range(2, 12):
                ask(tail)  # every request answered while the index is gone
            assert _metric(router, "kvferry_router_fallbacks_total") >= 1
            redis_server.start()  # empty: the engines must write their blocks again
            assert _until(lambda: hits_return(20), 30), "prefix hits did not return after Redis came back"
    finally:
        router.stop()
        for e in engines:
            assert e.stop() == 0
        redis_server.stop()


def _until(check, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def test_a_router_replica_killed_leaves_the_other_undisturbed(llama_dir: Path, tmp_path: Path) -> None:
    """Two router replicas over one pool: kill -9 one during the other's streams; those finish, and the
    killed replica restarted on its port serves again."""
    engine = start_in_process(llama_dir, "--num-kv-blocks", "256")
    routers = [start_router(llama_dir, tmp_path, [engine.url]) for _ in range(2)]
    try:

        async def streams_while_killing() -> list[dict]:
            async with httpx.AsyncClient(base_url=routers[0].url, timeout=60) as client:
                started = asyncio.Event()
                prompts = [[3 + (i * 17 + j) % 390 for j in range(30 + i)] for i in range(4)]
                tasks = [asyncio.create_task(_stream(client, p, started)) for p in prompts]
                await asyncio.wait_for(started.wait(), 30)
                os.kill(routers[1].proc.pid, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 60)

        for r in asyncio.run(streams_while_killing()):
            assert r["done"] and r["error"] is None and r["chunks"] > 0, r
        port = int(routers[1].url.rsplit(":", 1)[1])
        routers[1] = start_router(llama_dir, tmp_path, [engine.url], port=port)
        with routers[1].http() as http:
            body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 3, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        for r in routers:
            r.stop()
        assert engine.stop() == 0
