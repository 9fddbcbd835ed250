"""SchedulerConfig (the limits of one step), and what the scheduler builds while it plans a step."""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field

from services.engine.core.outputs import CachedRequestData, NewRequestData


class SchedulerConfig(BaseModel):
    """Limits of one engine step."""

    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int = Field(2048, ge=1)
    # False (encoder models): a prompt runs whole in one step or waits for a step with room for it
    chunked_prefill: bool = True
    max_loras: int = Field(0, ge=0)  # distinct LoRA adapters among running requests (0: LoRA off)
    # speculative decoding with a draft model: slots it writes past a sampling request's tokens
    num_lookahead_tokens: int = Field(0, ge=0)
    # vision-language models: image feature tokens the encoder may compute in one step
    max_num_encoder_input_tokens: int = Field(2048, ge=1)


class Admit(enum.Enum):
    """What became of a waiting request the scheduler looked at."""

    SCHEDULED = "scheduled"  # runs in this step
    LOADING = "loading"  # parked in WAITING_FOR_REMOTE_KV while a connector loads its KV
    SKIPPED = "skipped"  # a connector does not know yet: look again next step, keep its place
    BLOCKED = "blocked"  # not enough free blocks: nothing behind it is admitted either (FCFS)


class StepPlan:
    """Accumulates one step's decisions while ``schedule`` runs."""

    def __init__(self, budget: int, encoder_budget: int) -> None:
        self.budget = budget
        self.encoder_budget = encoder_budget
        self.encoder_inputs: list[tuple[str, int]] = []  # (request, index of its image) to encode now
        self.new: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []
        self.tokens: list[tuple[str, int]] = []
        self.spec: list[tuple[str, tuple[int, ...]]] = []
        self.preempted: set[str] = set()
