"""``kvferry bench serve``: argparse wiring around :mod:`services.bench.serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pydantic import ValidationError

from services.bench.request_log import log_rows, write_request_log
from services.bench.serve import BenchConfig, run_agentic_async, run_bench
from services.bench.stats import format_table

_HELP = {
    "url": "base URL of the OpenAI-compatible server (with or without /v1)",
    "model": "model name to request (default: the first one /v1/models lists)",
    "endpoint": "API to drive",
    "dataset": "random prompts, prompts in groups sharing a prefix, both alternating (mixed), or agentic "
    "sessions (--num-prompts sessions, --prefix-len system prompt, --input-len new tokens a turn)",
    "num_prompts": "number of requests to send",
    "input_len": "random tokens per prompt (after the prefix)",
    "output_len": "tokens to generate per request (max_tokens, ignore_eos)",
    "prefix_len": "shared-prefix tokens per prompt",
    "num_prefixes": "distinct prefixes (shared-prefix dataset)",
    "request_rate": "mean requests/s, Poisson arrivals; inf sends all at once",
    "max_concurrency": "most requests in flight at once",
    "seed": "seed of the dataset and the arrival times",
    "tokenizer": "tokenizer.json (or a model folder) to draw prompt ids from",
    "vocab_size": "without --tokenizer, prompt ids are drawn from [0, VOCAB_SIZE)",
    "api_key": "bearer token to send",
    "timeout": "per-request timeout in seconds",
    "result_json": "write the summary and per-request timings here",
    "request_log": "write one JSON line per request here (arrival, prompt ids, prefix group or session, "
    "output tokens): `kvferry sim --trace FILE` replays it",
    "plot": "write a PNG of the latency distributions here",
    "duration": "soak: --max-concurrency closed-loop clients send requests until this many seconds passed",
    "stream_fraction": "soak: fraction of the valid requests that stream (the rest get one JSON answer)",
    "disconnect_fraction": "soak: fraction of requests whose client disconnects mid-stream",
    "bad_fraction": "soak: fraction of invalid requests (each must be answered with a 4xx)",
    "window": "report requests, failures and p99 TTFT per window of this many seconds",
    "turns": "agentic: turns per session",
    "subagents": "agentic: sub-agents forked half-way through each session (two turns each, concurrent)",
    "tool_pause": "agentic: mean seconds a session pauses between turns (a tool running)",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` (with its ``serve`` sub-command) to the ``kvferry`` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks and load generation")
    nested = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    serve = nested.add_parser("serve", help="load-test an OpenAI-compatible server")
    add = serve.add_argument
    add("--url", default="http://127.0.0.1:8000", help=_HELP["url"])
    add("--model", default=None, help=_HELP["model"])
    add("--endpoint", choices=["completions", "chat"], default="completions", help=_HELP["endpoint"])
    add(
        "--dataset",
        choices=["random", "shared-prefix", "mixed", "agentic"],
        default="random",
        help=_HELP["dataset"],
    )
    for name, kind, default in (
        ("num_prompts", int, 100),
        ("input_len", int, 1024),
        ("output_len", int, 128),
        ("prefix_len", int, 0),
        ("num_prefixes", int, 1),
        ("request_rate", float, float("inf")),
        ("max_concurrency", int, None),
        ("seed", int, 0),
        ("vocab_size", int, 256),
        ("timeout", float, 600.0),
        ("duration", float, None),
        ("stream_fraction", float, 1.0),
        ("disconnect_fraction", float, 0.0),
        ("bad_fraction", float, 0.0),
        ("window", float, None),
        ("turns", int, 6),
        ("subagents", int, 2),
        ("tool_pause", float, 0.5),
    ):
        add(f"--{name.replace('_', '-')}", type=kind, default=default, help=_HELP[name])
    for name in ("tokenizer", "api_key", "result_json", "request_log", "plot"):
        add(f"--{name.replace('_', '-')}", default=None, help=_HELP[name])
    add("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    serve.set_defaults(func=run_serve)
    bench.set_defaults(func=lambda _args: bench.print_help() or 2)
    return bench


def run_serve(args: argparse.Namespace) -> int:
    """Run the benchmark; exit 0 if any request succeeded (a soak, --duration: if every request got the
    answer it must), 1 otherwise, 2 on bad options."""
    options = {k: v for k, v in vars(args).items() if k not in ("command", "bench_command", "func")}
    try:
        config = BenchConfig(**options)
    except ValidationError as exc:
        print(f"kvferry bench serve: invalid options:\n{exc}", file=sys.stderr)
        return 2
    if config.dataset == "agentic":
        return _run_agentic(config)
    try:
        outcome = run_bench(config)
    except RuntimeError as exc:  # no model given and none could be discovered
        print(f"kvferry bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_table(outcome.summary))
    if config.result_json:
        config.result_json.write_text(outcome.to_result().model_dump_json(indent=2))
    if config.request_log:
        write_request_log(outcome.request_log(), config.request_log)
    if config.plot:
        from services.bench.plot import plot_latencies

        plot_latencies(outcome.run, config.plot)
    if config.duration is not None:
        return 0 if outcome.summary.completed and not outcome.summary.failed else 1
    return 0 if outcome.summary.completed else 1


def _run_agentic(config: BenchConfig) -> int:
    """The agentic workload: its summary printed (and with --result-json written); 0 if every request
    succeeded."""
    try:
        config, run, summary = asyncio.run(run_agentic_async(config))
    except RuntimeError as exc:
        print(f"kvferry bench serve: {exc}", file=sys.stderr)
        return 1
    print(summary.table())
    if config.result_json:
        config.result_json.write_text(
            json.dumps({"config": config.model_dump(mode="json"), "summary": summary.model_dump()}, indent=2)
        )
    if config.request_log:
        write_request_log(log_rows(run.sent, run.results, config.endpoint), config.request_log)
    return 0 if summary.requests and not summary.failed else 1
