"""Media are decoded and preprocessed on a worker thread before the request enters the engine: while one
request's (slow) preprocessing runs, another request's stream keeps getting tokens, and neither the engine
thread nor the event loop's thread ran it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.checkpoints_idefics3 import build_idefics3
from tests.engine.entrypoints.helpers import MODEL
from tests.engine.test_idefics3_http import _chat, _image_url
from tests.engine_harness import start_in_process

PREPARE_S = 1.5  # how long the patched preprocessing takes


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-smolvlm-off-loop"), "smolvlm")


def test_slow_preprocessing_does_not_stall_other_streams(smolvlm_dir: Path) -> None:
    engine = start_in_process(smolvlm_dir, "--num-kv-blocks", "256")
    placeholders = engine.ctx.llm.engine.image_inputs.placeholders
    expand = placeholders.expand
    ran: list[tuple[str, float, float]] = []  # (thread, start, end)

    def slow_expand(token_ids: Any, media: Any) -> Any:
        if not media:  # a text-only prompt: nothing to preprocess
            return expand(token_ids, media)
        start = time.monotonic()
        time.sleep(PREPARE_S)  # a 4K video's decoding and resizing, say
        out = expand(token_ids, media)
        ran.append((threading.current_thread().name, start, time.monotonic()))
        return out

    placeholders.expand = slow_expand
    try:
        arrivals, status, loop_thread = asyncio.run(_scenario(engine.url))
    finally:
        engine.stop()
    assert status == 200 and len(ran) == 1
    thread, start, end = ran[0]
    assert thread not in ("kvferry-engine", loop_thread) and thread != "MainThread"
    during = [t for t in arrivals if start < t < end]
    assert len(during) >= 10, f"{len(during)} tokens of the other stream arrived in {PREPARE_S} s"


async def _scenario(url: str) -> tuple[list[float], int, str]:
    """A long text stream, and an image chat request sent once the stream is flowing."""
    arrivals: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def stream() -> None:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())

        task = asyncio.create_task(stream())
        while len(arrivals) < 3:
            await asyncio.sleep(0.01)
        image = {
            "model": MODEL,
            "messages": _chat("what is this?", [_image_url(1, (40, 56))]),
            "max_tokens": 2,
        }
        r = await client.post("/v1/chat/completions", json=image)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return arrivals, r.status_code, _server_thread_name(url)


def _server_thread_name(url: str) -> str:
    """The in-process server's thread (it runs the event loop): ``engine-<port>``."""
    return f"engine-{url.rsplit(':', 1)[1]}"
