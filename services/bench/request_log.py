"""RequestLogRow: one request of a ``kvferry bench serve`` run, as ``--request-log`` writes it (JSONL)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.bench.client import RequestResult
from services.bench.datasets import BenchRequest

LOG_MARK: Final = "kvferry-bench-request"


class RequestLogRow(BaseModel):
    """What was sent (arrival, prompt ids, prefix group or session, max_tokens) and what came back.

    ``kvferry sim --trace`` replays a file of these rows (``log`` marks them as such)."""

    model_config = ConfigDict(extra="forbid")

    log: Literal["kvferry-bench-request"] = LOG_MARK
    start_s: float = Field(ge=0, description="when the request was sent, seconds from the run's start")
    endpoint: Literal["completions", "chat"] = "completions"
    prompt_token_ids: list[int] = Field(min_length=1, description="the ids sent (chat: rendered as text)")
    prompt_tokens: int = Field(ge=1, description="prompt tokens as the server counted them (usage)")
    max_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=0, description="tokens that came back")
    prefix_group: str | None = Field(None, description="the shared prefix or the agentic session")
    prefix_len: int = Field(0, ge=0, description="the group's tokens at the start of the prompt")
    kind: Literal["stream", "json", "dropped"] = "stream"
    success: bool = True
    ttft_s: float | None = Field(None, ge=0, description="streamed requests that got a token")
    latency_s: float = Field(0.0, ge=0)
    cached_tokens: int = Field(0, ge=0)
    error: str = ""


def log_rows(
    sent: Sequence[BenchRequest], results: Sequence[RequestResult], endpoint: Literal["completions", "chat"]
) -> list[RequestLogRow]:
    """One row per valid request, by start time (the soak's invalid requests carry no prompt: left out)."""
    rows = []
    for r in sorted(results, key=lambda r: r.start):
        if r.kind == "bad" or not 0 <= r.index < len(sent):
            continue
        request = sent[r.index]
        rows.append(
            RequestLogRow(
                start_s=max(r.start, 0.0),
                endpoint=endpoint,
                prompt_token_ids=list(request.prompt_ids),
                prompt_tokens=max(r.prompt_len, 1),
                max_tokens=request.output_len,
                output_tokens=r.output_len,
                prefix_group=request.group,
                prefix_len=request.prefix_len,
                kind=r.kind,
                success=r.success,
                ttft_s=r.ttft if r.success and r.kind == "stream" and r.output_len else None,
                latency_s=r.latency,
                cached_tokens=r.cached_len,
                error=r.error,
            )
        )
    return rows


def write_request_log(rows: Sequence[RequestLogRow], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(row.model_dump_json() + "\n")
