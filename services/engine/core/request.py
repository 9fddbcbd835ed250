"""Request and RequestStatus: one generation request's state machine and token bookkeeping."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

from services.common.kv.kv_transfer import KVTransferParams
from services.common.openai.protocol_common import FinishReason
from services.engine.core.engine_request import EngineRequest
from services.engine.core.mm_input import MMInput
from services.engine.core.outputs import Logprobs
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The API's finish_reason of a finished status; None while the request is not finished."""
        return _FINISH_REASONS.get(self)

    @property
    def completed(self) -> bool:
        """Finished by a stop condition or the length limit (not aborted, not failed): its KV is whole."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_S = RequestStatus
_FINISH_REASONS: Mapping[RequestStatus, FinishReason] = MappingProxyType(
    {
        _S.FINISHED_STOPPED: "stop",
        _S.FINISHED_LENGTH: "length",
        _S.FINISHED_ABORTED: "abort",
        _S.FINISHED_ERROR: "error",
    }
)
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.WAITING_FOR_REMOTE_KV}) | _FINISHED,
    _S.WAITING_FOR_REMOTE_KV: frozenset({_S.WAITING, _S.RUNNING}) | _FINISHED,
    _S.RUNNING: frozenset({_S.PREEMPTED}) | _FINISHED,
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.WAITING_FOR_REMOTE_KV}) | _FINISHED,  # resumed from a connector
}


class GrammarGate(Protocol):
    """A structured-output request's grammar as the scheduler sees it: admit the request once ready."""

    @property
    def ready(self) -> bool: ...


class InvalidTransition(RuntimeError):
    """A request was asked to move between states that are not connected."""


class Request:
    """A request as the scheduler sees it: tokens, progress, status and prefix-cache hashes."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        hash_fn: Callable[[list[bytes], list[int]], list[bytes]] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        kv_transfer_params: KVTransferParams | None = None,
        pooling: PoolingParams | None = None,
        lora_name: str | None = None,
        mm_inputs: tuple[MMInput, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.mm_inputs = mm_inputs  # its images (vision-language models), in prompt order
        self.lora_name = lora_name  # the LoRA adapter it runs under (None: the base model)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []  # draft tokens to verify in its next step (speculative decoding)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set when first scheduled
        self.num_preemptions = 0
        self.queue_time_s: float | None = None  # arrival to first scheduled, set once
        self.stop_reason: int | str | None = None
        # P/D: do_remote_decode (prefill keeps the KV) or do_remote_prefill (decode pulls it, once)
        self.kv_transfer_params = kv_transfer_params
        self.remote_kv_out: KVTransferParams | None = (
            None  # what a connector answers (prefill: where the blocks are)
        )
        # the router can continue it elsewhere: on drain its KV is leased instead of dropped (migrate_out)
        self.migratable = kv_transfer_params is not None and kv_transfer_params.migrate_on_drain
        self.migrating_out = False
        # prompt logprobs: the first prompt token has none; filled chunk by chunk, sent (and dropped) with the
        # first generated token
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.grammar: GrammarGate | None = None  # set for constrained requests (compiled off the step)
        self.pooling = pooling  # an embedding request: finished with its pooled prompt, nothing sampled
        self._hash_fn = hash_fn
        self.spec: EngineRequest | None = None  # the request as it entered the engine (``of``)
        self.block_hashes: list[bytes] = []
        if hash_fn is not None:
            hash_fn(self.block_hashes, self.all_token_ids)

    @classmethod
    def of(
        cls,
        request: EngineRequest,
        eos_token_id: int | None,
        hash_fn: Callable[[list[bytes], list[int]], list[bytes]] | None = None,
    ) -> Request:
        """The scheduler's state of an engine request (which it keeps, as ``spec``)."""
        state = cls(
            request.request_id,
            list(request.prompt_token_ids),
            request.params,
            eos_token_id,
            hash_fn=hash_fn,
            priority=request.priority,
            kv_transfer_params=request.kv_transfer_params,
            pooling=request.pooling,
            lora_name=request.lora_name,
            mm_inputs=request.mm_inputs,
        )
        state.spec = request
        return state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_remote_kv(self) -> bool:
        p = self.kv_transfer_params
        return p is not None and p.do_remote_prefill

    @property
    def keeps_kv_for_decode(self) -> bool:
        p = self.kv_transfer_params
        return p is not None and p.do_remote_decode

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def needs_whole_prompt(self) -> bool:
        """Every prompt token must be computed here, in this request: no prefix-cache, kvstore or remote KV
        reuse (prompt logprobs score each token; embeddings pool every token's hidden state)."""
        return self.needs_prompt_logprobs or self.pooling is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Every prompt token must be computed here: no prefix-cache, kvstore or remote KV reuse."""
        return self.sampling_params.prompt_logprobs is not None

    def add_prompt_logprobs(self, first: int, entries: tuple[Logprobs, ...]) -> None:
        """Record prompt tokens first..; a recompute after preemption repeats known ones, which are kept."""
        have = self.prompt_logprobs
        if have is not None and first <= len(have):
            have.extend(entries[len(have) - first :])

    def take_prompt_logprobs(self) -> tuple[Logprobs | None, ...] | None:
        """The complete prompt logprobs, once (they go out with the first generated token)."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return tuple(taken) if taken is not None else None

    def append_output_token(self, token_id: int) -> None:
        """Record one generated token and hash any block it completes."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self._hash_fn is not None:
            self._hash_fn(self.block_hashes, self.all_token_ids)

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """The finished status its last generated token brings (eos, a stop id, max_tokens, the context
        length), or None; a stop id becomes ``stop_reason``. Before ``min_tokens`` only a constrained
        request can stop (its grammar allowed nothing but a stop token)."""
        params, token = self.sampling_params, self.output_token_ids[-1]
        # the sampler masks stop tokens before min_tokens unless an output constraint allows nothing else:
        # a constrained request that sampled one has ended its grammar, and the grammar's end wins
        if self.num_output_tokens >= params.min_tokens or params.structured_outputs is not None:
            if token == self.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def transition(self, new_status: RequestStatus) -> None:
        """Move to ``new_status``; raises InvalidTransition when that edge does not exist."""
        if new_status not in _ALLOWED.get(self.status, frozenset()):
            raise InvalidTransition(f"request {self.request_id}: {self.status.name} -> {new_status.name}")
        self.status = new_status

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
