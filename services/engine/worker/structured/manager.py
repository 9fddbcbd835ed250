"""StructuredOutputManager: one grammar matcher per constrained request, the step's token bitmask, and
advancing the matchers on the tokens the step sampled (the engine loop calls it around each step)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from services.common.openai.protocol_structured import StructuredSpec
from services.common.openai.tokenizer import Tokenizer
from services.engine.core.outputs import SchedulerOutput
from services.engine.core.request import Request
from services.engine.worker.structured.grammars import GrammarCompiler, GrammarError, GrammarHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepConstraints:
    """The token bitmask of the step's constrained requests: row ``rows[req_id]`` of ``bitmask``."""

    rows: Mapping[str, int]
    bitmask: torch.Tensor  # [R, ceil(vocab / 32)] int32


@dataclass
class _Constrained:
    handle: GrammarHandle
    matcher: Any = None  # xgrammar.GrammarMatcher once the grammar is compiled
    accepted: int = 0  # output tokens the matcher has consumed (or skipped before ``after``)
    after: str | None = None  # the constraint starts once the output contains this text ("</think>")


class StructuredOutputManager:
    """Grammars per request; compiled off the engine step (the scheduler waits on ``Request.grammar``)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, list(stop_token_ids), self._record_compile)
        self.vocab_size = vocab_size
        self._requests: dict[str, _Constrained] = {}
        self.compile_seconds: list[float] = []  # drained by the metrics exporter
        self.num_constrained = 0

    def _record_compile(self, seconds: float) -> None:
        self.compile_seconds.append(seconds)  # list.append is atomic: the compile thread adds, scrapes take

    def take_compile_times(self) -> list[float]:
        """Compile durations since the last call (for the metrics histogram)."""
        taken, self.compile_seconds = self.compile_seconds, []
        return taken

    def add(self, request: Request, spec: StructuredSpec, after: str | None = None) -> None:
        """Start compiling ``spec`` for ``request``; it is scheduled once the grammar is ready.

        ``after``: the output is free until it contains this text (a reasoning model's end tag).
        """
        handle = self.compiler.submit(spec)
        request.grammar = handle
        self._requests[request.request_id] = _Constrained(handle, after=after)
        self.num_constrained += 1

    @property
    def active(self) -> bool:
        return bool(self._requests)

    def take_failures(self) -> list[tuple[str, GrammarError]]:
        """Requests whose grammar failed to compile (offline callers; the HTTP layer validates first)."""
        failed = [(rid, err) for rid, c in self._requests.items() if (err := c.handle.error()) is not None]
        for rid, _ in failed:
            del self._requests[rid]
        return failed

    def for_step(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> StepConstraints | None:
        """Bitmask rows for the constrained requests that sample in this step (their chunk ends the prompt)."""
        import xgrammar as xgr

        sampling = [
            rid
            for rid, n in sched.num_scheduled_tokens
            if rid in self._requests
            and (r := requests.get(rid)) is not None
            and r.num_computed_tokens + n >= r.num_tokens
            and self._started(self._requests[rid], r)
        ]
        if not sampling:
            return None
        bitmask = xgr.allocate_token_bitmask(len(sampling), self.vocab_size)
        rows: dict[str, int] = {}
        for i, rid in enumerate(sampling):
            state = self._requests[rid]
            matcher = self._matcher(state, requests[rid])
            matcher.fill_next_token_bitmask(bitmask, i)
            rows[rid] = i
        return StepConstraints(rows, bitmask)

    def _started(self, state: _Constrained, request: Request) -> bool:
        """False while the output has not reached ``after`` (those tokens are skipped, not matched)."""
        if state.after is None:
            return True
        text = self.compiler.decode(request.output_token_ids)
        if state.after not in text:
            return False
        state.after, state.accepted = None, len(request.output_token_ids)
        return True

    def _matcher(self, state: _Constrained, request: Request) -> Any:
        """The request's matcher, caught up with every output token it has (resumed or preempted requests too)."""
        if state.matcher is None:
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(state.handle.result())
        for token in request.output_token_ids[state.accepted :]:
            self._accept(state, token, request.request_id)
        return state.matcher

    def _accept(self, state: _Constrained, token: int, rid: str) -> None:
        if not state.matcher.is_terminated() and not state.matcher.accept_token(token):
            log.warning("grammar of %s rejected token %d (the mask should have forbidden it)", rid, token)
        state.accepted += 1

    def after_step(self, requests: Mapping[str, Request]) -> None:
        """Advance matchers on the tokens just sampled; forget requests that finished."""
        for rid in list(self._requests):
            request = requests.get(rid)
            if request is None:
                del self._requests[rid]
                continue
            state = self._requests[rid]
            if state.matcher is not None and state.after is None:
                for token in request.output_token_ids[state.accepted :]:
                    self._accept(state, token, rid)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def close(self) -> None:
        self.compiler.close()
