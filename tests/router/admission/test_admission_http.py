"""Admission through a real ``kvferry router`` (tenants file, flow control) in front of a real engine: with no
engine in rotation requests are held (a sheddable one 429s at its TTL with Retry-After, a client that leaves
is out of the queue), and a held critical request is served once the engine appears (scale from zero)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import RouterProcess, start_router
from tests.router.tcp_proxy import TcpProxy

GOLD, BULK, ADMIN = "gold-key-123456", "bulk-key-123456", "admin-key-123456"


class ProxyThread:
    """A TcpProxy on its own event loop thread (closed until ``open``)."""

    def __init__(self, target_port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = TcpProxy(target_port)

    def open(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(5)

    def close(self) -> None:
        if self.proxy._server is not None:
            asyncio.run_coroutine_threadsafe(self.proxy.cut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def write_tenants(path: Path, tenants: list[dict]) -> Path:
    path.write_text(json.dumps({"tenants": tenants}))
    return path


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Iterator[InProcessEngine]:
    server = start_in_process(llama_dir, "--num-kv-blocks", "64", "--max-num-seqs", "4")
    yield server
    server.stop()


def _wait_for(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_requests_are_held_while_no_engine_is_ready_then_served(
    engine: InProcessEngine, llama_dir: Path, tmp_path: Path
) -> None:
    proxy = ProxyThread(int(engine.url.rsplit(":", 1)[1]))
    tenants = write_tenants(
        tmp_path / "tenants.json",
        [
            {"name": "gold", "apiKey": GOLD, "band": "critical"},
            {"name": "bulk", "apiKey": BULK, "band": "sheddable"},
        ],
    )
    admin = tmp_path / "admin-keys"
    admin.write_text(ADMIN + "\n")
    router = start_router(
        llama_dir,
        tmp_path,
        [proxy.proxy.url],
        "--tenants-file",
        str(tenants),
        "--admin-api-key-file",
        str(admin),
        "--queue-ttl",
        "sheddable=0.6,critical=60",
        "--poll-interval",
        "0.2",
        healthy=False,
    )
    try:
        _held_request_times_out_with_retry_after(router)
        _client_that_leaves_is_dequeued(router)
        _held_critical_request_is_served_when_the_engine_appears(router, proxy)
    finally:
        router.stop()
        proxy.close()


def _held_request_times_out_with_retry_after(router: RouterProcess) -> None:
    jump = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": -100},
        headers={"Authorization": f"Bearer {BULK}"},
        timeout=10,
    )  # a band is the tenant's: `priority` stays refused for keys outside --priority-api-key-file
    assert jump.status_code == 403 and jump.json()["error"]["param"] == "priority", jump.text
    t0 = time.monotonic()
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {BULK}"},
        timeout=10,
    )
    assert r.status_code == 429, r.text
    assert 0.5 < time.monotonic() - t0 < 5
    assert r.json()["error"]["code"] == "queue_ttl" and int(r.headers["retry-after"]) >= 1
    assert router.metrics()['kvferry_router_admission_total{outcome="rejected",reason="queue_ttl"}'] == 1


def _client_that_leaves_is_dequeued(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=GOLD, max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    key = 'kvferry_router_admission_total{outcome="rejected",reason="client_gone"}'
    _wait_for(lambda: router.metrics()[key] == 1, 5)  # long before gold's 60 s TTL
    assert router.metrics()['kvferry_router_queue_length{band="critical",tenant="gold"}'] == 0


def _held_critical_request_is_served_when_the_engine_appears(
    router: RouterProcess, proxy: ProxyThread
) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=GOLD, max_retries=0, timeout=60)
    answers: list[object] = []
    worker = threading.Thread(
        target=lambda: answers.append(client.completions.create(model=MODEL, prompt="hello", max_tokens=3))
    )
    worker.start()
    _wait_for(lambda: router.metrics()["kvferry_router_held_requests"] == 1)
    assert not answers
    for key, rows in ((ADMIN, [{"band": "critical", "tenant": "gold", "waiting": 1}]), (GOLD, [])):
        page = httpx.get(
            f"{router.url}/ui/state", headers={"Authorization": f"Bearer {key}"}, timeout=10
        ).json()
        queue = page["queue"]  # the pool page shows the queue; tenants' rows to an admin key only
        assert queue["held"] == 1 and queue["full"] == "no engine in rotation" and queue["rows"] == rows
    proxy.open()  # the engine becomes ready: the poller sees it, the held request goes
    worker.join(30)
    assert len(answers) == 1 and answers[0].choices[0].text is not None  # type: ignore[attr-defined]
    assert router.metrics()["kvferry_router_held_requests"] == 0
