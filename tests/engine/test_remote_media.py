"""http(s) image_url / video_url parts (--allow-remote-media) against a real HTTP server on 127.0.0.1: the
same answer as the data: URL of the same bytes, through the engine and through the router (which fetches
once and hands the engine a data: URL); a slow server, an oversized body (declared or streamed), a 404 and
a non-http scheme are 400s naming the part, too many images are refused before any fetch; the engine keeps
serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.checkpoints_idefics3 import build_idefics3
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.media_server import MediaServer
from tests.router.stack import start_router
from tests.videos import clip_bytes

LIMIT = 300_000
FLAGS = ("--allow-remote-media", "--media-fetch-timeout", "1", "--media-fetch-max-bytes", str(LIMIT))


def _flags(media: MediaServer) -> tuple[str, ...]:
    """FLAGS, with the test's media server (on 127.0.0.1: private) allowed as a mirror."""
    return (*FLAGS, "--media-allow-private-host", media.url.removeprefix("http://"))


def _png(seed: int, size: tuple[int, int]) -> bytes:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-smolvlm-remote"), "smolvlm")


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    server = MediaServer(
        {
            "/cat.png": ("image/png", _png(1, (40, 56))),
            "/clip.mp4": ("application/octet-stream", clip_bytes(30)),  # the type is guessed from the path
            "/big.png": ("image/png", b"\x89PNG" + b"\x00" * LIMIT),
        },
        slow_s=5.0,
    )
    yield server
    server.close()


def _chat(text: str, images: list[str] = (), videos: list[str] = ()) -> list[dict]:  # type: ignore[assignment]
    parts = [{"type": "video_url", "video_url": {"url": u}} for u in videos]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _data(kind: str, body: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(body).decode()}"


def test_remote_media_equal_inline_through_engine_and_router(
    smolvlm_dir: Path, media: MediaServer, tmp_path: Path
) -> None:
    engine = start_in_process(smolvlm_dir, "--num-kv-blocks", "128", *_flags(media))
    router = start_router(smolvlm_dir, tmp_path, [engine.url], *_flags(media))
    cases = [
        (_chat("what is this?", [f"{media.url}/cat.png"]), _chat("what is this?", [_data("image/png", _png(1, (40, 56)))])),
        (_chat("and this?", [f"{media.url}/redirect/cat.png"]), _chat("and this?", [_data("image/png", _png(1, (40, 56)))])),
        (_chat("what happens?", videos=[f"{media.url}/clip.mp4"]), _chat("what happens?", videos=[_data("video/mp4", clip_bytes(30))])),
    ]  # fmt: skip
    try:
        for server in (engine, router):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            for remote, inline in cases:
                got, want = (
                    client.chat.completions.create(model=MODEL, messages=m, max_tokens=5, temperature=0)
                    for m in (remote, inline)
                )
                assert got.choices[0].message.content == want.choices[0].message.content
                assert got.usage.prompt_tokens == want.usage.prompt_tokens > 50
        before = len(media.requests)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=cases[0][0], max_tokens=2)
        assert media.requests[before:] == ["/cat.png"]  # the router fetched it; the engine got a data: URL
    finally:
        router.stop()
        engine.stop()


def test_fetch_failures_are_400s_naming_the_part(
    smolvlm_dir: Path, media: MediaServer, tmp_path: Path
) -> None:
    engine = start_in_process(smolvlm_dir, "--num-kv-blocks", "64", *_flags(media))
    router = start_router(smolvlm_dir, tmp_path, [engine.url], *_flags(media))
    cases = [
        ([f"{media.url}/slow/cat.png"], [], "image 0: image_url: fetching it took longer than 1 s"),
        ([f"{media.url}/endless"], [], f"image 0: image_url: the image is over this server's limit of {LIMIT}"),
        ([f"{media.url}/big.png"], [], f"the image is over this server's limit of {LIMIT} bytes"),
        ([f"{media.url}/cat.png", f"{media.url}/gone.png"], [], "image 1: image_url: fetching it failed (no image at that URL)"),
        ([], [f"{media.url}/slow/clip.mp4"], "video 0: video_url: fetching it took longer than 1 s"),
        (["ftp://127.0.0.1/cat.png"], [], "image 0: image_url: the URL must be a data: URL"),
    ]  # fmt: skip
    try:
        for server in (engine, router):
            for images, videos, message in cases:
                body = {"model": MODEL, "messages": _chat("x", images, videos), "max_tokens": 2}
                r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert message in error["message"] and error["param"] == "messages", (server.url, r.text)
            before, many = len(media.requests), [f"{media.url}/cat.png"] * 5  # over the default limit of 4
            body = {"model": MODEL, "messages": _chat("x", many), "max_tokens": 2}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400 and "5 images is over this server's limit of 4" in r.text
            assert len(media.requests) == before  # refused before anything was fetched
            ok = {"model": MODEL, "messages": _chat("still here", [f"{media.url}/cat.png"]), "max_tokens": 2}
            assert httpx.post(f"{server.url}/v1/chat/completions", json=ok, timeout=30).status_code == 200
    finally:
        router.stop()
        engine.stop()
