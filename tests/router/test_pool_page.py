"""The pool page in a real headless Chromium: a 2-engine stack (engines in-process, Redis and the router real
processes), the page shows both engines, and requests sent while it is open appear in its decisions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.chromium import HeadlessChromium, chromium_or_skip
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.redis_server import RedisServer
from tests.router.stack import RouterProcess, start_router

HOSTILE_ID = '<img src=x onerror="window.__pwned=1">'


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    logs = tmp_path_factory.mktemp("pool-page")
    redis = RedisServer(logs)
    redis.start()
    engines: list[InProcessEngine] = []
    router = None
    try:
        args = ("--redis-url", redis.url, "--num-kv-blocks", "128", "--max-num-seqs", "4")
        engines = [start_in_process(llama_dir, *args) for _ in range(2)]
        router = start_router(llama_dir, logs, [e.url for e in engines], redis_url=redis.url)
        yield router
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()
        redis.stop()


@pytest.fixture
def page(stack: RouterProcess) -> Iterator[HeadlessChromium]:
    browser = chromium_or_skip(f"{stack.url}/ui")
    yield browser
    browser.close()


def _row(request_id: str) -> str:
    """JavaScript: the decision row of ``request_id`` (null until the page drew it)."""
    return f"document.querySelector('tr[data-request-id=' + CSS.escape({json.dumps(request_id)}) + ']')"


def test_the_page_shows_both_engines_and_a_live_request(
    stack: RouterProcess, page: HeadlessChromium, tmp_path: Path
) -> None:
    healthy = (
        "[...document.querySelectorAll('[data-engine][data-health=healthy]')].map(e => e.dataset.engine)"
    )
    engines = page.wait_for(f"(() => {{ const u = {healthy}; return u.length === 2 && u; }})()")
    assert len(set(engines)) == 2 and all(u.startswith("http://127.0.0.1:") for u in engines)
    assert page.evaluate("document.querySelectorAll('#decisions tr[data-request-id]').length") == 0

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a secret prompt the page must not show " * 8}],
        max_tokens=4,
        extra_headers={"X-Request-Id": "pool-page-1"},
    )
    served = raw.headers["x-kvferry-endpoint"]
    assert served in engines

    row = page.wait_for(f"(() => {{ const r = {_row('pool-page-1')}; return r && r.innerText; }})()")
    assert "chat" in row and "aggregated" in row
    chosen = page.evaluate(f"{_row('pool-page-1')}.querySelector('li.chosen').dataset.candidate")
    assert chosen == served  # the page names the engine that answered
    candidates = page.evaluate(
        f"[...{_row('pool-page-1')}.querySelectorAll('li[data-candidate]')].map(li => li.innerText)"
    )
    assert len(candidates) == 2 and all("prefix" in c and "queue" in c and "kv" in c for c in candidates)
    assert "secret prompt" not in page.evaluate("document.body.innerText")

    # The engine that served it gets a TTFT point in its sparkline at the router's next poll.
    ttft = f"document.querySelector('[data-engine={json.dumps(served)}] .spark-box b').innerText"
    assert page.wait_for(f"(() => {{ const t = {ttft}; return t !== '–' && t; }})()").endswith("ms")

    # ... and the index's blocks per tier: the prompt's blocks in its primary pool (gpu)
    held = f"document.querySelector('[data-engine={json.dumps(served)}] [data-tiers]')"
    assert "holds gpu" in page.wait_for(f"(() => {{ const t = {held}; return t && t.innerText; }})()")
    state = httpx.get(f"{stack.url}/ui/state", timeout=10).json()
    [row] = [e for e in state["engines"] if e["url"] == served]
    assert row["tier_blocks"]["gpu"] >= 1 and set(row["tier_blocks"]) <= {"gpu", "cpu", "kvstore", "disk"}

    shot = page.screenshot(tmp_path / "pool.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_request_ids_are_shown_as_text_never_as_html(stack: RouterProcess, page: HeadlessChromium) -> None:
    page.wait_for("document.querySelectorAll('[data-engine]').length === 2")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    client.completions.create(
        model=MODEL, prompt=list(range(3, 40)), max_tokens=2, extra_headers={"X-Request-Id": HOSTILE_ID}
    )
    text = page.wait_for(f"(() => {{ const r = {_row(HOSTILE_ID)}; return r && r.innerText; }})()")
    assert HOSTILE_ID in text
    assert page.evaluate("document.querySelectorAll('#decisions img').length") == 0
    assert page.evaluate("window.__pwned === undefined")


def test_with_api_keys_the_browser_logs_in_with_a_key(llama_dir: Path, tmp_path: Path) -> None:
    """The key as the Basic password (here in the URL; a person types it into the login prompt the 401's
    ``WWW-Authenticate: Basic`` opens): the page and its polls of /ui/state get in."""
    (tmp_path / "keys").write_text("ops-key-31337\n")
    dead = "http://127.0.0.1:9"  # no engine: the router serves the page anyway (its health is 503)
    router = start_router(
        llama_dir, tmp_path, [dead], "--api-key-file", str(tmp_path / "keys"), healthy=False
    )
    host = router.url.removeprefix("http://")
    try:
        with chromium_or_skip(f"http://ops:ops-key-31337@{host}/ui") as page:
            page.wait_for("document.getElementById('live')?.dataset.state === 'live'")
            assert page.evaluate("document.querySelector('[data-engine]').dataset.health") == "down"
    finally:
        router.stop()
