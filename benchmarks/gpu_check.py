"""make gpu-check: the one prepared script for a bare CUDA machine (SMOKE=1: the same parts on the CPU).

Parts, each writing its JSON under the output folder as soon as it ends (a run cut short still reports):
  1. pytest -m gpu            -> pytest.json, pytest.log
  2. benchmarks/kernels.py    -> kernels.json (decode vs copy bandwidth, prefill vs SDPA, pointwise, steps)
  3. the engine end to end    -> engine.json (output tok/s for many prompts, batch-1 ITL; eager vs graphs)
  4. kvferry serve + openai   -> serve.json, serve.log (sampled chat, json_schema, n=2 + logprobs, embeddings)
and summary.json. Output folder: $OUT when set, else build/gpu-check. Models are built here with random
weights (no model files travel). Missing Python packages install from wheels in .whl/ (`make gpu-wheels`).
Usage: python benchmarks/gpu_check.py [--smoke] [--parts pytest,kernels,engine,serve]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT), str(ROOT / "operator")] + [
    p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"
]

from benchmarks.gpu_check_env import ensure_packages, subprocess_env  # noqa: E402


def say(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def part_pytest(out: Path, smoke: bool) -> dict:
    """The @gpu tests (kernels at full shapes in bf16 and fp16, engine parity, sampled requests on CUDA);
    in smoke mode they are collected and skipped: imports, fixtures and markers are what is rehearsed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "120",
           "tests/kernels", "tests/engine"]  # fmt: skip
    log = out / "pytest.log"
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), stdout=fh, stderr=subprocess.STDOUT,
                              timeout=150 if smoke else 240, check=False)  # fmt: skip
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    counts = _pytest_counts(tail[0])
    ok = proc.returncode == 0 or (proc.returncode == 5 and smoke)
    return {"ok": ok, "returncode": proc.returncode, "summary": tail[0], **counts}


def _pytest_counts(line: str) -> dict[str, int]:
    """{'passed': 3, 'skipped': 2, ...} from pytest's closing line."""
    words = line.replace(",", " ").split()
    kinds = ("passed", "failed", "skipped", "error", "errors", "deselected")
    return {w: int(n) for n, w in zip(words, words[1:], strict=False) if n.isdigit() and w in kinds}


def part_kernels(out: Path, smoke: bool) -> dict:
    flag = "--smoke" if smoke else "--quick"
    env = subprocess_env() | ({"TRITON_INTERPRET": "1"} if smoke else {})
    tmp = out / "kernels-tmp"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), flag, "--out-dir", str(tmp)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
    found = sorted(tmp.glob("kernels-*.json"))
    if proc.returncode != 0 or not found:
        return {"ok": False, "returncode": proc.returncode, "stderr": proc.stderr[-2000:]}
    result = json.loads(found[0].read_text())
    (out / "kernels.json").write_text(json.dumps(result, indent=1))
    for f in found:
        f.unlink()
    tmp.rmdir()
    return {"ok": True, "device": result.get("device"), "rows": len(result.get("rows", []))}


def part_engine(out: Path, smoke: bool) -> dict:
    from benchmarks.gpu_check_engine import engine_check

    return engine_check(out, smoke)


def part_serve(out: Path, smoke: bool) -> dict:
    from benchmarks.gpu_check_serve import serve_check

    return serve_check(out, smoke)


PARTS: dict[str, Callable[[Path, bool], dict]] = {
    "pytest": part_pytest,
    "kernels": part_kernels,
    "engine": part_engine,
    "serve": part_serve,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE", "") not in ("", "0"))
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT") or ROOT / "build" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    installed = ensure_packages(ROOT)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        say("no CUDA device: run `make gpu-check SMOKE=1` to rehearse on the CPU")
        return 2
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    say(f"device {device}; torch {torch.__version__}; python {sys.version.split()[0]}; installed {installed}")
    summary: dict = {"device": device, "torch": torch.__version__, "smoke": args.smoke, "parts": {}}
    for name in args.parts.split(","):
        say(f"part {name} ...")
        t0 = time.perf_counter()
        try:
            result = PARTS[name](out, args.smoke)
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the others' results
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        summary["parts"][name] = {"ok": result.get("ok", False), "seconds": result["seconds"]}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        say(f"part {name}: {'ok' if result.get('ok') else 'FAILED'} in {result['seconds']} s")
    failed = [n for n, r in summary["parts"].items() if not r["ok"]]
    say("all parts passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
