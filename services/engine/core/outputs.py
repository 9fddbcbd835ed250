"""Frozen value objects passed between the scheduler, the model runner and the front end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.openai.protocol_common import FinishReason
from services.engine.core.mm_input import MMInput
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has no state for (first schedule, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    pooling: PoolingParams | None = None  # an embedding request: pool its prompt, sample nothing
    lora_name: str | None = None  # the LoRA adapter it runs under
    # leading tokens whose KV this engine computed itself (the rest came through a connector): a draft
    # model's own KV exists only for these
    num_local_kv_tokens: int = 0
    mm_inputs: tuple[MMInput, ...] = ()  # its images: their features replace the placeholder embeddings


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A request the runner already knows: only what changed."""

    req_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_blocks_before: int = (
        -1
    )  # its blocks before new_block_ids (fewer than the runner's: tail blocks freed)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What to run in one step: requests in batch order and how many tokens each computes."""

    new_reqs: tuple[NewRequestData, ...]
    cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: tuple[tuple[str, int], ...]
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    # speculative decoding: the draft tokens each request verifies (they are counted in its scheduled tokens)
    spec_token_ids: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # vision-language models: (request, index of its image) the encoder runs, as one batch, before the LM;
    # and the images whose features the runner drops (evicted from the encoder cache)
    encoder_inputs: tuple[tuple[str, int], ...] = ()
    freed_encoder_hashes: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Log-probability of the sampled token and the top-n alternatives (token id, logprob), best first."""

    token_logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Per scheduled request: sampled tokens (empty for a partial prefill chunk) and their logprobs.

    With speculative decoding a request samples its accepted draft tokens and one more; ``logprobs``
    holds one entry per sampled token when the request asked for them (else it is empty).
    """

    req_ids: tuple[str, ...]
    sampled_token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[Logprobs, ...], ...]
    failed_req_ids: frozenset[str] = frozenset()
    error: str | None = None
    # (req_id, index of the first prompt token covered, logprobs of those prompt tokens) per prompt chunk
    prompt_logprobs: tuple[tuple[str, int, tuple[Logprobs, ...]], ...] = ()
    pooled: tuple[
        tuple[str, tuple[float, ...]], ...
    ] = ()  # (req_id, embedding) of finished embedding requests
    spec_token_ids: tuple[tuple[str, tuple[int, ...]], ...] = ()  # drafts proposed for the next step


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[Logprobs, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = (
        None  # prefill: where the prompt's blocks are (for a decode engine)
    )
    queue_time_s: float | None = None  # arrival in the engine to first scheduled
    prompt_logprobs: tuple[Logprobs | None, ...] | None = (
        None  # with the first token; None for prompt token 0
    )
    embedding: tuple[float, ...] | None = None  # an embedding request's result (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
