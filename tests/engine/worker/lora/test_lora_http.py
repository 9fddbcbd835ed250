"""LoRA over HTTP: adapters as models (``parent``), load / unload endpoints, 404 / 400 errors, the openai client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine.worker.lora.test_lora import ADAPTERS, PROMPTS, _write_adapter
from tests.engine_harness import start_in_process


@pytest.fixture(scope="module")
def two_adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-loras")
    return {n: _write_adapter(llama_dir, root / n, i, *ADAPTERS[n]) for i, n in enumerate(("a", "b"))}


def test_adapters_load_unload_and_serve_by_model_name(
    llama_dir: Path, two_adapters: dict, tmp_path: Path
) -> None:
    engine = start_in_process(
        llama_dir,
        "--num-kv-blocks",
        "128",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"a={two_adapters['a']}",
        "--allow-runtime-lora-updating",
    )
    try:
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="x")
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {MODEL, "a"} and models["a"].parent == MODEL
        greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        base = client.completions.create(model=MODEL, prompt=PROMPTS[1], **greedy).choices[0].text
        a = client.completions.create(model="a", prompt=PROMPTS[1], **greedy)
        assert a.model == "a" and a.choices[0].text != base
        with pytest.raises(openai.NotFoundError, match="b"):
            client.completions.create(model="b", prompt=PROMPTS[1], **greedy)
        http = httpx.Client(base_url=engine.url, timeout=30)
        loaded = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(two_adapters["b"])}
        )
        assert loaded.status_code == 200, loaded.text
        chat = client.chat.completions.create(
            model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["gate"]})
        )
        broken = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
        assert broken.status_code == 400 and "target_modules ['gate'] are not supported" in broken.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert gone.status_code == 404 and "'a' is not loaded" in gone.text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a", prompt=PROMPTS[1], **greedy)
        assert {m.id for m in client.models.list().data} == {MODEL, "b"}
        metrics = http.get("/metrics").text
        assert (
            'kvferry_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.0'
            in metrics
        )
        assert "kvferry_lora_loads_total 2.0" in metrics and "kvferry_lora_slots_used" in metrics
        assert 'kvferry_lora_requests_total{lora_name="a"} 1.0' in metrics
        assert 'kvferry_lora_requests_total{lora_name="b"} 1.0' in metrics
        assert client.completions.create(model=MODEL, prompt=PROMPTS[1], **greedy).choices[0].text == base
    finally:
        assert engine.stop() == 0


def test_runtime_updates_are_off_by_default(llama_dir: Path, two_adapters: dict) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "64", "--enable-lora")
    try:
        r = httpx.post(
            f"{engine.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(two_adapters["a"])}
        )
        assert r.status_code == 400 and "--allow-runtime-lora-updating" in r.text
    finally:
        assert engine.stop() == 0
