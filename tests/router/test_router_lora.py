"""LoRA through the router: adapters as models, routed only to engines that serve them, hashed as their own."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from services.common.kv.hashing import BlockHasher
from services.common.openai.protocol import CompletionRequest
from services.common.openai.tokenizer import Tokenizer
from services.router.prompt import PromptPreparer
from tests.engine.entrypoints.helpers import MODEL
from tests.engine.worker.lora.test_lora import ADAPTERS, _write_adapter
from tests.engine_harness import start_in_process
from tests.router.stack import start_router


def test_adapter_blocks_hash_apart_from_the_base_models(llama_dir: Path) -> None:
    preparer = PromptPreparer(Tokenizer(llama_dir), BlockHasher(MODEL, 16))
    body = CompletionRequest(model="a", prompt=list(range(3, 40)), max_tokens=2)
    base, lora = preparer.completion(body), preparer.completion(body, "a")
    assert len(base.block_hashes) == len(lora.block_hashes) == 2
    assert not set(base.block_hashes) & set(lora.block_hashes)  # the index never credits base blocks
    assert lora.engine_body["model"] == "a" and "model" not in base.engine_body


def test_adapter_requests_go_to_the_engines_that_serve_it(llama_dir: Path, tmp_path: Path) -> None:
    adapter = _write_adapter(llama_dir, tmp_path / "a", 0, *ADAPTERS["a"])
    plain = start_in_process(
        llama_dir, "--num-kv-blocks", "64", "--enable-lora", "--allow-runtime-lora-updating"
    )
    with_a = start_in_process(
        llama_dir, "--num-kv-blocks", "64", "--enable-lora", "--lora-modules", f"a={adapter}"
    )
    (tmp_path / "logs").mkdir()
    router = start_router(llama_dir, tmp_path / "logs", [plain.url, with_a.url])
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        models = {m.id: m.parent for m in client.models.list().data}
        assert models == {MODEL: None, "a": MODEL}
        for _ in range(4):
            r = httpx.post(
                f"{router.url}/v1/completions", json={"model": "a", "prompt": [5, 6, 7], "max_tokens": 2}
            )
            assert r.status_code == 200 and r.headers["X-Kvferry-Endpoint"] == with_a.url
            assert r.json()["model"] == "a"  # as OpenAI and vLLM echo the requested model
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="zz", prompt=[5, 6], max_tokens=2)
        loaded = httpx.post(
            f"{plain.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)}
        )
        assert loaded.status_code == 200
        seen: set[str] = set()
        deadline = time.monotonic() + 20
        while len(seen) < 2 and time.monotonic() < deadline:  # the router re-reads LoRA engines' cards
            r = httpx.post(
                f"{router.url}/v1/completions", json={"model": "a", "prompt": [9, 9], "max_tokens": 1}
            )
            seen.add(r.headers["X-Kvferry-Endpoint"])
            time.sleep(0.1)
        assert seen == {plain.url, with_a.url}
    finally:
        router.stop()
        plain.stop()
        with_a.stop()
