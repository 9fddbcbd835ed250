"""Structured-output cost: 64 concurrent JSON-schema requests vs the same 64 unconstrained, in one run.

Also the grammar compile time (cold / cached), the per-step cost of filling and applying the token
bitmask, and (``--compare-libraries``) xgrammar's vs llguidance's next-token mask time on the model's
vocabulary. Prints a table and writes JSON.

    python benchmarks/structured_output.py [--model PATH] [--prompts 64] [--repeats 3] [--compare-libraries]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.common.openai.protocol_structured import StructuredSpec  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import ensure_default_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "maxLength": 8},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}


def _prompts(llm: LLM, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    people = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Edsger", "Donald", "Margaret"]
    return [
        llm.tokenizer.encode_chat(
            [
                {
                    "role": "user",
                    "content": f"Describe {rng.choice(people)} "
                    f"(#{i}) as a JSON record with name, age, email, tags, address.",
                }
            ]
        )
        for i in range(n)
    ]


def _run(
    llm: LLM, prompts: list[list[int]], spec: StructuredSpec | None, max_tokens: int
) -> tuple[float, int]:
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=spec is None, structured_outputs=spec
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def throughput(llm: LLM, n: int, repeats: int, max_tokens: int) -> dict[str, Any]:
    """Median output tok/s, constrained and not, interleaved; constrained runs first compile (cached after)."""
    spec = StructuredSpec.of("json", SCHEMA)
    rows: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for r in range(repeats):
        prompts = _prompts(llm, n, seed=r)
        for name, s in (("unconstrained", None), ("json_schema", spec)):
            llm.engine.core.kv_manager.reset_prefix_cache()
            elapsed, tokens = _run(llm, prompts, s, max_tokens)
            rows[name].append(tokens / elapsed)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"tok_s": med, "ratio": med["json_schema"] / med["unconstrained"], "runs": rows}


def compile_times(llm: LLM) -> dict[str, float]:
    compiler = llm.engine.structured.compiler
    schema = dict(SCHEMA, title=f"bench-{time.time()}")  # a schema not compiled before
    start = time.perf_counter()
    compiler.compile(StructuredSpec.of("json", schema))
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(StructuredSpec.of("json", schema))
    return {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - start) * 1e3}


def mask_cost(llm: LLM, rows: int = 64, steps: int = 50) -> dict[str, float]:
    """Per step: fill every row's bitmask (xgrammar matchers) and apply it to [rows, vocab] logits."""
    import xgrammar as xgr

    from services.engine.worker.structured.bitmask import apply_token_bitmask

    compiled = llm.engine.structured.compiler.compile(StructuredSpec.of("json", SCHEMA))
    vocab = llm.engine.structured.vocab_size
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    logits = torch.randn(rows, vocab)
    idx = torch.arange(rows)
    fill, apply = [], []
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        fill.append(time.perf_counter() - t)
        t = time.perf_counter()
        apply_token_bitmask(logits, bitmask, idx, idx)
        apply.append(time.perf_counter() - t)
    return {
        "fill_ms": statistics.median(fill) * 1e3,
        "apply_ms": statistics.median(apply) * 1e3,
        "rows": rows,
    }


def compare_libraries(llm: LLM) -> dict[str, float]:
    """Next-token mask time of xgrammar and llguidance over one schema-valid JSON text (one thread)."""
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.backend)
    vocab = llm.engine.structured.vocab_size
    text = json.dumps(
        {
            "name": "Ada",
            "age": 36,
            "email": "ada@x.org",
            "tags": ["a"],
            "address": {"city": "London", "zip": "N1"},
        },
        separators=(",", ":"),
    )
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    matcher = xgr.GrammarMatcher(llm.engine.structured.compiler.compile(StructuredSpec.of("json", SCHEMA)))
    mask, xt = xgr.allocate_token_bitmask(1, vocab), []
    for tok in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        xt.append(time.perf_counter() - t)
        matcher.accept_token(tok)
    lt_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    lm = llg.LLMatcher(lt_tok, llg.LLMatcher.grammar_from_json_schema(SCHEMA))
    mask2, lt = llguidance.torch.allocate_token_bitmask(1, vocab), []
    for tok in ids:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(lm, mask2, 0)
        lt.append(time.perf_counter() - t)
        lm.consume_token(tok)
    return {
        "xgrammar_p50_us": statistics.median(xt) * 1e6,
        "xgrammar_max_us": max(xt) * 1e6,
        "llguidance_p50_us": statistics.median(lt) * 1e6,
        "llguidance_max_us": max(lt) * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--compare-libraries", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/structured_output.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = args.model or str(ensure_default_model())
    llm = LLM(
        model=model, dtype=args.dtype, max_num_seqs=args.prompts, max_model_len=1024, num_kv_blocks=4096
    )
    result: dict[str, Any] = {
        "model": Path(model).name,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "compile": compile_times(llm),
        "mask": mask_cost(llm),
        "throughput": throughput(llm, args.prompts, args.repeats, args.max_tokens),
    }
    if args.compare_libraries:
        result["libraries"] = compare_libraries(llm)
    t, c, m = result["throughput"], result["compile"], result["mask"]
    print("| workload | output tok/s |\n|---|---:|")
    print(f"| {args.prompts} unconstrained | {t['tok_s']['unconstrained']:.0f} |")
    print(f"| {args.prompts} JSON schema | {t['tok_s']['json_schema']:.0f} ({t['ratio']:.2f}x) |")
    print(
        f"compile cold {c['cold_ms']:.1f} ms, cached {c['cached_ms']:.2f} ms; per step for {m['rows']} rows: "
        f"fill {m['fill_ms']:.2f} ms, apply {m['apply_ms']:.2f} ms"
    )
    if "libraries" in result:
        print(json.dumps(result["libraries"], indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
