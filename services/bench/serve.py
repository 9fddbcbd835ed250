"""``kvferry bench serve`` as a library: validated config -> dataset -> load run -> summary."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.bench.agentic import AgenticRun, AgenticSummary
from services.bench.client import LoadRun, RequestResult, Target, fetch_model, run_load
from services.bench.datasets import (
    BenchRequest,
    TokenSpace,
    plain_token_space,
    synthetic_dataset,
    tokenizer_token_space,
)
from services.bench.request_log import RequestLogRow, log_rows
from services.bench.soak import Mix, run_soak
from services.bench.stats import BenchSummary, summarize


class BenchConfig(BaseModel):
    """Options of ``kvferry bench serve`` (the CLI flags, validated)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: Literal["completions", "chat"] = "completions"
    dataset: Literal["random", "shared-prefix", "mixed", "agentic"] = "random"
    num_prompts: int = Field(100, ge=1)
    input_len: int = Field(1024, ge=0)
    output_len: int = Field(128, ge=1)
    prefix_len: int = Field(0, ge=0)
    num_prefixes: int = Field(1, ge=1)
    request_rate: float = Field(math.inf, gt=0)
    max_concurrency: int | None = Field(None, ge=1)
    seed: int = 0
    tokenizer: str | None = None
    vocab_size: int = Field(256, ge=1)
    api_key: str | None = Field(None, exclude=True)  # never written to --result-json
    timeout: float = Field(600.0, gt=0)
    result_json: Path | None = None
    request_log: Path | None = None  # JSONL, one row per request (what `kvferry sim --trace` replays)
    plot: Path | None = None
    progress: bool = True
    # A soak: --max-concurrency closed-loop clients for this many seconds (the prompts reused in turn)
    duration: float | None = Field(None, gt=0)
    stream_fraction: float = Field(1.0, ge=0, le=1)  # of the valid requests, streamed (else one JSON answer)
    disconnect_fraction: float = Field(0.0, ge=0, le=1)  # streams the client leaves mid-way
    bad_fraction: float = Field(0.0, ge=0, le=1)  # invalid requests, each must be answered with a 4xx
    window: float | None = Field(None, gt=0)  # report requests, failures and p99 TTFT per window (s)
    # --dataset agentic: --num-prompts sessions of this many turns, sub-agents forked half-way, tool pauses
    turns: int = Field(6, ge=1)
    subagents: int = Field(2, ge=0)
    tool_pause: float = Field(0.5, ge=0)

    @model_validator(mode="after")
    def _check_dataset(self) -> BenchConfig:
        if self.dataset in ("shared-prefix", "mixed") and self.prefix_len < 1:
            raise ValueError(f"the {self.dataset} dataset needs --prefix-len >= 1")
        if self.dataset == "agentic" and (self.duration is not None or self.request_rate != math.inf):
            raise ValueError(
                "the agentic dataset paces itself (turns, tool pauses): no --duration or --request-rate"
            )
        if self.input_len + self.prefix_len < 1:
            raise ValueError("prompts need at least one token: raise --input-len or --prefix-len")
        return self

    @model_validator(mode="after")
    def _check_soak(self) -> BenchConfig:
        mixed = self.stream_fraction != 1.0 or self.disconnect_fraction or self.bad_fraction
        if mixed and self.duration is None:
            raise ValueError("--stream-fraction, --disconnect-fraction and --bad-fraction need --duration")
        if self.duration is not None and (self.max_concurrency is None or self.request_rate != math.inf):
            raise ValueError(
                "--duration runs --max-concurrency closed-loop clients: set it, and no --request-rate"
            )
        if self.bad_fraction + self.disconnect_fraction > 1:
            raise ValueError("--bad-fraction + --disconnect-fraction must be at most 1")
        return self

    @property
    def mix(self) -> Mix:
        return Mix(self.bad_fraction, self.disconnect_fraction, self.stream_fraction)


class BenchResult(BaseModel):
    """What ``--result-json`` holds: the config, the summary and every request's timings (seconds)."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    config: BenchConfig
    summary: BenchSummary
    requests: list[RequestResult]


@dataclass(frozen=True)
class BenchOutcome:
    """A finished benchmark: the raw run and its summary."""

    config: BenchConfig
    run: LoadRun
    summary: BenchSummary
    requests: Sequence[BenchRequest] = ()  # the dataset (results name theirs by index)

    def request_log(self) -> list[RequestLogRow]:
        """The ``--request-log`` rows of this run."""
        return log_rows(self.requests, self.run.results, self.config.endpoint)

    def to_result(self) -> BenchResult:
        return BenchResult(config=self.config, summary=self.summary, requests=self.run.results)


def token_space(config: BenchConfig) -> TokenSpace:
    """The tokenizer's vocabulary if ``--tokenizer`` is given, else ids in ``[0, --vocab-size)``."""
    return (
        tokenizer_token_space(config.tokenizer) if config.tokenizer else plain_token_space(config.vocab_size)
    )


def build_dataset(config: BenchConfig) -> list[BenchRequest]:
    """The prompts of a run (``random`` uses one shared prefix when ``--prefix-len`` > 0; ``mixed``
    alternates shared-prefix prompts with random ones of the same length)."""
    if config.dataset == "mixed":
        shared = config.model_copy(
            update={"dataset": "shared-prefix", "num_prompts": (config.num_prompts + 1) // 2}
        )
        plain = config.model_copy(
            update={
                "dataset": "random",
                "num_prompts": max(1, config.num_prompts // 2),
                "input_len": config.input_len + config.prefix_len,
                "prefix_len": 0,
                "seed": config.seed + 1,
            }
        )
        both = zip(build_dataset(shared), build_dataset(plain), strict=False)
        return [request for pair in both for request in pair][: config.num_prompts]
    num_prefixes = config.num_prefixes if config.dataset == "shared-prefix" else 1
    return synthetic_dataset(
        token_space(config),
        config.num_prompts,
        config.input_len,
        config.output_len,
        config.prefix_len,
        num_prefixes,
        config.seed,
    )


async def run_bench_async(config: BenchConfig) -> BenchOutcome:
    """Build the dataset, resolve the model (first of ``/v1/models`` if not given), run, summarize."""
    requests = build_dataset(config)
    target = Target(config.url, config.model or "", config.endpoint, config.api_key, config.timeout)
    if not config.model:
        target = Target(
            config.url, await fetch_model(target), config.endpoint, config.api_key, config.timeout
        )
        config = config.model_copy(update={"model": target.model})
    if config.duration is not None:
        clients = config.max_concurrency or 1
        run = await run_soak(
            target, requests, clients, config.duration, config.mix, config.seed, config.progress
        )
    else:
        run = await run_load(
            target, requests, config.request_rate, config.max_concurrency, config.seed, config.progress
        )
    return BenchOutcome(config, run, summarize(run, config.window), requests)


async def run_agentic_async(config: BenchConfig) -> tuple[BenchConfig, AgenticRun, AgenticSummary]:
    """``--dataset agentic``: sessions (``--num-prompts``) at most ``--max-concurrency`` at a time."""
    target = Target(config.url, config.model or "", config.endpoint, config.api_key, config.timeout)
    if not config.model:
        target = Target(
            config.url, await fetch_model(target), config.endpoint, config.api_key, config.timeout
        )
        config = config.model_copy(update={"model": target.model})
    run = AgenticRun(
        target,
        token_space(config),
        sessions=config.num_prompts,
        turns=config.turns,
        system_len=config.prefix_len,
        turn_len=config.input_len,
        output_len=config.output_len,
        subagents=config.subagents,
        tool_pause_s=config.tool_pause,
        seed=config.seed,
    )
    summary = await run.run(config.max_concurrency)
    return config, run, summary


def run_bench(config: BenchConfig) -> BenchOutcome:
    """Synchronous :func:`run_bench_async` for scripts."""
    return asyncio.run(run_bench_async(config))
