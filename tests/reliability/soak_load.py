"""SoakLoad: closed-loop clients at saturation with a realistic mix, and the per-window figures of a soak.

Each client loops until the deadline: ~5% bad requests (each must get a 4xx), ~10% streams dropped at a
random chunk, the rest valid (half streamed, half not) over shared-prefix or random prompts; every
valid request must answer 200 and, streamed, end with [DONE] and no error event. ``ProcessProbe`` reads
a process's RSS and open file descriptors from /proc.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common.openai.sse import aiter_sse

BAD_BODIES = [
    b'{"model": "MODEL", "prompt": "hi", "temperature": -1}',
    b'{"model": "MODEL", "prompt": ""}',
    b'{"model": "MODEL", "prompt": "hi", "max_tokens": "lots"}',
    b'{"model": "no-such-model", "prompt": "hi"}',
    b'{"model": "MODEL", "prompt": [1, 2',  # truncated JSON
]


@dataclass
class ProcessProbe:
    """RSS (MB) and open fds of one process, read from /proc."""

    name: str
    pid: int

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for {self.name}")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


@dataclass
class Outcome:
    kind: str  # valid-stream, valid-json, dropped, bad
    ok: bool
    at: float  # seconds since the start
    ttft: float | None = None
    detail: str = ""


@dataclass
class SoakLoad:
    url: str
    model: str
    clients: int
    duration_s: float
    seed: int = 0
    prefixes: int = 4
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self) -> list[Outcome]:
        self._start = time.monotonic()
        limits = httpx.Limits(max_connections=self.clients * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as http:
            await asyncio.gather(
                *(self._client(http, random.Random(self.seed * 1000 + i)) for i in range(self.clients))
            )
        return self.outcomes

    async def _client(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        while time.monotonic() - self._start < self.duration_s:
            roll = rng.random()
            at = time.monotonic() - self._start
            try:
                if roll < 0.05:
                    outcome = await self._bad(http, rng, at)
                elif roll < 0.15:
                    outcome = await self._stream(http, self._body(rng), at, drop_after=rng.randint(1, 6))
                elif roll < 0.575:
                    outcome = await self._stream(http, self._body(rng), at)
                else:
                    outcome = await self._json(http, self._body(rng), at)
            except httpx.HTTPError as exc:
                outcome = Outcome("valid-?", False, at, detail=repr(exc))
            self.outcomes.append(outcome)

    def _body(self, rng: random.Random) -> dict:
        if rng.random() < 0.5:  # a shared system-prompt-like prefix (48-160 tokens) and a short tail
            head = random.Random(rng.randrange(self.prefixes)).choices(
                range(3, 400), k=48 + 16 * rng.randrange(8)
            )
            prompt = head + [rng.randrange(3, 400) for _ in range(rng.randint(1, 24))]
        else:
            prompt = [rng.randrange(3, 400) for _ in range(rng.randint(8, 200))]
        return {"model": self.model, "prompt": prompt, "max_tokens": rng.randint(4, 48), "temperature": 0.7,
                "seed": rng.randrange(1 << 30)}  # fmt: skip

    async def _bad(self, http: httpx.AsyncClient, rng: random.Random, at: float) -> Outcome:
        body = rng.choice(BAD_BODIES).replace(b"MODEL", self.model.encode())
        r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        return Outcome("bad", 400 <= r.status_code < 500, at, detail=f"{r.status_code} {r.text[:200]}")

    async def _json(self, http: httpx.AsyncClient, body: dict, at: float) -> Outcome:
        start = time.monotonic()
        r = await http.post("/v1/completions", json=body)
        ok = r.status_code == 200 and bool(r.json().get("choices"))
        return Outcome("valid-json", ok, at, time.monotonic() - start, f"{r.status_code} {r.text[:200]}")

    async def _stream(self, http: httpx.AsyncClient, body: dict, at: float, drop_after: int = 0) -> Outcome:
        start, ttft, chunks, done, error = time.monotonic(), None, 0, False, None
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return Outcome(
                    "dropped" if drop_after else "valid-stream", False, at, detail=str(r.status_code)
                )
            async for event in aiter_sse(r.aiter_bytes()):  # CR/LF line ends only, as SSE defines them
                if event.is_done:
                    done = True
                elif "error" in (data := event.json()):
                    error = data["error"]
                else:
                    chunks += 1
                    ttft = ttft if ttft is not None else time.monotonic() - start
                    if drop_after and chunks >= drop_after:
                        return Outcome("dropped", True, at, ttft)  # leaving closes the connection
        ok = done and error is None and chunks > 0
        return Outcome(
            "dropped" if drop_after else "valid-stream", ok, at, ttft, f"done={done} error={error}"
        )


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def windows(outcomes: list[Outcome], window_s: float) -> list[dict]:
    """Per window: requests, failures, streamed p99 TTFT (ms)."""
    out: dict[int, dict] = {}
    for o in outcomes:
        w = out.setdefault(int(o.at // window_s), {"requests": 0, "failed": 0, "ttfts": []})
        w["requests"] += 1
        w["failed"] += not o.ok
        if o.ttft is not None and o.kind != "valid-json":
            w["ttfts"].append(o.ttft)
    rows = []
    for index in sorted(out):
        w = out[index]
        tail = p99(w.pop("ttfts"))
        rows.append({"window": index, **w, "p99_ttft_ms": None if tail is None else round(tail * 1000, 1)})
    return rows
