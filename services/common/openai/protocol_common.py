"""Pieces shared by the OpenAI completions and chat protocols: base models, sampling fields, usage.

Request models are strict (no string-to-number or float-to-int coercion: ``max_tokens=1.5`` and
``"0.5"`` are rejected, as OpenAI does) and ignore unknown fields (as OpenAI and vLLM do), so a
client sending a newer OpenAI parameter still gets served. Cross-field checks raise
:func:`field_error`, which names the offending field so the 400 body's ``param`` points at it.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from services.common.openai.protocol_base import RequestModel as RequestModel
from services.common.openai.protocol_base import ResponseModel as ResponseModel
from services.common.openai.protocol_base import field_error as field_error
from services.common.openai.protocol_structured import StructuredRequestFields

MAX_LOGPROBS = 20

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0)]


def random_id(prefix: str) -> str:
    """An OpenAI-style object id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Creation time in whole seconds, as the ``created`` field carries it."""
    return int(time.time())


class StreamOptions(RequestModel):
    """``stream_options``: ``include_usage`` adds a final chunk with empty choices and the usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (not served: a 400 says so)

    @model_validator(mode="after")
    def _check_continuous(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise field_error(
                "continuous_usage_stats",
                "is not supported by this server; use include_usage (the usage arrives in the last chunk)",
            )
        return self


class SamplingRequest(StructuredRequestFields):
    """Fields both endpoints accept: OpenAI's sampling parameters plus vLLM's extras.

    ``model`` is optional (vLLM behaviour): the server fills in its served model name.
    ``top_k`` of -1 or 0 disables top-k. ``kv_transfer_params`` is the P/D hand-off dict
    (vLLM NixlConnector shape), passed through untouched.
    """

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # OpenAI: token id (a string of digits) -> bias added to its logit, in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0  # lower first (--scheduling-policy)
    # travels between the pool's pods as the X-Request-Id header: visible ASCII, no spaces
    request_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[!-~]+$")] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    skip_special_tokens: bool = True
    # kvferry: the output constraint starts once the output contains this text (a router forwarding a
    # reasoning model's chat request sets it to the end tag, e.g. "</think>")
    structured_outputs_after: Annotated[str, Field(min_length=1)] | None = None
    # kvferry: the prompt's last N tokens are this request's output so far, from an engine that failed (the
    # router's stream replay); frequency and presence penalties count them as output
    resumed_output_tokens: NonNegativeInt = 0

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (validated: each key a string of digits)."""
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingRequest:
        if self.logit_bias and not all(k.isascii() and k.isdigit() and len(k) <= 10 for k in self.logit_bias):
            raise field_error(
                "logit_bias", 'keys must be token ids, as strings of digits (e.g. {"50256": -100})'
            )
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise field_error("prompt_logprobs", "is not supported with stream=true")
        if self.prompt_logprobs is not None and self.kv_transfer_params is not None:
            raise field_error(
                "prompt_logprobs",
                "cannot be combined with kv_transfer_params (a decode engine does not compute the prompt)",
            )
        limit = self.max_output_tokens()
        if limit is not None and self.min_tokens > limit:
            raise field_error("min_tokens", f"must be <= max_tokens ({limit}), got {self.min_tokens}")
        return self

    def max_output_tokens(self) -> int | None:
        """The requested output-token limit, or None for "up to the context length"."""
        return self.max_tokens

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a single string becomes a one-element list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class PromptLogprob(ResponseModel):
    """One entry of vLLM's ``prompt_logprobs``: a candidate token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token (the first is None) the token and its top alternatives by id
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class PromptLogprobsCarrier(ResponseModel):
    """A response part that may carry vLLM's ``prompt_logprobs``: the key is sent only when it is set."""

    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("prompt_logprobs") is None:
            data.pop("prompt_logprobs", None)
        return data


class PromptTokensDetails(ResponseModel):
    """``usage.prompt_tokens_details``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(ResponseModel):
    """Token accounting of one response (all choices together)."""

    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_validator(mode="after")
    def _fill_total(self) -> Usage:
        if self.total_tokens == 0:
            self.total_tokens = self.prompt_tokens + self.completion_tokens
        return self

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """Usage with ``total_tokens`` computed and ``cached_tokens`` filled in."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class StreamChunkModel(ResponseModel):
    """Base of streaming chunks (each declares ``usage`` last): ``usage`` is sent only when set.

    OpenAI sends ``"usage": null`` on every chunk when ``include_usage`` is on and no ``usage`` key
    at all otherwise; pass ``usage=None`` explicitly in the first case.
    """

    @model_serializer(mode="wrap")
    def _omit_unset_usage(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("usage") is None and "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data
