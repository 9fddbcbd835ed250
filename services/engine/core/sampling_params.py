"""SamplingParams: validated per-request generation settings (vLLM-compatible names)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.openai.protocol_structured import StructuredOutputs, StructuredSpec


class SamplingParams(BaseModel):
    """How to sample one request's tokens; invalid values raise ValueError naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20
    )  # logprobs of the prompt's tokens (top-n alternatives)
    skip_special_tokens: bool = True
    # an output constraint (JSON schema, regex, choice, grammar, structural tag); also accepts vLLM's
    # StructuredOutputsParams-style dict, e.g. {"json": schema} or {"regex": "a+"}
    structured_outputs: StructuredSpec | None = None
    # the constraint starts after this text appears in the output (a reasoning model's "</think>")
    structured_outputs_after: str | None = None
    # OpenAI logit_bias: token id -> bias in [-100, 100] added to that token's logit before sampling
    logit_bias: dict[int, float] | None = None
    # the prompt's last N tokens are this request's output from an earlier engine (a router resuming a
    # stream elsewhere): frequency and presence penalties count them as output
    resumed_output_tokens: int = Field(0, ge=0)

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured(cls, v: object) -> object:
        if isinstance(v, dict) and "kind" not in v:
            return StructuredOutputs.model_validate(v).spec()
        if isinstance(v, StructuredOutputs):
            return v.spec()
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if not v:
            return None
        for tok, bias in v.items():
            if tok < 0:
                raise ValueError(f"logit_bias token id {tok} must be >= 0")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {tok} is {bias}; it must be in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def shapes_logits(self) -> bool:
        """Anything that changes the row's logits before the argmax (penalties, logit_bias)."""
        return self.needs_penalties or bool(self.logit_bias)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0
