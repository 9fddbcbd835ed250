"""The pool secret on the side channels: prefill's /kv/handshake (real HTTP) and the kvstore (real gRPC)
refuse a missing or wrong secret (401 / UNAUTHENTICATED), serve the right one, and P/D through the router
with the kvstore still answers the aggregated tokens with secrets on. The secret is never logged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli import build_parser
from services.cli import main as kvferry
from services.common.kv.kv_transfer import HANDSHAKE_PATH
from services.common.kv.kvstore_client import KVStoreClient, KVStoreUnavailable
from services.common.pool.pool_secret import POOL_SECRET_HEADER, read_pool_secret
from services.engine.entrypoints.cli import ServeError, build
from services.serve_cli import ROLE_FACTORIES
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process
from tests.kvstore_server import kvstore_process
from tests.router.stack import start_router

SECRET = "s3cr3t-pool-token-0123456789abcdef"
COMMON = ("--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "512")


def _secret_file(folder: Path, token: str = SECRET, name: str = "pool-secret") -> Path:
    path = folder / name
    path.write_text(token + "\n")
    return path


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("secrets")
    _secret_file(folder)
    _secret_file(folder, "wrong-token-of-enough-length-000", "wrong")
    return folder


@pytest.fixture(scope="module")
def store(secrets_dir: Path) -> Iterator[str]:
    with kvstore_process("--pool-secret-file", str(secrets_dir / "pool-secret")) as running:
        yield running.target


@pytest.fixture(scope="module")
def prefill(llama_dir: Path, secrets_dir: Path, store: str) -> Iterator[InProcessEngine]:
    engine = start_in_process(
        llama_dir,
        "--role",
        "prefill",
        "--kv-lease",
        "10",
        "--kvstore-url",
        f"grpc://{store}",
        "--pool-secret-file",
        str(secrets_dir / "pool-secret"),
        *COMMON,
    )
    yield engine
    assert engine.stop() == 0


def test_secret_files_that_cannot_be_used_are_clear_errors(tmp_path: Path) -> None:
    assert read_pool_secret(None) is None
    assert read_pool_secret(_secret_file(tmp_path)).get_secret_value() == SECRET
    problems = {
        "missing": (tmp_path / "nope", "cannot read"),
        "short": (_secret_file(tmp_path, "short", "short"), "at least 16 characters"),
        "two": (_secret_file(tmp_path, "one-token-long-enough two", "two"), "one token"),
    }
    for path, words in problems.values():
        with pytest.raises(ValueError, match=words) as caught:
            read_pool_secret(path)
        assert "--pool-secret-file" in str(caught.value) and "long-enough" not in str(caught.value)
    argv = ["serve", str(tmp_path), "--pool-secret-file", str(tmp_path / "nope")]
    with pytest.raises(ServeError) as refused:
        build(build_parser(argv).parse_args(argv), ROLE_FACTORIES)
    assert refused.value.code == 2 and "--pool-secret-file" in str(refused.value)
    assert kvferry(["kvstore", "--port", "0", "--pool-secret-file", str(problems["short"][0])]) == 2


def test_the_kvstore_refuses_calls_without_the_secret(store: str, secrets_dir: Path) -> None:
    wrong = read_pool_secret(secrets_dir / "wrong")
    for secret in (None, wrong):
        with KVStoreClient(store, pool_secret=secret, timeout_s=5) as client:
            calls = {
                "stats": client.stats,
                "exists": lambda c=client: c.exists([b"h" * 32]),
                "put": lambda c=client: c.put([(b"h" * 32, [1] * 16, b"x" * 64)]),  # client-streamed
                "get": lambda c=client: c.get([(b"h" * 32, [1] * 16)]),  # server-streamed
            }
            for name, call in calls.items():
                with pytest.raises(KVStoreUnavailable, match="UNAUTHENTICATED") as caught:
                    call()
                assert SECRET not in str(caught.value), name
    with KVStoreClient(store, pool_secret=read_pool_secret(secrets_dir / "pool-secret")) as client:
        assert client.put([(b"k" * 32, [1] * 16, b"x" * 64)]).stored == 1
        assert client.get([(b"k" * 32, [1] * 16)]) == [b"x" * 64]
        assert client.stats().num_blocks >= 1


def test_the_handshake_needs_the_secret_and_other_routes_do_not(
    prefill: InProcessEngine, secrets_dir: Path
) -> None:
    url = prefill.url + HANDSHAKE_PATH
    for headers in ({}, {POOL_SECRET_HEADER: "wrong-token-of-enough-length-000"}, {POOL_SECRET_HEADER: ""}):
        refused = httpx.get(url, headers=headers, timeout=10)
        assert refused.status_code == 401, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_pool_secret" and POOL_SECRET_HEADER in error["message"]
    served = httpx.get(url, headers={POOL_SECRET_HEADER: SECRET}, timeout=10)
    assert served.status_code == 200 and served.json()["engine_id"]
    assert httpx.get(f"{prefill.url}/health", timeout=10).status_code == 200  # probes need no secret
    assert httpx.get(f"{prefill.url}/v1/models", timeout=10).status_code == 200  # the API has its own keys
    assert SECRET not in prefill.log_text()
    answers = httpx.get(f"{prefill.url}/openapi.json", timeout=10).json()["paths"][HANDSHAKE_PATH]["get"]
    assert {"200", "401", "404"} <= set(answers["responses"])  # the schema says what the route answers


def _completion(url: str, prompt: list[int], max_tokens: int = 10) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def _failures(engine: InProcessEngine) -> dict[str, float]:
    return {k: v for k, v in engine.metrics().items() if k.startswith("kvferry_kv_transfer_failures") and v}


def test_pd_through_the_router_with_secrets_gives_the_aggregated_tokens(
    llama_dir: Path, secrets_dir: Path, store: str, prefill: InProcessEngine, tmp_path: Path
) -> None:
    secret = ("--pool-secret-file", str(secrets_dir / "pool-secret"))
    decode = start_in_process(
        llama_dir, "--role", "decode", "--kvstore-url", f"grpc://{store}", *secret, *COMMON
    )
    aggregated = start_in_process(llama_dir, *COMMON)
    router = start_router(
        llama_dir, tmp_path, [], "--prefill", prefill.url, "--decode", decode.url, "--pd-threshold", "0"
    )
    try:
        for n in (40, 97, 160):
            prompt = [3 + (7 * i + n) % 390 for i in range(n)]
            assert _completion(router.url, prompt) == _completion(aggregated.url, prompt)
        received = decode.metrics()['kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}']
        assert received > 0  # KV went prefill -> decode over NIXL after an authenticated handshake
        assert _failures(decode) == {} and _failures(prefill) == {}  # kvstore offloads were accepted too
        logs = prefill.log_text() + decode.log_text() + router.log_text()
        assert SECRET not in logs and "callers must present the pool secret" in logs
    finally:
        router.stop()
        assert decode.stop() == 0 and aggregated.stop() == 0


def test_a_decode_with_the_wrong_secret_recomputes(
    llama_dir: Path, secrets_dir: Path, store: str, prefill: InProcessEngine
) -> None:
    decode = start_in_process(
        llama_dir, "--role", "decode", "--pool-secret-file", str(secrets_dir / "wrong"), *COMMON
    )
    try:
        prompt = list(range(5, 105))
        first = httpx.post(
            f"{prefill.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
            timeout=60,
        ).json()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        body["kv_transfer_params"] = first["kv_transfer_params"]
        answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == _completion(prefill.url, prompt)
        assert _failures(decode) == {'kvferry_kv_transfer_failures_total{reason="handshake_failed"}': 1.0}
        assert "401" in decode.log_text() and "wrong-token-of-enough-length-000" not in decode.log_text()
    finally:
        assert decode.stop() == 0
