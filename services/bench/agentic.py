"""AgenticRun: the ``--dataset agentic`` workload of ``kvferry bench serve``.

Sessions of many turns share one system prompt (``--prefix-len`` tokens); each turn sends the whole
history so far (system, every earlier turn's input and answer) plus ``--input-len`` new tokens (the user's
or a tool's), asks for ``--output-len`` tokens, then pauses (a tool call, ``--tool-pause`` s on average)
before the next. At turn ``--turns // 2`` a session forks ``--subagents`` sub-agents: each continues from
the parent's context with a task of its own for two turns, concurrently; the parent resumes with their
answers. Every request carries ``x-session-id`` (``sN``, sub-agents ``sN/aK``). It reports per-turn TTFT,
session completion time and the prefix hit rate (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel

from services.bench.client import RequestResult, Target, consume_stream, error_message
from services.bench.datasets import BenchRequest, TokenSpace

SUB_TURNS = 2


class AgenticSummary(BaseModel):
    """What one agentic run measured (seconds; ``prefix_hit_rate`` None when the server reports no cache)."""

    sessions: int
    requests: int
    failed: int
    duration_s: float
    turn_ttft_p50_s: float | None
    turn_ttft_p90_s: float | None
    session_p50_s: float | None
    session_p90_s: float | None
    prefix_hit_rate: float | None

    def table(self) -> str:
        rows = [(k.replace("_", " "), v) for k, v in self.model_dump().items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(
            f"{k:<{width}}  {'-' if v is None else round(v, 4) if isinstance(v, float) else v}"
            for k, v in rows
        )


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class AgenticRun:
    """One run's shape, target and results."""

    target: Target
    space: TokenSpace
    sessions: int
    turns: int
    system_len: int
    turn_len: int
    output_len: int
    subagents: int
    tool_pause_s: float
    seed: int = 0
    results: list[RequestResult] = field(default_factory=list)
    session_times: list[float] = field(default_factory=list)
    sent: list[BenchRequest] = field(default_factory=list)  # every request, in sending order (--request-log)
    started: float = 0.0  # perf_counter at the run's start (requests' start times are relative to it)

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return [self.space.ids[rng.randrange(len(self.space.ids))] for _ in range(n)]

    async def _send(self, client: httpx.AsyncClient, history: list[int], session: str) -> RequestResult:
        request = BenchRequest(
            tuple(history), self.space.decode(history), self.output_len, session, len(history)
        )
        t0 = time.perf_counter()
        result = RequestResult(prompt_len=len(history), start=t0 - self.started, index=len(self.sent))
        self.sent.append(request)
        try:
            headers = {"x-session-id": session}
            async with client.stream(
                "POST", self.target.url, json=self.target.payload(request), headers=headers
            ) as reply:
                if reply.status_code != 200:
                    result.error = error_message(reply.status_code, await reply.aread())
                else:
                    await consume_stream(reply, result, self.target.endpoint, t0)
                    result.success = True
        except Exception as exc:  # a benchmark reports failures, it does not stop on them
            result.error = f"{type(exc).__name__}: {exc}"
        result.latency = time.perf_counter() - t0
        self.results.append(result)
        return result

    async def _turns(
        self,
        client: httpx.AsyncClient,
        rng: random.Random,
        history: list[int],
        session: str,
        turns: int,
        fork: bool,
    ) -> list[int]:
        """Run ``turns`` turns on ``history`` (forking sub-agents half-way when ``fork``); the history after."""
        for turn in range(turns):
            await self._send(client, history, session)
            history = history + self._tokens(rng, self.output_len)  # the answer, as the next turn sends it
            if fork and self.subagents and turn == turns // 2:
                tasks = [
                    self._turns(
                        client,
                        random.Random(rng.random()),
                        history + self._tokens(rng, self.turn_len),
                        f"{session}/a{k}",
                        SUB_TURNS,
                        False,
                    )
                    for k in range(self.subagents)
                ]
                for sub in await asyncio.gather(*tasks):
                    history = history + sub[-self.output_len :]  # each sub-agent's last answer comes back
            if turn + 1 < turns:
                if self.tool_pause_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / self.tool_pause_s))
                history = history + self._tokens(rng, self.turn_len)
        return history

    async def run(self, max_concurrency: int | None) -> AgenticSummary:
        system = self._tokens(random.Random(self.seed), self.system_len)
        gate = asyncio.Semaphore(max_concurrency or self.sessions)
        timeout = httpx.Timeout(self.target.timeout, pool=None)

        async def session(client: httpx.AsyncClient, i: int) -> None:
            rng = random.Random(self.seed * 1_000_003 + i)
            async with gate:
                t0 = time.perf_counter()
                await self._turns(
                    client, rng, system + self._tokens(rng, self.turn_len), f"s{i}", self.turns, True
                )
                self.session_times.append(time.perf_counter() - t0)

        self.started = time.perf_counter()
        async with httpx.AsyncClient(headers=self.target.headers(), timeout=timeout) as client:
            await asyncio.gather(*(session(client, i) for i in range(self.sessions)))
        return self.summary(time.perf_counter() - self.started)

    def summary(self, duration: float) -> AgenticSummary:
        ok = [r for r in self.results if r.success]
        ttfts = [r.ttft for r in ok]
        prompt = sum(r.prompt_len for r in ok)
        cached = sum(r.cached_len for r in ok)
        return AgenticSummary(
            sessions=self.sessions,
            requests=len(self.results),
            failed=len(self.results) - len(ok),
            duration_s=duration,
            turn_ttft_p50_s=statistics.median(ttfts) if ttfts else None,
            turn_ttft_p90_s=_pct(ttfts, 0.9),
            session_p50_s=statistics.median(self.session_times) if self.session_times else None,
            session_p90_s=_pct(self.session_times, 0.9),
            prefix_hit_rate=cached / prompt if prompt and any(r.usage_seen for r in ok) else None,
        )
