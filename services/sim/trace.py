"""Trace JSONL: one request per line (arrival, prompt tokens or lengths with a prefix group, output length);
a ``kvferry bench serve --request-log`` file reads as one too."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.bench.request_log import LOG_MARK, RequestLogRow

TraceFormat = Literal["auto", "trace", "bench"]


class TraceError(ValueError):
    """A trace row is invalid; the message names the file, the line and the field."""


class TraceRow(BaseModel):
    """One request. The prompt is ``prompt_token_ids``, or ``prompt_len`` tokens whose first
    ``prefix_len`` are shared by every row of ``prefix_group`` (the rest unique to this row)."""

    model_config = ConfigDict(extra="forbid")

    t: float = Field(ge=0, description="arrival, seconds from the trace start")
    prompt_token_ids: list[int] | None = Field(None, min_length=1)
    prompt_len: int | None = Field(None, ge=1)
    prefix_group: str | None = None
    prefix_len: int = Field(0, ge=0)
    output_len: int = Field(ge=1)
    output_token_ids: list[int] | None = Field(None, description="tokens to emit (parity checks, sessions)")
    session: str | None = None
    tenant: str | None = Field(None, description="a tenant of the pool (its band and quota); none: default")
    id: str | None = None

    @model_validator(mode="after")
    def _check(self) -> TraceRow:
        if (self.prompt_token_ids is None) == (self.prompt_len is None):
            raise ValueError("give exactly one of prompt_token_ids and prompt_len")
        if self.prompt_len is not None and self.prefix_len > self.prompt_len:
            raise ValueError(f"prefix_len {self.prefix_len} exceeds prompt_len {self.prompt_len}")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("prefix_len needs a prefix_group")
        if self.output_token_ids is not None and len(self.output_token_ids) != self.output_len:
            raise ValueError("output_token_ids must hold output_len tokens")
        return self

    @classmethod
    def from_bench(cls, row: RequestLogRow, number: int) -> TraceRow:
        """A bench request replayed: its arrival, its prompt ids (or, where the server counted other tokens
        than were sent, a chat template's, its length and prefix group), and the tokens that came back
        (a failed request: the max_tokens it asked for)."""
        output = row.output_tokens if row.success and row.output_tokens else row.max_tokens
        if len(row.prompt_token_ids) == row.prompt_tokens:
            return cls(
                t=row.start_s, prompt_token_ids=row.prompt_token_ids, output_len=output, id=f"bench-{number}"
            )
        shared = min(row.prefix_len, row.prompt_tokens) if row.prefix_group else 0
        return cls(
            t=row.start_s,
            prompt_len=row.prompt_tokens,
            prefix_group=row.prefix_group,
            prefix_len=shared,
            output_len=output,
            id=f"bench-{number}",
        )

    @property
    def whole_prompt_shared(self) -> bool:
        """The prompt is all group tokens: the output continues the group's stream (agentic sessions)."""
        return self.prompt_len is not None and self.prefix_len == self.prompt_len

    def tokens(self, index: int, vocab_size: int) -> list[int]:
        """The prompt's token ids: given, or drawn from the group's seed (shared) and the row's (own)."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        assert self.prompt_len is not None
        shared = draw(f"group:{self.prefix_group}", self.prefix_len, vocab_size) if self.prefix_len else []
        own = draw(f"row:{self.id or index}", self.prompt_len - self.prefix_len, vocab_size)
        return shared + own

    def output_tokens(self, index: int, vocab_size: int) -> list[int]:
        """What the simulated engine emits: given, the group's stream after the prompt, or the row's own."""
        if self.output_token_ids is not None:
            return list(self.output_token_ids)
        if self.whole_prompt_shared:
            assert self.prompt_len is not None
            stream = draw(f"group:{self.prefix_group}", self.prompt_len + self.output_len, vocab_size)
            return stream[self.prompt_len :]
        return draw(f"out:{self.id or index}", self.output_len, vocab_size)


def draw(key: str, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids from the stream named ``key`` (a longer draw starts with the shorter one)."""
    rng = np.random.Generator(np.random.PCG64(zlib.crc32(key.encode())))
    return [int(x) for x in rng.integers(0, vocab_size, n, dtype=np.int64)]


def _row(body: object, number: int, fmt: TraceFormat) -> TraceRow:
    if fmt == "bench":
        return TraceRow.from_bench(RequestLogRow.model_validate(body), number)
    return TraceRow.model_validate(body)


def _detect(body: object) -> TraceFormat:
    """A request log's rows carry ``"log": "kvferry-bench-request"``; anything else is read as a trace."""
    return "bench" if isinstance(body, dict) and body.get("log") == LOG_MARK else "trace"


def parse_rows(lines: Iterable[str], source: str, fmt: TraceFormat = "auto") -> list[TraceRow]:
    """Validate every line (``auto``: the first row tells a request log from a trace); the first bad one
    raises TraceError naming ``source:line`` and the field."""
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            fmt = _detect(body) if fmt == "auto" else fmt
            rows.append(_row(body, number, fmt))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}:{number}: not JSON ({exc.msg})") from None
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(row)'}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
            raise TraceError(f"{source}:{number}: {problems}") from None
    if not rows:
        raise TraceError(f"{source}: the trace holds no request")
    if any(b.t < a.t for a, b in zip(rows, rows[1:], strict=False)):
        rows.sort(key=lambda r: r.t)
    return rows


def load_trace(path: Path, fmt: TraceFormat = "auto") -> list[TraceRow]:
    """A trace JSONL or a ``kvferry bench serve --request-log`` file (``fmt``; ``auto`` tells them apart)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_rows(text.splitlines(), str(path), fmt)


def write_trace(rows: Sequence[TraceRow], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(row.model_dump_json(exclude_none=True, exclude_defaults=True) + "\n")
