"""Queue jumping: a non-zero ``priority`` is a 400 on an engine without --scheduling-policy priority, and the
router lets only the keys of --priority-api-key-file set it (403 for the others, before any engine sees it)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.router.stack import start_router

BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_an_fcfs_engine_refuses_a_priority_naming_the_field(llama_dir: Path) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "64")
    try:
        for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
            for priority in (-5, -(10**30)):
                r = httpx.post(f"{engine.url}{path}", json={**body, "priority": priority}, timeout=30)
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        assert httpx.post(f"{engine.url}/v1/completions", json={**BODY, "priority": 0}).status_code == 200
    finally:
        assert engine.stop() == 0


def test_only_priority_keys_may_set_a_priority_through_the_router(llama_dir: Path, tmp_path: Path) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "64", "--scheduling-policy", "priority")
    (tmp_path / "keys").write_text("tenant-low-1234\ntenant-vip-5678\n")
    (tmp_path / "vip").write_text("tenant-vip-5678\n")
    router = start_router(
        llama_dir,
        tmp_path,
        [engine.url],
        "--api-key-file",
        str(tmp_path / "keys"),
        "--priority-api-key-file",
        str(tmp_path / "vip"),
    )
    try:

        def post(key: str, path: str, body: dict) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.post(f"{router.url}{path}", json=body, headers=headers, timeout=30)

        for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
            jumped = post("tenant-low-1234", path, {**body, "priority": -(2**31)})
            assert jumped.status_code == 403 and jumped.json()["error"]["param"] == "priority", jumped.text
            assert post("tenant-low-1234", path, body).status_code == 200
            assert post("tenant-vip-5678", path, {**body, "priority": -3}).status_code == 200
    finally:
        router.stop()
        assert engine.stop() == 0
