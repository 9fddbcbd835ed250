"""CpuRuntime: the OpenMP runtime, wait policy and allocator an engine process starts with (before torch loads).

Measured on this 2-core machine (decode step of SmolLM2 bf16 batch 1 / a 12-layer h768 Llama bf16
batch 64; idle, then beside a process spinning on one core):

| runtime | idle ms | beside a busy process ms |
|---|---|---|
| GNU OpenMP, OMP_WAIT_POLICY=PASSIVE | 37 / 36 | 37 / 46 |
| GNU OpenMP, OMP_WAIT_POLICY=ACTIVE | 20 / 25 | 47 / 56 |
| GNU OpenMP, bounded spin (GOMP_SPINCOUNT 3e3..1e6) | 20-28 / 25-32 | 46-200 / 53-190 |
| Intel OpenMP, KMP_BLOCKTIME=1 ms, + tcmalloc | **20 / 26** | **40 / 49** |

Passive waits pay a futex wake per parallel region (hundreds per step); spinning starves a shared core.
Intel OpenMP spins 1 ms, then sleeps: nearly the idle speed of spinning and nearly the contended
speed of passive waits, so it is the default wherever its library is installed (PyPI ``intel-openmp``,
part of ``kvferry[engine]`` on x86-64), with tcmalloc when Debian's ``libtcmalloc-minimal4`` is there.
``kvferry serve`` re-executes itself once with them preloaded; ``KVFERRY_CPU_RUNTIME=gnu`` opts out.
Thread pinning (OMP_PROC_BIND) measured worse beside a busy process (56 / 68 ms) and is not set.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

MARKER = "KVFERRY_CPU_RUNTIME_APPLIED"  # set in the re-executed process
CHOICE = "KVFERRY_CPU_RUNTIME"  # "auto" (default) or "gnu"
_TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


@dataclass(frozen=True)
class CpuRuntime:
    """What the engine process should run with: libraries to preload and OpenMP variables."""

    preload: tuple[str, ...]
    env: Mapping[str, str]
    description: str


def _iomp() -> str | None:
    """libiomp5.so of the ``intel-openmp`` wheel in this environment (its data files go to <prefix>/lib)."""
    for prefix in {sys.prefix, sysconfig.get_config_var("prefix") or sys.prefix}:
        path = Path(prefix) / "lib" / "libiomp5.so"
        if path.is_file():
            return str(path)
    return None


def _tcmalloc() -> str | None:
    return next((p for p in _TCMALLOC if Path(p).is_file()), None)


def choose(environ: Mapping[str, str]) -> CpuRuntime:
    """The runtime for an engine process given its environment (explicit settings there always win)."""
    tcmalloc = _tcmalloc()
    iomp = _iomp() if environ.get(CHOICE, "auto") != "gnu" else None
    if iomp is not None:
        env = {"KMP_BLOCKTIME": environ.get("KMP_BLOCKTIME", "1")}
        libs: tuple[str, ...] = (iomp, tcmalloc) if tcmalloc else (iomp,)
        alloc = " + tcmalloc" if tcmalloc else ""
        return CpuRuntime(libs, env, f"Intel OpenMP (KMP_BLOCKTIME={env['KMP_BLOCKTIME']} ms){alloc}")
    env = {"OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    libs = (tcmalloc,) if tcmalloc else ()
    alloc = " + tcmalloc" if tcmalloc else ""
    return CpuRuntime(libs, env, f"GNU OpenMP (OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}){alloc}")


def exec_with_runtime(argv: list[str], environ: MutableMapping[str, str] | None = None) -> None:
    """Re-execute this process once with the chosen runtime preloaded (same PID); returns if nothing to do."""
    environ = os.environ if environ is None else environ
    if environ.get(MARKER) or "torch" in sys.modules:
        return  # already done, or too late: torch has loaded its OpenMP runtime
    runtime = choose(environ)
    env = dict(environ)
    env.update(runtime.env)
    env[MARKER] = runtime.description
    if runtime.preload:
        env["LD_PRELOAD"] = ":".join((*runtime.preload, *filter(None, [environ.get("LD_PRELOAD")])))
    os.execve(sys.executable, [sys.executable, "-m", "services.cli", *argv], env)


def describe(environ: Mapping[str, str] | None = None) -> str:
    """One line for the start-up log: which runtime this process runs with."""
    environ = os.environ if environ is None else environ
    applied = environ.get(MARKER)
    if applied:
        return applied
    policy = environ.get("OMP_WAIT_POLICY")
    return f"GNU OpenMP (OMP_WAIT_POLICY={policy or 'default'}), nothing preloaded (in-process use)"
