"""One engine (vLLM, kvferry or HF generate) per process for benchmarks/vs_vllm.py: the worker, its parent-side handle, CPU accounting."""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RunFn = Callable[[list[list[int]], int], list[list[int]]]


def _reply_channel() -> Any:
    """Keep the real stdout for replies; send everything else printed to fd 1 (ours and children's) to stderr."""
    sys.stdout.flush()
    chan = os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by children
    os.dup2(2, 1)
    return chan


def _threads() -> int:
    return int(os.environ.get("VS_VLLM_THREADS") or os.cpu_count() or 2)


def load_vllm(model: str, dtype: str, opts: dict[str, Any]) -> tuple[RunFn, dict[str, Any]]:
    """vLLM's offline LLM; the venv and CPU env variables are set by the parent."""
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        seed=0,
        enable_prefix_caching=True,
        max_model_len=opts["max_model_len"],
        max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"],
    )

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run, {"vllm": vllm.__version__, **_torch_info()}


def load_kvferry(model: str, dtype: str, opts: dict[str, Any]) -> tuple[RunFn, dict[str, Any]]:
    """kvferry's offline LLM (public API only: services.engine.LLM / SamplingParams)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from services.engine import LLM, SamplingParams

    torch.set_num_threads(_threads())
    llm = LLM(
        model=model,
        dtype=dtype,
        enable_prefix_caching=True,
        max_model_len=opts["max_model_len"],
        max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"],
        kv_cache_memory_gb=opts["kv_cache_gb"],
    )

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]

    return run, _torch_info()


def load_hf(model: str, dtype: str, opts: dict[str, Any]) -> tuple[RunFn, dict[str, Any]]:
    """HF transformers `generate`, greedy, dense KV; prompts of one call must have equal lengths."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(_threads())
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()

    return run, {"transformers": transformers.__version__, **_torch_info()}


def _torch_info() -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


LOADERS = {"vllm": load_vllm, "kvferry": load_kvferry, "hf": load_hf}


def handle(run: RunFn, req: dict[str, Any]) -> dict[str, Any]:
    """One timed generate; an optional untimed warm call right before it (to put a shared prefix in the cache)."""
    if req.get("warm"):
        run(req["warm"], 1)
    start = time.perf_counter()
    outs = run(req["prompts"], req["max_tokens"])
    elapsed = time.perf_counter() - start
    lens = [len(o) for o in outs]
    if any(n != req["max_tokens"] for n in lens):
        return {"error": f"expected {req['max_tokens']} tokens per prompt, got {sorted(set(lens))}"}
    return {"elapsed_s": elapsed, "out_tokens": sum(lens), "sample": [o[:16] for o in outs[:4]]}


def serve(engine: str, model: str, dtype: str, opts: dict[str, Any]) -> int:
    chan = _reply_channel()
    start = time.perf_counter()
    run, info = LOADERS[engine](model, dtype, opts)
    load_s = time.perf_counter() - start
    run([[5 + i] * 32 for i in range(min(8, opts["max_num_seqs"]))], 4)  # warm-up: batched prefill + decode
    run([[7] * 16], 4)  # and batch 1
    chan.write(
        json.dumps(
            {"ready": True, "load_s": load_s, "warmup_s": time.perf_counter() - start - load_s, "info": info}
        )
        + "\n"
    )
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            reply = handle(run, req)
        except Exception as exc:  # report, keep serving: the parent decides
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        chan.write(json.dumps(reply) + "\n")
    return 0


class EngineProcess:
    """The parent's handle on one worker: it loads and warms up at start, then runs one timed generate per request."""

    def __init__(
        self,
        name: str,
        python: Path,
        kind: str,
        model: Path,
        dtype: str,
        opts: dict[str, Any],
        env: dict[str, str],
        log_path: Path,
    ) -> None:
        self.name, self.log_path, self.buf = name, log_path, b""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(python),
            str(Path(__file__).resolve()),
            "--engine",
            kind,
            "--model",
            str(model),
            "--dtype",
            dtype,
            "--opts",
            json.dumps(opts),
        ]
        with open(log_path, "w") as err:  # its own session: the worker and every engine process it starts
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=str(ROOT),
                start_new_session=True,
            )

    def reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.fail(f"no reply in {timeout:.0f} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                self.fail(f"exited with {self.proc.wait()}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            self.fail(msg["error"])
        return msg

    def run(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return self.reply(timeout)

    def fail(self, why: str) -> None:
        tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.is_file() else ""
        self.close()
        raise SystemExit(f"{self.name} worker: {why}\n--- {self.log_path} (tail) ---\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 15)  # the session this worker leads (started above)
                self.proc.wait(timeout=30)


def cpu_snapshot(sessions: set[int]) -> tuple[int, int, dict[int, int], int]:
    """(all CPUs' ticks, idle + iowait ticks, {session: user + system ticks}, steal ticks) now: /proc/stat
    and /proc/*/stat. Steal is time the hypervisor ran something else on our virtual CPUs."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    steal = vals.pop()
    ours = dict.fromkeys(sessions, 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in ours:  # our workers lead their own sessions (start_new_session)
            ours[int(fields[3])] += int(fields[11]) + int(fields[12])
    return sum(vals), vals[3] + vals[4], ours, steal


def cpu_share(a: tuple, b: tuple, running: int | None = None) -> dict[str, float]:
    """Between two snapshots, as fractions of the whole machine: busy, our running worker, our idle ones, others;
    steal as a fraction of the time the virtual CPUs wanted."""
    span = max(1, b[0] - a[0])
    busy = 1.0 - (b[1] - a[1]) / span
    delta = {sid: (b[2][sid] - a[2].get(sid, 0)) / span for sid in b[2]}
    run = delta.pop(running, 0.0) if running is not None else 0.0
    idle_ours = sum(delta.values())
    return {
        "busy": round(busy, 3),
        "running": round(run, 3),
        "idle_workers": round(idle_ours, 3),
        "others": round(max(0.0, busy - run - idle_ours), 3),
        "steal": round((b[3] - a[3]) / (span + b[3] - a[3]), 3),
    }


def cpu_busy(sessions: set[int], interval: float = 1.0) -> dict[str, float]:
    a = cpu_snapshot(sessions)
    time.sleep(interval)
    return cpu_share(a, cpu_snapshot(sessions))


def probe_machine(threads: int) -> dict[str, Any]:
    """Best-of-N memory copy bandwidth (256 MiB copied: 512 MiB moved) and fp32/bf16 GEMM rates on a 512x768 @ 768x1536 matmul."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(8))
    out: dict[str, Any] = {"copy_bytes": 2 * src.numel() * 4, "mem_bw_Bps": 2 * src.numel() * 4 / best}
    m, k, n = 512, 768, 1536
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
        for _ in range(3):
            a @ b
        t = min(_timed(lambda a=a, b=b: [a @ b for _ in range(10)]) for _ in range(5)) / 10
        out[f"gemm_{name}_flops"] = 2 * m * k * n / t
    out["gemm_shape"] = [m, k, n]
    out["threads"] = threads
    return out


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", choices=sorted(LOADERS))
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--opts", default="{}", help="JSON: max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_gb"
    )
    ap.add_argument(
        "--probe", action="store_true", help="print the machine's copy bandwidth and GEMM rates, exit"
    )
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe_machine(_threads())))
        return 0
    return serve(args.engine, args.model, args.dtype, json.loads(args.opts))


if (
    __name__ == "__main__"
):  # vLLM starts its engine core with multiprocessing "spawn": keep imports side-effect free
    sys.exit(main())
