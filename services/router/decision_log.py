"""DecisionLog: the router's last routing decisions (engine, score per scorer, P/D choice), bounded.

Records carry ids, lengths and addresses only: never prompt text or token ids (the pool page shows them).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from services.router.prompt import PreparedRequest
from services.router.scheduling import Endpoint, RequestContext, RouteDecision
from services.router.scheduling.strategies import Choice

DECISIONS_KEPT = 100
_TIERS: tuple[Literal["gpu", "cpu", "kvstore", "disk", "routed"], ...] = (
    "gpu",
    "cpu",
    "kvstore",
    "disk",
    "routed",
)
Mode = Literal["aggregated", "disaggregated", "decode_only"]


class Candidate(BaseModel):
    """One endpoint the strategy weighed: its total and each scorer's weighted part (empty: round-robin)."""

    url: str
    total: float | None = None
    parts: dict[str, float] = {}
    cached_tokens: int = 0  # leading prompt tokens it holds in any tier
    tiers: dict[
        str, int
    ] = {}  # leading prompt blocks it holds per tier (gpu, cpu, kvstore, disk, routed), nonzero
    chosen: bool = False


class DecisionRecord(BaseModel):
    """One pick of the scheduler (a retry on another engine is a record of its own, ``attempt`` 1)."""

    seq: int
    at: float  # unix time
    request_id: str
    attempt: int
    kind: str  # completion | chat
    stream: bool
    prompt_tokens: int
    prompt_blocks: int
    lora: str | None = None
    index: Literal[
        "ok", "down", "off"
    ]  # the prefix index's answer: used, failed (load only), none configured
    decode: str
    prefill: str | None = None
    mode: Mode
    cached_tokens: int  # on the chosen decode endpoint, any tier
    uncached_tokens: int
    pd_reason: str
    route_ms: float  # HTTP arrival to this pick: parse, tokenize, hash, look up, schedule
    candidates: list[Candidate]
    prefill_candidates: list[Candidate] = []
    session: str | None = None  # session affinity: the session key and what it decided (sticky, moved, new)
    affinity: str | None = None


def _candidates(choice: Choice | None, ctx: RequestContext) -> list[Candidate]:
    """Every endpoint the strategy scored (round-robin scores none: only the chosen one)."""
    if choice is None:
        return []
    urls = list(choice.scores) or [choice.endpoint.url]
    out = []
    for url in urls:
        match = ctx.match(Endpoint(url))
        tiers = {t: match.blocks(t) for t in _TIERS if match.blocks(t)} if match else {}
        out.append(
            Candidate(
                url=url,
                total=choice.scores.get(url),
                parts=dict(choice.parts.get(url, {})),
                cached_tokens=ctx.cached_tokens(Endpoint(url)),
                tiers=tiers,
                chosen=url == choice.endpoint.url,
            )
        )
    return out


def pd_reason(decision: RouteDecision, ctx: RequestContext, threshold: int) -> str:
    """Why the request was (not) split into prefill + decode, in words."""
    uncached = decision.uncached_tokens
    if decision.prefill is not None:
        return f"{uncached} uncached tokens >= threshold {threshold}: a prefill engine computes them"
    if decision.decode.role == "both":
        return "aggregated pool: the engine computes the whole prompt"
    if not ctx.splittable:
        return "decode computes the prompt: several prompts or prompt logprobs cannot be handed off"
    if uncached < threshold:
        return f"{uncached} uncached tokens < threshold {threshold}: decode computes the rest itself"
    return f"{uncached} uncached tokens >= threshold {threshold}, but no prefill engine was eligible"


@dataclass(frozen=True, slots=True)
class _Pick:
    """What ``add`` keeps of one pick (cheap, on the request's path); the record is built when read."""

    seq: int
    at: float
    request_id: str
    attempt: int
    kind: str
    stream: bool
    lora: str | None
    route_ms: float
    decision: RouteDecision
    ctx: RequestContext


class DecisionLog:
    """The last ``capacity`` decisions, oldest dropped first, and counts by mode since start.

    ``threshold`` is the router's --pd-threshold; ``has_index`` whether it has a prefix index (Redis).
    ``add`` keeps references only (no prompt: ids and lengths); records are built by ``recent``.
    """

    def __init__(
        self,
        threshold: int,
        has_index: bool,
        capacity: int = DECISIONS_KEPT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.threshold = threshold
        self.has_index = has_index
        self._picks: deque[_Pick] = deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self.clock = clock
        self.counts: Counter[str] = Counter()

    def add(
        self,
        decision: RouteDecision,
        req: PreparedRequest,
        ctx: RequestContext,
        request_id: str,
        attempt: int,
    ) -> None:
        """Note one pick of the scheduler."""
        route_ms = max(time.perf_counter() - req.arrival, 0.0) * 1000
        pick = _Pick(
            seq=next(self._seq),
            at=self.clock(),
            request_id=request_id,
            attempt=attempt,
            kind=req.kind,
            stream=req.stream,
            lora=req.lora_name,
            route_ms=route_ms,
            decision=decision,
            ctx=ctx,
        )
        self._picks.append(pick)
        self.counts[decision.mode] += 1

    def recent(self, limit: int | None = None) -> list[DecisionRecord]:
        """Newest first, at most ``limit``."""
        picks = list(reversed(self._picks))
        return [self._record(p) for p in (picks if limit is None else picks[:limit])]

    def _record(self, pick: _Pick) -> DecisionRecord:
        decision, ctx = pick.decision, pick.ctx
        index: Literal["ok", "down", "off"] = "off"
        if self.has_index:
            index = "down" if ctx.matches is None else "ok"
        return DecisionRecord(
            seq=pick.seq,
            at=pick.at,
            request_id=pick.request_id,
            attempt=pick.attempt,
            kind=pick.kind,
            stream=pick.stream,
            prompt_tokens=ctx.prompt_tokens,
            prompt_blocks=ctx.prompt_blocks,
            lora=pick.lora,
            index=index,
            decode=decision.decode.url,
            prefill=decision.prefill.url if decision.prefill else None,
            mode=decision.mode,
            cached_tokens=decision.cached_tokens,
            uncached_tokens=decision.uncached_tokens,
            pd_reason=pd_reason(decision, ctx, self.threshold),
            route_ms=pick.route_ms,
            candidates=_candidates(decision.decode_choice, ctx),
            prefill_candidates=_candidates(decision.prefill_choice, ctx),
            session=ctx.session,
            affinity=ctx.affinity,
        )
