"""OpenAI ``POST /v1/completions``: the request, the ``text_completion`` response and its chunks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from services.common.openai.protocol_common import (
    MAX_LOGPROBS,
    FinishReason,
    PositiveInt,
    PromptLogprobsCarrier,
    RequestModel,
    ResponseModel,
    SamplingRequest,
    StreamChunkModel,
    Usage,
    field_error,
    now,
    random_id,
)

PromptInput = str | list[str] | list[int] | list[list[int]]


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


def _prompt_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_prompt", message)


def _check_prompt(value: Any) -> PromptInput:
    """Accept a string, strings, token ids or lists of token ids; reject anything empty."""
    if isinstance(value, str):
        if not value:
            raise _prompt_error("must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise _prompt_error("must be a non-empty string, list of strings, or list of token ids")
    if all(isinstance(item, str) for item in value):
        if not all(value):
            raise _prompt_error("must not contain empty strings")
        return value
    if all(_is_token_id(item) for item in value):
        return value
    if all(isinstance(item, list) and item and all(_is_token_id(t) for t in item) for item in value):
        return value
    raise _prompt_error(
        "must be a string, a list of strings, a list of non-negative token ids, "
        "or a list of non-empty token-id lists"
    )


Prompt = Annotated[PromptInput, PlainValidator(_check_prompt, json_schema_input_type=PromptInput)]


class MultiModalData(RequestModel):
    """Images and videos of a completions prompt (URLs, as in chat ``image_url`` / ``video_url`` parts)."""

    image: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=64)] = Field(
        default_factory=list
    )
    video: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] = Field(
        default_factory=list
    )


class CompletionRequest(SamplingRequest):
    """Body of ``POST /v1/completions``. ``max_tokens`` defaults to 16 as in OpenAI and vLLM."""

    prompt: Prompt
    max_tokens: PositiveInt | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: PositiveInt | None = None  # honoured when it equals n (each choice is its own sample)
    suffix: str | None = None  # fill-in-the-middle: not served (a 400 says so)
    # kvferry extension (vLLM's offline shape): the images of a one-prompt request, one per placeholder
    # token of a vision-language model, as data: URLs; the router sends chat images to engines this way
    multi_modal_data: MultiModalData | None = None
    # vLLM's: each choice also carries the ids of its new tokens (a router resuming a broken stream needs them)
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _check_images(self) -> CompletionRequest:
        data = self.multi_modal_data
        if data is not None and (data.image or data.video) and len(self.prompts()) != 1:
            raise field_error("multi_modal_data", "images and videos go with exactly one prompt")
        return self

    @model_validator(mode="after")
    def _check_unserved(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise field_error(
                "best_of",
                f"must equal n ({self.n}) on this server: it returns every sample it draws, never a best "
                "subset (ask for n choices and rank them yourself)",
            )
        if self.suffix:
            raise field_error(
                "suffix", "is not supported: this server has no fill-in-the-middle prompt format"
            )
        return self

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None and self.kv_transfer_params is not None:
            raise field_error(
                "echo",
                "echo with logprobs cannot be combined with kv_transfer_params (a decode "
                "engine does not compute the prompt)",
            )
        return self

    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine must compute: for ``prompt_logprobs`` and for echoed ``logprobs``."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: a list of strings or a list of token-id lists (one per prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt


class CompletionLogprobs(ResponseModel):
    """``choices[i].logprobs`` of a completion: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(PromptLogprobsCarrier):
    """One choice of a completion (also the shape of a streamed choice)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the choice's (new) token ids

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("prompt_logprobs", "token_ids"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class CompletionResponse(ResponseModel):
    """A ``text_completion`` object, with vLLM's top-level ``kv_transfer_params``."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(StreamChunkModel):
    """One streamed chunk of a completion; the same ``id`` and ``created`` on every chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
