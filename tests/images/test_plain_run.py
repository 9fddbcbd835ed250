"""Each serving image also starts as a plain `buildah run` does: no volume but the model's, UID 10001."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, free_port
from tests.images.containers import Mount, buildah_run, started, wait_until

pytestmark = pytest.mark.images


def _argv(component: str, port: int, metrics_port: int) -> list[str]:
    if component == "kvstore":
        return [
            "kvferry",
            "kvstore",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--capacity-gb",
            "0.05",
        ]
    if component == "router":
        return [
            "kvferry",
            "router",
            "--port",
            str(port),
            "--tokenizer",
            "/model",
            "--model-name",
            MODEL,
            "--engine",
            "http://127.0.0.1:9",
        ]
    return [
        "kvferry",
        "serve",
        "/model",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
    ]


@pytest.mark.parametrize("component", ["kvstore", "router", "engine-cpu"])
def test_serving_image_starts_with_only_the_model_mounted(
    component: str, image: Callable[[str], str], model_dir: Path, tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    health = f"http://127.0.0.1:{metrics_port if component == 'kvstore' else port}/health"
    container = buildah_run(
        image(component),
        _argv(component, port, metrics_port),
        tmp_path / "run.log",
        [Mount(model_dir, "/model")],
    )
    with started(container):
        # the router answers /health 503 while its only engine is unreachable: it is up all the same
        wait_until(lambda: httpx.get(health, timeout=2).status_code in (200, 503), container, 300, health)
