"""GPU check part 4: `kvferry serve` on the device answering the openai client: a sampled chat (temperature,
top-p, penalties), a json_schema response_format, n=2 with logprobs, and /v1/embeddings from a BERT."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_env import subprocess_env

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(model: Path, log: Path, args: list[str], timeout: float = 240.0) -> Any:
    """`kvferry serve MODEL ARGS` as a subprocess on a free port; yields its base URL."""
    import httpx

    port = _port()
    cmd = [sys.executable, "-m", "services.cli", "serve", str(model), "--port", str(port),
           "--served-model-name", "check", *args]  # fmt: skip
    with log.open("a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=subprocess_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvferry serve exited with {proc.returncode}: see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvferry serve not healthy after {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _chat_requests(url: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "hello kvferry"}]
    sampled = client.chat.completions.create(model="check", messages=msgs, temperature=0.8, top_p=0.9,
                                             presence_penalty=0.5, frequency_penalty=0.3, max_tokens=16)  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    constrained = client.chat.completions.create(model="check", messages=msgs, temperature=1.0,
                                                 response_format=fmt, max_tokens=40)  # type: ignore[call-overload]  # fmt: skip
    city = json.loads(constrained.choices[0].message.content or "")
    two = client.chat.completions.create(model="check", messages=msgs, n=2, logprobs=True, top_logprobs=3,
                                         temperature=1.0, max_tokens=8)  # fmt: skip
    assert len(two.choices) == 2 and all(c.logprobs and c.logprobs.content for c in two.choices)
    assert city["city"] in ("Paris", "Oslo"), city
    return {"sampled_tokens": sampled.usage.completion_tokens if sampled.usage else None,
            "json_schema": city, "n2_logprobs": [len(c.logprobs.content or []) for c in two.choices if c.logprobs]}  # fmt: skip


def _embeddings(url: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    got = client.embeddings.create(model="check", input=["hello", "kvferry on a gpu"])
    dims = [len(d.embedding) for d in got.data]
    assert len(dims) == 2 and dims[0] > 0
    return {"embeddings": len(dims), "dims": dims[0]}


def _bert(out: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from tests.checkpoints import build_tokenizer

    folder = out / "model-bert"
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)  # fmt: skip
    BertModel(cfg).save_pretrained(str(folder))
    return folder


def serve_check(out: Path, smoke: bool) -> dict:
    from tests.checkpoints import build_checkpoint

    llama = build_checkpoint(out / "model-llama-tiny", "llama")
    device = ["--device", "cpu"] if smoke else ["--device", "cuda", "--dtype", "bfloat16"]
    log = out / "serve.log"
    result: dict = {"ok": False}
    with server(llama, log, [*device, "--num-kv-blocks", "128"]) as url:
        result["chat"] = _chat_requests(url)
    with server(_bert(out), log, [*device, "--task", "embed"]) as url:
        result["embeddings"] = _embeddings(url)
    result["ok"] = True
    return result
