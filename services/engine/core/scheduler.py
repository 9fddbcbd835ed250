"""Scheduler: one token budget per step shared by decodes and chunked prefills, with preemption."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from services.engine.core.block_pool import KVCacheBlock
from services.engine.core.encoder_cache_manager import EncoderCacheManager, plan_encoder
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.kv_connector import FinishedTransfers, KVConnector, NullConnector
from services.engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from services.engine.core.request import Request, RequestStatus
from services.engine.core.spec_stats import SpecDecodingStats, draft_room
from services.engine.core.step_plan import Admit, StepPlan
from services.engine.core.step_plan import SchedulerConfig as SchedulerConfig


class Scheduler:
    """Running requests first (in order), then waiting ones FCFS; preempts the newest when blocks run out.

    KV that enters or leaves the engine (P/D, the kvstore) goes through one ``KVConnector``: external
    prefix tokens are asked for after the local prefix hit, loads park a request in
    WAITING_FOR_REMOTE_KV, and finished requests may keep their blocks until the connector lets go.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        connector: KVConnector | None = None,
        encoder_cache: EncoderCacheManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector: KVConnector = connector or NullConnector()
        self.encoder = encoder_cache  # vision-language models: the runner's image features
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV: a connector writes their blocks
        self.delayed_free: dict[str, Request] = {}  # finished; blocks kept until the connector lets go
        self.exports: dict[
            str, list[KVCacheBlock]
        ] = {}  # cached prefixes pinned for a peer's read (by lease id)
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()

    # ------------------------------------------------------------------ queue management
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.delayed_free:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.requests[rid] = request
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
                del self.loading[req_id]
            else:
                self.waiting.remove(request)
            request.transition(status)
            self._release(request)
            done.append(request)
        return done

    def _release(self, request: Request) -> None:
        """The connector sees every finish: it may keep the blocks (a lease, a read in flight) and answer params."""
        rid = request.request_id
        delay_free, params = self.connector.request_finished(request, self.kv.block_ids(rid))
        if params is not None:
            request.remote_kv_out = params
        if delay_free:
            self.delayed_free[rid] = request
        else:
            self.kv.free(request)
        del self.requests[rid]
        if rid in self._known_to_runner:
            self._known_to_runner.discard(rid)
            self._finished_since_last_step.add(rid)

    def pin_export(self, lease_id: str, block_hashes: Sequence[bytes]) -> list[int]:
        """Pin the leading cached blocks of ``block_hashes`` until the connector lets ``lease_id`` go (a peer
        read them, said it will not, or the lease expired); their block ids (none: nothing cached)."""
        if lease_id in self.exports or lease_id in self.requests:
            raise ValueError(f"lease id {lease_id!r} is already in use")
        blocks = self.kv.pin_cached_prefix(block_hashes)
        if blocks:
            self.exports[lease_id] = blocks
        return [b.block_id for b in blocks]

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
        self._apply_finished(self.connector.get_finished())
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.max_num_encoder_input_tokens)
        if self.encoder is not None:
            self.encoder.begin_step()
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
            spec_token_ids=tuple(plan.spec),
            encoder_inputs=tuple(plan.encoder_inputs),
            freed_encoder_hashes=self.encoder.take_freed() if self.encoder is not None else (),
        )

    def _apply_finished(self, done: FinishedTransfers) -> None:
        """Free what the connector let go; loaded requests queue again with their KV, failed ones without."""
        if not done:
            return
        for rid in done.sent | done.received | done.failed:
            finished = self.delayed_free.pop(rid, None)
            if finished is not None:
                self.kv.free(finished)
            if (pinned := self.exports.pop(rid, None)) is not None:
                self.kv.unpin(pinned)
        for rid in done.received:
            if (request := self.loading.pop(rid, None)) is not None:
                self.kv.cache_full_blocks(request, request.num_computed_tokens)
                self._requeue(request)
        for rid in done.failed:
            if (request := self.loading.pop(rid, None)) is not None:
                self.kv.free(request)  # recompute; the connector that failed does not offer it again
                request.num_computed_tokens = 0
                self._requeue(request)

    def _requeue(self, request: Request) -> None:
        request.transition(RequestStatus.WAITING)
        self.waiting.appendleft(request)

    def _schedule_running(self, plan: StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            pending = request.num_tokens - request.num_computed_tokens
            num_new = min(pending + len(request.spec_token_ids), plan.budget)
            num_new = self._fit_encoder(request, request.num_computed_tokens, num_new, plan)
            if num_new <= 0:
                i += 1
                continue
            slots = num_new + (self.config.num_lookahead_tokens if num_new >= pending else 0)
            new_blocks = self.kv.allocate_slots(request, slots)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, slots)
            if new_blocks is None:
                break
            rid = request.request_id
            self._read_images(request, request.num_computed_tokens, num_new, plan)
            plan.cached.append(
                CachedRequestData(
                    rid,
                    tuple(b.block_id for b in new_blocks),
                    request.num_computed_tokens,
                    len(self.kv.blocks_of(rid)) - len(new_blocks),
                )
            )
            if num_new > pending:  # drafts the budget has room for (verified in this step)
                plan.spec.append((rid, tuple(request.spec_token_ids[: num_new - pending])))
            plan.tokens.append((rid, num_new))
            plan.budget -= num_new
            i += 1

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        request.transition(RequestStatus.PREEMPTED)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._known_to_runner.discard(request.request_id)
        plan.preempted.add(request.request_id)
        # Behind the waiting requests that hold received KV: they cannot be preempted, only run.
        holders = next(
            (i for i, r in enumerate(self.waiting) if r.request_id not in self.kv.req_to_blocks),
            len(self.waiting),
        )
        self.waiting.insert(holders, request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            outcome = self._admit(request, plan)
            if outcome is Admit.BLOCKED:
                self.waiting.appendleft(request)
                break
            if outcome is Admit.SKIPPED:
                skipped.append(request)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, plan: StepPlan) -> Admit:
        """Local prefix hit, then external tokens from the connector, then blocks for all of it."""
        rid = request.request_id
        if request.grammar is not None and not request.grammar.ready:
            return Admit.SKIPPED  # its grammar is still compiling: keep its place, let others go
        if request.lora_name and not self._lora_fits(request.lora_name):
            return Admit.SKIPPED  # every LoRA slot holds another running adapter: wait for one to drain
        holds_kv = rid in self.kv.req_to_blocks  # it received its KV: num_computed_tokens counts it
        computed: list[KVCacheBlock] = []
        num_local, num_external, load_async = 0, 0, False
        if not holds_kv:
            computed, num_local = self.kv.get_computed_blocks(request)
            if not request.needs_whole_prompt:  # prompt logprobs, embeddings: every token computed here
                match = self.connector.get_num_new_matched_tokens(request, num_local)
                if match is None:
                    return Admit.SKIPPED
                num_external, load_async = match[0], match[1] and match[0] > 0
        num_computed = request.num_computed_tokens + num_local + num_external
        num_new = 0 if load_async else min(request.num_tokens - num_computed, plan.budget)
        if not self.config.chunked_prefill and num_new < request.num_tokens - num_computed:
            return Admit.BLOCKED  # whole prompts only: it goes first in a later step
        num_new = self._fit_encoder(request, num_computed, num_new, plan)
        if not num_new and not load_async and num_computed < request.num_tokens:
            return Admit.BLOCKED  # its next image waits for encoder budget: it goes first in a later step
        samples = not load_async and num_computed + num_new == request.num_tokens
        lookahead = self.config.num_lookahead_tokens if samples else 0
        new_blocks = self.kv.allocate_slots(
            request, num_external + num_new + lookahead, computed, num_local, cache=not load_async
        )
        if new_blocks is None:
            return Admit.BLOCKED
        if not holds_kv:
            self.kv.record_prefix_query(request, num_local)
        if num_external:
            self.kv.mark_external(request, request.num_computed_tokens + num_local, num_external)
            self.connector.update_state_after_alloc(request, self.kv.block_ids(rid), num_external)
        request.num_computed_tokens = num_computed
        if load_async:
            request.transition(RequestStatus.WAITING_FOR_REMOTE_KV)
            self.loading[rid] = request
            return Admit.LOADING
        self._start_running(request, num_computed, num_new, plan)
        return Admit.SCHEDULED

    def _fit_encoder(self, request: Request, start: int, num_new: int, plan: StepPlan) -> int:
        """``num_new`` cut before the first image it reads that is neither cached nor within the encoder budget."""
        if self.encoder is None or not request.mm_inputs or num_new <= 0:
            return num_new
        return plan_encoder(self.encoder, request.mm_inputs, start, num_new, plan.encoder_budget)

    def _read_images(self, request: Request, start: int, num_new: int, plan: StepPlan) -> None:
        """The images the scheduled chunk reads: cached ones are hits, the others are encoded in this step."""
        if self.encoder is not None and request.mm_inputs:
            for i in self.encoder.read_chunk(request.mm_inputs, start, start + num_new):
                plan.encoder_inputs.append((request.request_id, i))
                plan.encoder_budget -= request.mm_inputs[i].num_embeds

    def _lora_fits(self, name: str) -> bool:
        """Whether a request of adapter ``name`` can run beside the running (and loading) requests."""
        active = {r.lora_name for r in (*self.running, *self.loading.values()) if r.lora_name}
        return name in active or len(active) < self.config.max_loras

    def _start_running(self, request: Request, num_computed: int, num_new: int, plan: StepPlan) -> None:
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        if request.queue_time_s is None:
            request.queue_time_s = time.monotonic() - request.arrival_time
        self._read_images(request, num_computed, num_new, plan)
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
                pooling=request.pooling,
                lora_name=request.lora_name,
                num_local_kv_tokens=self.kv.num_local_kv_tokens(request, num_computed),
                mm_inputs=request.mm_inputs,
            )
        )
        plan.tokens.append((request.request_id, num_new))
        plan.budget -= num_new

    # ------------------------------------------------------------------ results
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request by its computed tokens and its sampled token."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        logprobs = dict(zip(result.req_ids, result.logprobs, strict=True))
        verified, proposed = dict(sched.spec_token_ids), dict(result.spec_token_ids)
        for req_id, first, entries in result.prompt_logprobs:
            if (req := self.requests.get(req_id)) is not None:
                req.add_prompt_logprobs(first, entries)
        pooled = dict(result.pooled)
        outputs = []
        for req_id, num_tokens in sched.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if req_id in result.failed_req_ids:
                self.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(req_id, (), finish_reason="error", error=result.error))
                continue
            new_tokens = sampled.get(req_id, ())
            drafts = verified.get(req_id, ())
            if drafts and new_tokens:  # the drafts past the first mismatch were computed for nothing
                self.spec_stats.record(len(drafts), len(new_tokens) - 1)
                num_tokens -= len(drafts) - (len(new_tokens) - 1)
            request.num_computed_tokens += num_tokens
            if req_id in pooled:  # an embedding request is done once its prompt is pooled
                self.finish_requests([req_id], RequestStatus.FINISHED_STOPPED)
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        (),
                        finish_reason="stop",
                        embedding=pooled[req_id],
                        queue_time_s=request.queue_time_s,
                    )
                )
                continue
            new_tokens, status = self._append_tokens(request, new_tokens)
            if status is not None:
                self.finish_requests([req_id], status)
            else:
                self._next_drafts(request, proposed.get(req_id, ()), bool(drafts))
            kv_out = request.remote_kv_out.model_dump(mode="json") if request.remote_kv_out else None
            if new_tokens or status is not None:
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        new_tokens,
                        logprobs.get(req_id, ())[: len(new_tokens)],
                        finish_reason=status.finish_reason if status else None,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        kv_transfer_params=kv_out,
                        queue_time_s=request.queue_time_s,
                        prompt_logprobs=request.take_prompt_logprobs() if new_tokens else None,
                    )
                )
        return outputs

    def _append_tokens(
        self, request: Request, tokens: tuple[int, ...]
    ) -> tuple[tuple[int, ...], RequestStatus | None]:
        """Append sampled tokens one by one; an accepted run ends at the first stop condition it meets."""
        for n, token in enumerate(tokens, start=1):
            request.append_output_token(token)
            if (status := request.stop_status(self.config.max_model_len)) is not None:
                return tokens[:n], status
        return tokens, None

    def _next_drafts(self, request: Request, proposed: tuple[int, ...], verified: bool) -> None:
        """Keep what fits of the runner's proposals for the next step; free the blocks of this step's
        rejected drafts and of a draft model's lookahead (plain decoding has neither: nothing to do)."""
        if proposed or request.spec_token_ids:
            room = draft_room(
                request.num_tokens,
                request.num_output_tokens,
                request.sampling_params.max_tokens,
                self.config.max_model_len,
            )
            request.spec_token_ids = list(proposed[:room])
        if (verified or self.config.num_lookahead_tokens) and request.status == RequestStatus.RUNNING:
            self.kv.trim(request, request.num_tokens)
