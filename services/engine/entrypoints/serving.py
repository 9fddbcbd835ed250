"""What every endpoint shares: server settings, the serving context, and request -> engine inputs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.media.media_settings import MediaLimits, RemoteMedia
from services.common.openai.chat_tools import ToolSettings
from services.common.openai.errors import OpenAIError, bad_request, model_not_found, not_ready
from services.common.openai.protocol_common import SamplingRequest
from services.common.openai.protocol_structured import StructuredSpec
from services.engine.async_llm import AsyncLLM
from services.engine.core.sampling_params import SamplingParams
from services.engine.entrypoints.lifecycle import ServerState
from services.engine.entrypoints.metrics import ServerMetrics
from services.engine.entrypoints.role import AggregatedRole, EngineRole
from services.engine.worker.structured.grammars import GrammarError

MAX_N = 128  # most choices one request may ask for (SamplingParams' own limit)
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # no request holds its KV blocks for ever (--request-timeout 0: no limit)


class ServerSettings(BaseModel):
    """HTTP-side settings of one engine server (engine settings live in EngineConfig)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # template text (from --chat-template FILE) replacing the model's
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    allowed_local_media_path: Path | None = None  # vision models: file:// image URLs under this folder
    limit_mm_per_prompt: MediaLimits = MediaLimits()  # vision models: images / videos per request
    remote_media: RemoteMedia = RemoteMedia()  # vision models: http(s) media URLs (refused by default)

    api_key: str | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # priority: requests' `priority` is honoured
    request_timeout: float | None = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    drain_timeout: float = Field(30.0, ge=0)


@dataclass(frozen=True)
class OutputShape:
    """Chat-only output settings: the constraint starts after a reasoning end tag; tool markers that are
    special tokens must stay in the text the parser reads."""

    structured_after: str | None = None
    keep_special_tokens: bool = False


@dataclass
class ServingContext:
    """Everything a handler needs; built once per app."""

    llm: AsyncLLM
    settings: ServerSettings
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    state: ServerState = field(default_factory=ServerState)
    role: EngineRole = field(default_factory=AggregatedRole)
    tools: ToolSettings = field(default_factory=ToolSettings)

    @property
    def task(self) -> str:
        """'generate' or 'embed' (what the engine was started for)."""
        return self.llm.engine.core.task

    def check_generates(self) -> None:
        """400 on an embedding engine asked to generate."""
        if self.task != "generate":
            raise bad_request(
                "this model serves embeddings (POST /v1/embeddings); it cannot generate text",
                "model",
                "model_not_generative",
            )

    def check_ready(self) -> None:
        """Raise 503 unless the engine is warm and not draining."""
        if not self.state.is_ready(self.llm):
            raise not_ready(
                "The server is draining." if self.state.draining else "The server is not ready yet."
            )

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a model this server does not serve."""
        if model is None or model == self.model_name:
            return None
        if model in self.llm.engine.core.lora_names():
            return model
        raise model_not_found(model)


@dataclass(frozen=True)
class SubRequest:
    """One engine request: choice ``index`` of the response, sample ``sample`` of prompt ``prompt``."""

    index: int
    prompt: int
    sample: int
    prompt_ids: list[int]
    params: SamplingParams


def output_budget(req: SamplingRequest, prompt_len: int, max_model_len: int) -> int:
    """max_tokens for the engine; 400 when the prompt plus the requested output exceed the context."""
    requested = req.max_output_tokens()
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens (at least one must be left for the output).",
            "prompt",
        )
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "output). Reduce the prompt or max_tokens.",
            "max_tokens",
        )
    return requested


def sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    seed: int | None,
    vocab_size: int,
    prompt_logprobs: int | None = None,
    structured: StructuredSpec | None = None,
    shape: OutputShape | None = None,
) -> SamplingParams:
    """Engine SamplingParams for one sub-request; 400 for values the engine cannot serve."""
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}", "n")
    if any(t >= vocab_size for t in req.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    bias = req.token_bias()
    if bias and max(bias) >= vocab_size:
        raise bad_request(f"logit_bias token ids must be in [0, {vocab_size}), got {max(bias)}", "logit_bias")
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty or 1.0,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            ignore_eos=req.ignore_eos,
            stop=tuple(req.stop_strings()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured,
            structured_outputs_after=shape.structured_after if shape else req.structured_outputs_after,
            skip_special_tokens=not shape.keep_special_tokens if shape else req.skip_special_tokens,
            resumed_output_tokens=req.resumed_output_tokens,
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise bad_request(f"invalid sampling parameters: {first['msg']}") from exc


def fan_out(
    req: SamplingRequest,
    prompts: list[list[int]],
    ctx: ServingContext,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredSpec | None = None,
    shape: OutputShape | None = None,
) -> list[SubRequest]:
    """``n`` sub-requests per prompt (seeds ``seed + i``); choice index ``prompt * n + i``."""
    if req.priority and ctx.settings.scheduling_policy != "priority":
        raise bad_request(
            "priority is only honoured by an engine started with --scheduling-policy priority", "priority"
        )
    subs = []
    for p, ids in enumerate(prompts):
        if req.resumed_output_tokens > len(ids):
            raise bad_request(
                f"resumed_output_tokens ({req.resumed_output_tokens}) exceeds the prompt's {len(ids)} tokens",
                "resumed_output_tokens",
            )
        budget = output_budget(req, len(ids), ctx.max_model_len)
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            params = sampling_params(
                req, budget, logprobs, seed, ctx.vocab_size, prompt_logprobs, structured, shape
            )
            subs.append(SubRequest(p * req.n + i, p, i, ids, params))
    for sub in subs[:: req.n]:
        validate_prompt(ctx, sub)
    return subs


async def checked_constraint(ctx: ServingContext, spec: StructuredSpec | None) -> StructuredSpec | None:
    """``spec`` once its grammar compiled (cached: the engine reuses it); 400 naming the field otherwise."""
    if spec is None:
        return None
    try:
        await asyncio.to_thread(ctx.llm.engine.structured.compiler.compile, spec)
    except GrammarError as exc:
        raise bad_request(str(exc), exc.param) from exc
    return spec


def validate_prompt(ctx: ServingContext, sub: SubRequest) -> None:
    """400 for a prompt the engine refuses (empty, token ids out of range, too long)."""
    try:
        ctx.llm.engine.validate_prompt(sub.prompt_ids, sub.params)
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from exc


def engine_error(message: str) -> OpenAIError:
    """500 for a request the engine failed (a failing step fails only its requests)."""
    return OpenAIError(
        500, f"The engine failed this request: {message}", "server_error", None, "engine_error"
    )


def request_timeout(seconds: float) -> OpenAIError:
    """504 for a request that ran past ``--request-timeout`` (it was aborted and its KV freed)."""
    return OpenAIError(
        504,
        f"The request did not finish within the server's request timeout of {seconds:g}s and was aborted.",
        "server_error",
        None,
        "request_timeout",
    )
