"""Speculative decoding vs plain decoding on SmolLM2, same process, same prompts, interleaved repeats.

Engines: plain; n-gram prompt lookup; a draft model (SmolLM2's own first layers + head, untrained, so a
weak draft, quantized to int4 like the target). Workloads: "repetitive" (rewrite a code snippet with
one name changed: most of the answer is in the prompt), "open" (free-form questions: little to look
up) and "random" (128 random token ids, as benchmarks/vs_vllm.py uses). Each at batch 1
(requests one after another) and batch 16 (16 at once). Greedy, up to 256 new tokens (the answers end
at the model's end of turn; all engines give the same answers up to numerics). Reports
output tok/s, TPOT (time per output token after the first, per request), the acceptance rate and the
acceptance per draft position, medians of --repeats. Prints a table, writes
benchmarks/results/spec_decode.json.

    python benchmarks/spec_decode.py [--repeats 3] [--k 3] [--draft-layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.common.openai.tokenizer import Tokenizer  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import (  # noqa: E402
    default_gguf_path,
    ensure_default_model,
    kvferry_home,
)
from tests.checkpoints import truncated_checkpoint  # noqa: E402

SNIPPETS = [
    """def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    \"\"\"Return n factorial.\"\"\"
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
""",
    """def is_prime(n):
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True


def primes_below(limit):
    return [n for n in range(limit) if is_prime(n)]
""",
    """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
""",
]
RENAMES = [("fibonacci", "fib"), ("items", "elements"), ("limit", "bound"), ("values", "data")]
TOPICS = ["the ocean", "volcanoes", "the history of bread", "how bees communicate", "the moon landing",
          "coffee", "trains in Japan", "the water cycle"]  # fmt: skip


def prompts_of(name: str, count: int, tok: Tokenizer) -> list[list[int]]:
    """Token ids of a workload: chat prompts, or random token ids (as benchmarks/vs_vllm.py draws them)."""
    if name == "random":
        rng = random.Random(0)
        return [[rng.randrange(3, 49000) for _ in range(128)] for _ in range(count)]
    return [tok.encode_chat(m) for m in workload(name, count)]


def workload(name: str, count: int) -> list[list[dict[str, str]]]:
    """Chat messages: code rewrites (repetitive) or open questions."""
    if name == "repetitive":
        return [
            [
                {
                    "role": "user",
                    "content": f"Rewrite this code with `{RENAMES[i % 4][0]}` renamed to `{RENAMES[i % 4][1]}`:"
                    f"\n\n{SNIPPETS[i % len(SNIPPETS)]}",
                }
            ]
            for i in range(count)
        ]
    return [
        [{"role": "user", "content": f"Tell me something interesting about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(count)
    ]


@dataclass
class Run:
    """One timed pass of one engine over one workload."""

    tok_s: float
    tpot_ms: float
    drafted: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)


def timed(llm: LLM, prompts: list[list[int]], batch: int, new_tokens: int) -> Run:
    """Serve ``prompts`` ``batch`` at a time through the engine's step loop (greedy, up to ``new_tokens``
    or the end of the answer); output tokens per second and each request's time per output token."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=new_tokens)
    stats = engine.core.scheduler.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_pos))
    engine.core.kv_manager.reset_prefix_cache()
    tpots: list[float] = []
    produced = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        seen: dict[str, tuple[list[float], list[int]]] = {}
        for p in prompts[first : first + batch]:
            seen[engine.add_request(p, params)] = ([], [])
        while engine.has_unfinished():
            for out in engine.step():
                times, counts = seen[out.request_id]
                times.append(time.perf_counter())
                counts.append(len(out.outputs[0].token_ids))
        for times, counts in seen.values():
            produced += counts[-1]
            if counts[-1] > 1:
                tpots.append((times[-1] - times[0]) / (counts[-1] - counts[0]))
    wall = time.perf_counter() - start
    per_pos = [a - (before[2][i] if i < len(before[2]) else 0) for i, a in enumerate(stats.accepted_per_pos)]
    return Run(
        produced / wall,
        statistics.mean(tpots) * 1e3,
        stats.num_draft_tokens - before[0],
        stats.num_accepted_tokens - before[1],
        per_pos,
    )


def engines(k: int, draft_layers: int) -> dict[str, LLM]:
    model = str(default_gguf_path())  # what `make run` serves: the Q4_1 GGUF, kept quantized
    draft = truncated_checkpoint(
        ensure_default_model(),
        kvferry_home() / "bench-models" / f"smollm2-{draft_layers}layers",
        draft_layers,
    )
    common = dict(model=model, max_model_len=2048, num_kv_blocks=1024)
    return {
        "plain": LLM(**common),
        f"ngram k={k}": LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": k}),
        f"draft {draft_layers}L k={k}": LLM(
            **common,
            speculative_config={
                "method": "draft_model",
                "num_speculative_tokens": k,
                "model": str(draft),
                "quantization": "int4",  # as light as the Q4_1 target per layer
            },
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--draft-layers", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    llms = engines(args.k, args.draft_layers)
    tok = next(iter(llms.values())).tokenizer
    names = ("repetitive", "open", "random")
    cells = [(w, b) for w in names for b in (1, 16)]
    prompts = {w: prompts_of(w, 16, tok) for w in names}
    for llm in llms.values():  # warm-up
        timed(llm, prompts["open"][:2], 2, 8)
    runs: dict[tuple[str, str, int], list[Run]] = {}
    for rep in range(args.repeats):
        for w, b in cells:
            ps = prompts[w][:4] if b == 1 else prompts[w]
            for name, llm in llms.items():
                run = timed(llm, ps, b, args.new_tokens)
                runs.setdefault((name, w, b), []).append(run)
                print(f"[r{rep + 1}] {w} b{b} {name}: {run.tok_s:.1f} tok/s", flush=True)
    print(report(runs, llms, cells, args))
    return 0


def report(runs: dict, llms: dict[str, LLM], cells: list[tuple[str, int]], args: argparse.Namespace) -> str:
    """The table (and the JSON beside it)."""
    rows, lines = [], ["| workload | batch | engine | output tok/s | × plain | TPOT ms | accepted | per position |",
                       "|---|---:|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for w, b in cells:
        plain = statistics.median(r.tok_s for r in runs[("plain", w, b)])
        for name in llms:
            rs = runs[(name, w, b)]
            tok_s, tpot = statistics.median(r.tok_s for r in rs), statistics.median(r.tpot_ms for r in rs)
            drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
            per_pos = [sum(r.per_pos[i] if i < len(r.per_pos) else 0 for r in rs) for i in range(args.k)]
            rate = accepted / drafted if drafted else None
            rows.append(dict(workload=w, batch=b, engine=name, tok_s=tok_s, vs_plain=tok_s / plain,
                             tpot_ms=tpot, acceptance=rate, accepted_per_pos=per_pos,
                             repeats=[r.tok_s for r in rs]))  # fmt: skip
            acc = f"{rate:.2f}" if rate is not None else "—"
            pos = " / ".join(str(n) for n in per_pos) if drafted else "—"
            lines.append(
                f"| {w} | {b} | {name} | {tok_s:.1f} | {tok_s / plain:.2f} | {tpot:.1f} | {acc} | {pos} |"
            )
    result = {
        "model": "SmolLM2-135M-Instruct Q4_1 (default)",
        "new_tokens": args.new_tokens,
        "k": args.k,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
