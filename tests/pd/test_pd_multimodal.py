"""Disaggregated prefill/decode with images and a video (SmolVLM, NIXL between in-process engines): prefill
runs the vision encoder, decode receives the KV only and never runs it (no encoder call, no encoder-cache
query), and the tokens equal the aggregated engine's; also through the router's P/D flow with the openai
client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.common.openai.tokenizer import Tokenizer
from tests.checkpoints_idefics3 import build_idefics3
from tests.engine.entrypoints.helpers import MODEL, EngineEndpoint
from tests.engine.test_idefics3_http import _image_url
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import start_router
from tests.videos import clip_bytes, data_url


@pytest.fixture(scope="module")
def smolvlm_pd(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, tuple[InProcessEngine, ...]]]:
    folder = build_idefics3(tmp_path_factory.mktemp("tiny-smolvlm-pd"), "smolvlm")
    common = ("--block-size", "16", "--num-kv-blocks", "256")
    servers = (
        start_in_process(folder, "--role", "prefill", "--kv-lease", "20", *common),
        start_in_process(folder, "--role", "decode", *common),
        start_in_process(folder, *common),
    )
    yield folder, servers
    for s in servers:
        s.stop()


def _request(folder: Path, content: str, images: list[str], videos: list[str]) -> tuple[list[int], dict]:
    ids = Tokenizer(folder).encode_chat([{"role": "user", "content": content}], True)
    return ids, {"image": images, "video": videos}


def _complete(
    server: EngineEndpoint, ids: list[int], media: dict, kv: dict | None = None, n: int = 8
) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body |= {"multi_modal_data": media} | ({"kv_transfer_params": kv} if kv is not None else {})
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _encoder_work(server: InProcessEngine) -> tuple[int, int]:
    """(vision tower calls, encoder-cache queries) of an in-process engine since it started."""
    core = server.ctx.llm.engine.core
    assert core.scheduler.encoder is not None
    return core.worker_stats().encoder_calls, core.scheduler.encoder.queries


def test_decode_never_runs_the_encoder_and_equals_aggregated(smolvlm_pd) -> None:
    folder, (prefill, decode, aggregated) = smolvlm_pd
    cases = [
        _request(folder, "<image>\nwhat is this?", [_image_url(1, (40, 56))], []),
        _request(folder, "<image>\n<image>\ncompare them", [_image_url(2, (90, 30)), _image_url(3, (20, 20))], []),
        _request(folder, "<video>\nwhat happens?", [], [data_url(clip_bytes(30))]),
    ]  # fmt: skip
    for ids, media in cases:
        first = _complete(prefill, ids, media, {"do_remote_decode": True}, n=1)
        params = first["kv_transfer_params"]
        assert params is not None and params["do_remote_prefill"] and len(params["remote_block_ids"]) > 4
        out = _complete(decode, ids, media, params)
        ref = _complete(aggregated, ids, media)
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(params["remote_block_ids"]) * 16
    assert _encoder_work(decode) == (0, 0)
    assert _encoder_work(prefill)[0] >= 3 and _encoder_work(aggregated)[0] >= 3
    m = decode.metrics()
    assert m['kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'] > 0
    assert m["kvferry_mm_cache_queries_total"] == 0
    assert not any(k.startswith("kvferry_kv_transfer_failures_total") and v for k, v in m.items())


def test_router_pd_flow_with_media_equals_aggregated(smolvlm_pd, tmp_path: Path) -> None:
    folder, (prefill, decode, aggregated) = smolvlm_pd
    pd = ("--prefill", prefill.url, "--decode", decode.url, "--pd-threshold", "0")
    router = start_router(folder, tmp_path, [], *pd)
    received = 'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'
    before, encoded = decode.metrics()[received], _encoder_work(prefill)[0]
    try:
        for parts in (
            [{"type": "image_url", "image_url": {"url": _image_url(7, (64, 40))}}],
            [{"type": "video_url", "video_url": {"url": data_url(clip_bytes(25, seed=4))}}],
        ):
            messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what is it?"}]}]
            answers = [
                openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0).chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=6, temperature=0
                )
                for s in (router, aggregated)
            ]
            assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    finally:
        router.stop()
    assert decode.metrics()[received] > before and _encoder_work(prefill)[0] >= encoded + 2
    assert _encoder_work(decode) == (0, 0)
