"""Scheduler: one token budget per step shared by decodes and chunked prefills, with preemption."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from pydantic import BaseModel, Field

from services.engine.kv_cache_manager import KVCacheManager
from services.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from services.engine.request import Request, RequestStatus
from services.engine.scheduler_transfers import LEASABLE as _LEASABLE
from services.engine.scheduler_transfers import TransferScheduling


class SchedulerConfig(BaseModel):
    """Limits of one engine step."""

    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int = Field(2048, ge=1)


class _StepPlan:
    """Accumulates one step's decisions while ``schedule`` runs."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.new: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []
        self.tokens: list[tuple[str, int]] = []
        self.preempted: set[str] = set()


class Scheduler(TransferScheduling):
    """Running requests first (in order), then waiting ones FCFS; preempts the newest when blocks run out.

    Prefill/decode roles and the kvstore tier add admission steps (see TransferScheduling).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, connector: Any = None,
                 store: Any = None, store_offloads: bool = True) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector  # KVConnector for prefill/decode roles (None: aggregated only)
        self.store = store  # KVStoreTier: the shared kvstore (None: not configured)
        self.store_offloads = store_offloads  # decode engines do not: prefill already offloaded the prompt
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, blocks being received
        self.leased: dict[str, Request] = {}  # finished prefills whose blocks wait for a decode read
        self._aborted_loads: set[str] = set()  # finished while receiving: free once the read ends
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.priority:
            pos = next((i for i, r in enumerate(self.waiting) if r.priority > request.priority), None)
            if pos is not None:
                self.waiting.insert(pos, request)
                return
        self.waiting.append(request)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, stop string, error); frees their blocks."""
        done = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self._aborted_loads.add(req_id)  # NIXL may still write into its blocks
            else:
                self.waiting.remove(request)
            request.transition(status)
            self._release(request)
            done.append(request)
        return done

    def _release(self, request: Request) -> None:
        rid = request.request_id
        if self.store is not None and request.status in _LEASABLE and self.store_offloads:
            self._offload(request)
        if rid in self._aborted_loads:
            pass  # blocks are freed when the in-flight read completes
        elif request.keeps_kv_for_decode and self.connector is not None and request.status in _LEASABLE:
            self._lease(request)
        else:
            if request.kv_transfer_params is not None and request.needs_remote_kv and self.connector is not None:
                self.connector.release_remote(request.kv_transfer_params)
            self.kv.free(request)
        del self.requests[rid]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        self._poll_transfers()
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        finished = frozenset(self._finished_since_last_step)
        self._finished_since_last_step = set()
        return SchedulerOutput(
            new_reqs=tuple(plan.new),
            cached_reqs=tuple(plan.cached),
            num_scheduled_tokens=tuple(plan.tokens),
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - plan.budget,
            finished_req_ids=finished,
            preempted_req_ids=frozenset(plan.preempted),
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = self.kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            plan.cached.append(
                CachedRequestData(
                    request.request_id, tuple(b.block_id for b in new_blocks), request.num_computed_tokens
                )
            )
            plan.tokens.append((request.request_id, num_new))
            plan.budget -= num_new
            i += 1

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        request.transition(RequestStatus.PREEMPTED)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._known_to_runner.discard(request.request_id)
        plan.preempted.add(request.request_id)
        self.waiting.appendleft(request)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.needs_remote_kv and self.connector is not None:
                if not self._start_remote_load(request):
                    break
                continue
            if self._should_fetch(request):
                self._start_fetch(request)
                continue
            if request.fetched is not None:
                if not self._install_fetched(request):
                    break
                continue
            if request.request_id in self.kv.req_to_blocks:  # holds received KV already
                computed, num_computed = [], request.num_computed_tokens
            else:
                computed, num_computed = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_computed, plan.budget)
            new_blocks = self.kv.allocate_slots(request, num_new, computed, num_computed)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if request.queue_time_s is None:
                request.queue_time_s = time.monotonic() - request.arrival_time
            request.num_computed_tokens = num_computed
            request.transition(RequestStatus.RUNNING)
            self.running.append(request)
            self._known_to_runner.add(request.request_id)
            plan.new.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=tuple(request.prompt_token_ids),
                    output_token_ids=tuple(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=tuple(self.kv.block_ids(request.request_id)),
                    num_computed_tokens=num_computed,
                )
            )
            plan.tokens.append((request.request_id, num_new))
            plan.budget -= num_new

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance every scheduled request by its computed tokens and its sampled token."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        logprobs = dict(zip(result.req_ids, result.logprobs, strict=True))
        for req_id, first, entries in result.prompt_logprobs:
            if (req := self.requests.get(req_id)) is not None:
                req.add_prompt_logprobs(first, entries)
        outputs = []
        for req_id, num_tokens in sched.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if req_id in result.failed_req_ids:
                self.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(req_id, (), finish_reason="error", error=result.error))
                continue
            request.num_computed_tokens += num_tokens
            new_tokens = sampled.get(req_id, ())
            for token in new_tokens:
                request.append_output_token(token)
            status = self._check_stop(request) if new_tokens else None
            if status is not None:
                self.finish_requests([req_id], status)
            kv_out = request.remote_kv_out.model_dump(mode="json") if request.remote_kv_out else None
            if new_tokens or status is not None:
                lp = logprobs.get(req_id)
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        tuple(new_tokens),
                        (lp,) if lp is not None else (),
                        finish_reason=status.value if status else None,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        kv_transfer_params=kv_out,
                        queue_time_s=request.queue_time_s,
                        prompt_logprobs=request.take_prompt_logprobs() if new_tokens else None,
                    )
                )
        return outputs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params, token = request.sampling_params, request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
