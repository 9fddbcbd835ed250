"""The router, kvstore and engine-cpu images as the operator's pods run them (UID 10001, read-only root,
emptyDir /tmp and /dev/shm, the model read-only): the official `openai` client gets a completion through
the router container from the engine container, which keeps its KV blocks in the kvstore container."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.common.pool.prom_text import scan_samples
from tests.engine.entrypoints.helpers import MODEL, free_port
from tests.images.containers import Container, Mount, pod_run, wait_until

pytestmark = pytest.mark.images

BLOCK = 16


def _health(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=2).status_code == 200


def _kvstore_calls(metrics_url: str) -> dict[str, float]:
    text = httpx.get(f"{metrics_url}/metrics", timeout=5).text
    return {
        s.labels["method"]: s.value
        for s in scan_samples(text, "kvferry_kvstore_rpc_duration_seconds_count".__eq__)
    }


@pytest.fixture(scope="module")
def stack(
    image: Callable[[str], str], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("stack")
    model = [Mount(model_dir, "/model")]
    store_port, store_metrics, engine_port, router_port = (free_port() for _ in range(4))
    started: list[Container] = []
    try:
        kvstore = pod_run(
            image("kvstore"),
            [
                "kvferry",
                "kvstore",
                "--port",
                str(store_port),
                "--metrics-port",
                str(store_metrics),
                "--capacity-gb",
                "0.2",
            ],
            logs / "kvstore.log",
        )
        started.append(kvstore)
        wait_until(lambda: _health(f"http://127.0.0.1:{store_metrics}"), kvstore, 60, "kvstore /health")
        engine = pod_run(
            image("engine-cpu"),
            [
                "kvferry",
                "serve",
                "/model",
                "--port",
                str(engine_port),
                "--served-model-name",
                MODEL,
                "--kvstore-url",
                f"grpc://127.0.0.1:{store_port}",
                "--block-size",
                str(BLOCK),
                "--num-kv-blocks",
                "256",
                "--max-model-len",
                "512",
                "--dtype",
                "float32",
            ],
            logs / "engine.log",
            model,
            env={"OMP_NUM_THREADS": "1"},
        )
        started.append(engine)
        wait_until(lambda: _health(f"http://127.0.0.1:{engine_port}"), engine, 300, "engine /health")
        router = pod_run(
            image("router"),
            [
                "kvferry",
                "router",
                "--port",
                str(router_port),
                "--tokenizer",
                "/model",
                "--model-name",
                MODEL,
                "--engine",
                f"http://127.0.0.1:{engine_port}",
                "--poll-interval",
                "0.5",
            ],
            logs / "router.log",
            model,
        )
        started.append(router)
        wait_until(lambda: _health(f"http://127.0.0.1:{router_port}"), router, 120, "router /health")
        yield {
            "router": f"http://127.0.0.1:{router_port}",
            "store_metrics": f"http://127.0.0.1:{store_metrics}",
            "engine_log": str(engine.log),
        }
    finally:
        for container in reversed(started):
            container.stop()


def test_openai_client_gets_a_completion_through_the_router_container(stack: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{stack['router']}/v1", api_key="unused", timeout=120)
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert completion.model == MODEL
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    full_blocks = completion.usage.prompt_tokens // BLOCK
    # the engine offloads the prompt's full blocks to the kvstore container (the shared tier)
    calls: dict[str, float] = {}
    for _ in range(40):
        calls = _kvstore_calls(stack["store_metrics"])
        if calls.get("Put", 0) > 0:
            break
        time.sleep(0.25)
    assert full_blocks > 0 and calls.get("Put", 0) > 0, calls
    log = Path(stack["engine_log"]).read_text(errors="replace")
    # the image's prebuilt C++ kernels load (no compiler in the image, a read-only root)
    assert "CPU kernels unavailable" not in log, log[-3000:]
