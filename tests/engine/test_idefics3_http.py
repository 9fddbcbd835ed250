"""SmolVLM over the OpenAI API: chat image_url and video_url parts through the official client equal offline
generation (directly and through the router, which expands and hashes the same ids); 400s naming the part
for bad images and videos, and the engine keeps serving."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from services.common.media.video_inputs import decode_video
from services.common.openai.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from tests.checkpoints_idefics3 import build_idefics3
from tests.engine.entrypoints.helpers import MODEL
from tests.engine.test_smolvlm_video import SAMPLING
from tests.engine_harness import start_in_process
from tests.router.stack import start_router
from tests.videos import clip_bytes, data_url


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-smolvlm-http"), "smolvlm")


def _image_url(seed: int, size: tuple[int, int]) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def _chat(text: str, images: list[str] = (), videos: list[str] = ()) -> list[dict]:  # type: ignore[assignment]
    parts = [{"type": "video_url", "video_url": {"url": u}} for u in videos]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _offline(folder: Path, content: str, media: dict) -> tuple[list[int], str]:
    ids = Tokenizer(folder).encode_chat([{"role": "user", "content": content}], True)
    out = LLM(model=str(folder), dtype="float32", num_kv_blocks=128).generate(
        {"prompt_token_ids": ids, "multi_modal_data": media},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    return out.prompt_token_ids, out.outputs[0].text


def test_images_and_video_through_engine_and_router_equal_offline(smolvlm_dir: Path, tmp_path: Path) -> None:
    engine = start_in_process(smolvlm_dir, "--num-kv-blocks", "128")
    (tmp_path / "logs").mkdir()
    router = start_router(smolvlm_dir, tmp_path / "logs", [engine.url])
    try:
        a, b, video = _image_url(1, (40, 56)), _image_url(2, (20, 100)), data_url(clip_bytes(45))
        want_img = _offline(
            smolvlm_dir, "<image>\n<image>\nwhat is this?", {"image": [_decode(a), _decode(b)]}
        )
        clip = decode_video(clip_bytes(45), SAMPLING)
        want_vid = _offline(smolvlm_dir, "<video>\nwhat happens?", {"video": clip})
        for server in (engine, router):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            for messages, (ids, text) in (
                (_chat("what is this?", [a, b]), want_img),
                (_chat("what happens?", videos=[video]), want_vid),
            ):
                got = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=6, temperature=0
                )
                assert got.choices[0].message.content == text
                assert got.usage.prompt_tokens == len(ids)
        again = openai.OpenAI(
            base_url=f"{router.url}/v1", api_key="x", max_retries=0
        ).chat.completions.create(
            model=MODEL, messages=_chat("what happens?", videos=[video]), max_tokens=6, temperature=0
        )
        assert again.usage.prompt_tokens_details.cached_tokens >= len(want_vid[0]) - 16  # the frames' blocks
    finally:
        router.stop()
        engine.stop()


def test_bad_media_are_400s_naming_the_part(smolvlm_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "clip.mp4").write_bytes(clip_bytes(20))
    args = (
        "--limit-mm-per-prompt",
        '{"image": 2, "video": 1}',
        "--allowed-local-media-path",
        str(tmp_path / "media"),
    )
    engine = start_in_process(smolvlm_dir, "--num-kv-blocks", "128", *args)
    images_only = start_in_process(build_idefics3(tmp_path / "idefics3", "idefics3"), "--num-kv-blocks", "64")
    try:
        clip = data_url(clip_bytes(20))
        cases = [
            (
                engine,
                [data_url(b"\x00\x00\x00\x18ftypmp42" + b"x" * 64)],
                "video 0: video_url: the video cannot be",
            ),
            (engine, [data_url(clip_bytes(20), "video/x-flv")], "video/x-flv is not supported"),
            (engine, ["data:video/mp4;base64,@@@"], "not valid base64"),
            (engine, [clip, clip], "2 videos is over this server's limit of 1"),
            (engine, ["https://example.com/a.mp4"], "fetching http(s) URLs is disabled"),
            (engine, [f"file://{tmp_path}/elsewhere.mp4"], "outside --allowed-local-media-path"),
            (
                engine,
                [data_url(clip_bytes(1, size=(3856, 2176), flat=True))],
                "frames are over 8294400 pixels",
            ),
            (images_only, [clip], "need a model that takes videos; this one does not"),
        ]
        for server, videos, message in cases:
            body = {"model": MODEL, "messages": _chat("x", videos=videos), "max_tokens": 2}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "messages"
        too_many = {
            "model": MODEL,
            "messages": _chat("x", [_image_url(i, (9, 9)) for i in range(3)]),
            "max_tokens": 2,
        }
        r = httpx.post(f"{engine.url}/v1/chat/completions", json=too_many, timeout=30)
        assert r.status_code == 400 and "3 images is over this server's limit of 2" in r.text
        local = f"file://{tmp_path}/media/clip.mp4"
        for server in (engine, images_only):
            body = {
                "model": MODEL,
                "messages": _chat("still here", videos=[local] if server is engine else []),
                "max_tokens": 2,
            }
            assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        engine.stop()
        images_only.stop()
