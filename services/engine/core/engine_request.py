"""EngineRequest: one request as the engine takes it, built and validated once where it enters (the HTTP
layer or the offline LLM), then carried unchanged through the loop to the scheduler's Request."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.mm_input import MMInput
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """The prompt (token ids, images already expanded into placeholders) and everything that shapes it."""

    request_id: str  # a label until the engine gives it an id of its own (``with_id``)
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    prompt_text: str | None = None  # the prompt as text, when it came as text (echoed in outputs)
    cache_salt: str | None = None
    lora_name: str | None = None
    priority: int = 0
    index: int = 0  # the choice index (n > 1) within its API request
    kv_transfer_params: KVTransferParams | None = None
    pooling: PoolingParams | None = None  # an embedding request
    mm_inputs: tuple[MMInput, ...] = ()

    def with_id(self, request_id: str) -> EngineRequest:
        """The same request under the id the engine keys it by."""
        return replace(self, request_id=request_id)
