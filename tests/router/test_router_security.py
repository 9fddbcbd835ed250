"""Router security: several client keys (tenants), per-tenant cache salts, the engine key, keys never logged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL, REPO
from tests.engine_harness import start_in_process
from tests.router.stack import start_router

KEYS = ("key-alpha-1234567", "key-beta-7654321")
ENGINE_KEY = "engine-secret-99887766"


def _cached(client: openai.OpenAI, prompt: list[int]) -> int:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


def test_tenants_never_share_kv_and_keys_stay_secret(llama_dir: Path, tmp_path: Path) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "256", "--api-key", ENGINE_KEY)
    (tmp_path / "keys").write_text(f"# one key per tenant\n{KEYS[0]}\n\n{KEYS[1]}\n")
    (tmp_path / "engine-key").write_text(ENGINE_KEY + "\n")
    router = start_router(
        llama_dir,
        tmp_path,
        [engine.url],
        "--api-key-file",
        str(tmp_path / "keys"),
        "--salt-from-api-key",
        "--engine-api-key-file",
        str(tmp_path / "engine-key"),
    )
    try:
        alpha, beta = (openai.OpenAI(base_url=f"{router.url}/v1", api_key=k, max_retries=0) for k in KEYS)
        prompt = list(range(3, 200))  # 197 tokens: 12 full blocks
        assert _cached(alpha, prompt) == 0
        assert _cached(alpha, prompt) >= 12 * 16  # alpha's own prefix
        assert _cached(beta, prompt) == 0  # the same prompt under another key: not alpha's blocks
        assert _cached(beta, prompt) >= 12 * 16
        for bad in ("key-alpha-1234568", ""):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{router.url}/v1", api_key=bad or "x", max_retries=0).models.list()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "my-own-salt"}
        answer = httpx.post(
            f"{router.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEYS[0]}"},
            timeout=30,
        )
        assert answer.status_code == 200 and "salt" not in answer.text and "tenant" not in answer.text
        direct = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30)
        assert direct.status_code == 401  # the engine takes requests with its key only (the router's)
    finally:
        router.stop()
        assert engine.stop() == 0
    logs = router.log_text() + engine.log_text()
    assert not any(k in logs for k in (*KEYS, ENGINE_KEY)), "an API key reached a log"


def test_salting_without_keys_is_refused(llama_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "router",
        "--tokenizer",
        str(llama_dir),
        "--model-name",
        MODEL,
    ]
    cmd += ["--engine", "http://127.0.0.1:9", "--salt-from-api-key"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--salt-from-api-key needs client keys" in done.stderr
