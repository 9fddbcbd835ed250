"""``kvferry up`` with the tiny model: starts Redis, an engine and a router, serves, restarts a killed engine
(as its Deployment would) and keeps serving, stops cleanly on SIGINT.

It runs a quantized .gguf, as ``make run`` does with SmolLM2: the router reads the tokenizer rebuilt from
the GGUF's metadata.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import REPO
from tests.gguf_writer import write_gguf


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _kill_engine_and_see_it_serve_again(
    proc: subprocess.Popen, children: list[int], url: str | None, lines: list[str]
) -> None:
    """kill -9 the engine: ``kvferry up`` restarts it (same port, same log) and the router serves again."""
    engine = next(
        pid for pid in children if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    )
    os.kill(engine, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not lines[-1].strip().startswith("engine-0   restarted"):
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line and time.monotonic() < deadline, "".join(lines)
        lines.append(line)
    assert any("engine-0 exited with -9; restarting it in 1s" in line for line in lines), "".join(lines)
    deadline = time.monotonic() + 120
    while True:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=body)
        if answer.status_code == 200:
            break
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.5)
    assert proc.poll() is None  # only Redis, the kvstore or the router exiting stops the stack


def test_up_serves_and_stops_cleanly(llama_dir: Path, tmp_path: Path) -> None:
    gguf = write_gguf(llama_dir, tmp_path / "tiny.Q4.gguf")
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        str(gguf),
        "--engines",
        "1",
        "--port",
        "0",
        "--serve-args",
        "--num-kv-blocks 64",
        "--kv-offload-cpu-gb",
        "0.01",
        "--kv-offload-disk-gb",
        "0.02",
        "--log-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        url = None
        while not lines or "Press Ctrl-C" not in lines[-1]:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            if m := re.search(r"OpenAI API at (http://\S+)/v1", line):
                url = m.group(1)
        children = _children(proc.pid)
        assert len(children) == 4  # redis, kvstore, engine, router
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        _kill_engine_and_see_it_serve_again(proc, children, url, lines)
        children = _children(proc.pid)  # the restarted engine is a new child, stopped like the others
        assert len(children) == 4
        page = f"{url}/ui"
        page_status = httpx.get(page, timeout=10).status_code
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == 0, "".join(lines) + rest
    assert "router     stopped" in rest and "redis      stopped" in rest and "kvstore    stopped" in rest
    assert f"curl {url}/v1/chat/completions" in "".join(lines)
    assert f"pool page: {page}" in "".join(lines) and page_status == 200
    deadline = time.monotonic() + 5
    while _pids_alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pids_alive(children)
    secret = tmp_path / "pool-secret"  # one token per stack, readable by its owner only
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) >= 32
    assert "host KV tier" in (tmp_path / "engine-0.log").read_text()  # each engine its own disk tier folder
    assert (tmp_path / "engine-0" / "kv-offload").is_dir()
    for child in ("kvstore", "engine-0"):
        log = (tmp_path / f"{child}.log").read_text()
        assert "callers must present the pool secret" in log and secret.read_text().strip() not in log


def test_up_rejects_half_a_pd_pool(llama_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", str(llama_dir), "--prefill", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--prefill and --decode go together" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", str(llama_dir), "--kv-offload-disk-gb", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "set --kv-offload-cpu-gb too" in out.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--discovery kubernetes needs --selector"),
        (["--selector", "a=b", "--engine", "http://127.0.0.1:1"], "drop --engine"),
        (["--selector", "a=b"], "--kube-api"),  # not in a cluster: no $KUBERNETES_SERVICE_HOST
    ],
)
def test_router_kubernetes_discovery_flags_are_checked(
    extra: list[str], message: str, llama_dir: Path
) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "router",
            "--discovery",
            "kubernetes",
            "--tokenizer",
            str(llama_dir),
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"},
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
