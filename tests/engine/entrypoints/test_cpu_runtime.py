"""The engine process's CPU runtime: Intel OpenMP + tcmalloc where installed, explicit settings win, opt-out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.engine import cpu_runtime


def test_intel_openmp_when_installed_else_passive_gnu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_runtime, "_iomp", lambda: "/x/libiomp5.so")
    monkeypatch.setattr(cpu_runtime, "_tcmalloc", lambda: "/y/libtcmalloc_minimal.so.4")
    rt = cpu_runtime.choose({})
    assert rt.preload == ("/x/libiomp5.so", "/y/libtcmalloc_minimal.so.4") and rt.env == {
        "KMP_BLOCKTIME": "1"
    }
    assert cpu_runtime.choose({"KMP_BLOCKTIME": "5"}).env == {"KMP_BLOCKTIME": "5"}  # the user's value wins
    gnu = cpu_runtime.choose({"KVFERRY_CPU_RUNTIME": "gnu"})
    assert gnu.preload == ("/y/libtcmalloc_minimal.so.4",) and gnu.env == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setattr(cpu_runtime, "_iomp", lambda: None)
    monkeypatch.setattr(cpu_runtime, "_tcmalloc", lambda: None)
    bare = cpu_runtime.choose({"OMP_WAIT_POLICY": "ACTIVE"})
    assert bare.preload == () and bare.env == {"OMP_WAIT_POLICY": "ACTIVE"} and "GNU" in bare.description


def test_exec_replaces_the_process_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(cpu_runtime.os, "execve", lambda exe, args, env: calls.append((args, env)))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh `kvferry serve`
    cpu_runtime.exec_with_runtime(["serve", "--port", "1"], {"LD_PRELOAD": "/z.so"})
    ((args, env),) = calls
    assert args[1:] == ["-m", "services.cli", "serve", "--port", "1"]
    assert env[cpu_runtime.MARKER] == cpu_runtime.choose({}).description
    assert env["LD_PRELOAD"].endswith("/z.so")  # the caller's preload is kept, after ours
    cpu_runtime.exec_with_runtime(["serve"], env)  # the re-executed process does not do it again
    assert len(calls) == 1


def test_a_real_server_runs_with_it(server) -> None:  # noqa: ANN001 - the shared kvferry serve fixture
    expected = cpu_runtime.choose({"OMP_WAIT_POLICY": "PASSIVE"})
    assert f"CPU runtime: {expected.description}" in server.log_text()
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    for lib in expected.preload:
        assert lib in maps, f"{lib} is not mapped in the serve process"
