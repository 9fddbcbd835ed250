"""LLMEngine: validates and tokenizes inputs, drives EngineCore, detokenizes and applies stop strings."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.kv.hashing import BlockHashExtras
from services.common.kv.kv_transfer import KVTransferParams
from services.common.openai.protocol_common import FinishReason
from services.common.openai.tokenizer import Tokenizer
from services.engine.core.config import EngineConfig
from services.engine.core.engine_request import EngineRequest
from services.engine.core.mm_input import MMInput
from services.engine.core.outputs import EngineCoreOutput, Logprobs
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.request import Request, RequestStatus
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.startup_heap import freeze_startup_heap
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.engine_core import EngineCore
from services.engine.kv_transfer.context import ConnectorFactory, aggregated_connectors
from services.engine.worker.multimodal.placeholders import ImageInputs, mm_spans
from services.engine.worker.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from PIL import Image

    from services.common.media.video_inputs import VideoClip


@dataclass
class CompletionOutput:
    """One generated sequence (cumulative)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step; ``delta_*`` holds what is new since the last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    kv_transfer_params: dict | None = None
    queue_time_s: float | None = None  # arrival in the engine to first scheduled
    prompt_logprobs: list[Logprobs | None] | None = None  # per prompt token (the first is None), once known
    embedding: list[float] | None = None  # an embedding request's pooled prompt


class _Tracked:
    """Front-end state of one request: its detokenizer and accumulated output."""

    def __init__(self, req: Request, prompt: str | None, detok: IncrementalDetokenizer, index: int) -> None:
        self.req, self.prompt, self.detok = req, prompt, detok
        self.out = CompletionOutput(
            index=index, logprobs=[] if req.sampling_params.logprobs is not None else None
        )
        self.prompt_logprobs: list[Logprobs | None] | None = None


class LLMEngine:
    """Synchronous engine with a text front end; the async server and the offline LLM wrap it."""

    def __init__(self, config: EngineConfig, connectors: ConnectorFactory = aggregated_connectors) -> None:
        self.config = config
        self.core = EngineCore(config, connectors)
        tok_dir = Path(config.model)
        if tok_dir.suffix == ".gguf":
            from services.engine.worker.loader.default_model import gguf_tokenizer_dir

            tok_dir = gguf_tokenizer_dir(tok_dir)
        self.tokenizer = Tokenizer(tok_dir)
        cfg_eos = self.core.model_config.eos_token_ids
        self.eos_token_id = cfg_eos[0] if cfg_eos else self.tokenizer.eos_token_id
        if not cfg_eos and self.tokenizer.eos_token_id is not None:
            self.core.runner.eos_ids = (self.tokenizer.eos_token_id,)
        self.max_model_len = self.core.max_model_len
        self.structured = StructuredOutputManager(
            self.tokenizer, self.core.model_config.vocab_size, self.core.runner.eos_ids
        )
        self.core.structured = self.structured
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        vision = self.core.model_config.vision
        self.image_inputs = ImageInputs(config.model) if vision is not None else None
        freeze_startup_heap()  # after the model, tokenizer and grammar tables: the process's long-lived heap

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate_prompt(
        self, token_ids: list[int], params: SamplingParams, kv_transfer_params: KVTransferParams | None = None
    ) -> None:
        """Raise ValueError naming the field when the prompt cannot be served."""
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.core.model_config.vocab_size
        if params.prompt_logprobs is not None and kv_transfer_params is not None:
            raise ValueError(
                "prompt_logprobs: cannot be combined with kv_transfer_params (disaggregated "
                "prefill/decode does not compute prompt logprobs on the decode engine)"
            )
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if self.core.task == "embed":
            if len(token_ids) > self.max_model_len:
                raise ValueError(f"input: {len(token_ids)} tokens, but max_model_len is {self.max_model_len}")
            return
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str = "",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        index: int = 0,
        kv_transfer_params: KVTransferParams | None = None,
        pooling: PoolingParams | None = None,
        images: Sequence[Image.Image | VideoClip] = (),
        mm_inputs: tuple[MMInput, ...] | None = None,
    ) -> EngineRequest:
        """The request value for one sequence, validated (ValueError naming the field).

        ``pooling`` makes it an embedding request (engines with task 'embed' serve only those).
        ``images``: one per image / video placeholder of the prompt (vision-language models), preprocessed
        here; or ``mm_inputs``: the prompt already expanded by ``expand_media`` (off this thread).
        """
        if (pooling is not None) != (self.core.task == "embed"):
            raise ValueError(
                "task: this engine serves "
                + ("embeddings" if self.core.task == "embed" else "generation (start it with task 'embed')")
            )
        text, token_ids = self.tokenize_prompt(prompt)
        if mm_inputs is None:
            token_ids, mm_inputs = self.expand_media(token_ids, images)
        self.validate_prompt(token_ids, params, kv_transfer_params)
        return EngineRequest(
            request_id, tuple(token_ids), params, text, cache_salt, lora_name, priority, index,
            kv_transfer_params, pooling, mm_inputs,
        )  # fmt: skip

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, **kw: Any
    ) -> str:
        """Queue one sequence (``make_request``'s arguments; no id: the engine names it); returns its id."""
        return self.add(self.make_request(prompt, params, request_id or "", **kw))

    def add(self, request: EngineRequest) -> str:
        """Queue a request built by ``make_request`` (its prompt already validated); returns its id
        (LookupError when its LoRA adapter is not loaded, ValueError when its id is in use)."""
        lora_name = request.lora_name
        if lora_name is not None and lora_name not in self.core.lora_names():
            raise LookupError(f"model: LoRA adapter {lora_name!r} is not loaded")
        if lora_name is not None and self.core.lora is not None:
            self.core.lora.requests[lora_name] += 1
        if not request.request_id:
            request = request.with_id(f"req-{next(self._ids)}")
        request_id, params = request.request_id, request.params
        if request_id in self._tracked:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        extras = BlockHashExtras(
            lora_name=lora_name, cache_salt=request.cache_salt, mm_spans=mm_spans(request.mm_inputs)
        )
        req = Request.of(
            request,
            self.eos_token_id,
            hash_fn=lambda hashes, toks: self.core.hasher.extend(hashes, toks, extras),
        )
        detok = IncrementalDetokenizer(
            self.tokenizer,
            list(request.prompt_token_ids),
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        self._tracked[request_id] = _Tracked(req, request.prompt_text, detok, request.index)
        if params.structured_outputs is not None:
            self.structured.add(req, params.structured_outputs, params.structured_outputs_after)
        self.core.add_request(req)
        return request_id

    def expand_media(
        self, token_ids: list[int], media: Sequence[Image.Image | VideoClip]
    ) -> tuple[list[int], tuple[MMInput, ...]]:
        """The ids with each image's / video's placeholder expanded, and their preprocessed pixels; reads no
        engine state, so the serving layer runs it on a worker thread (ValueError naming the part)."""
        if self.image_inputs is None:
            if media:
                raise ValueError("images: this model takes text only")
            return token_ids, ()
        ids, mm_inputs = self.image_inputs.expand(token_ids, media)
        budget = self.core.scheduler.config.max_num_encoder_input_tokens
        for i, mm in enumerate(mm_inputs):
            if mm.num_embeds > budget:
                raise ValueError(
                    f"images: item {i} has {mm.num_embeds} features, over this server's "
                    f"max_num_encoder_input_tokens={budget}"
                )
        return ids, mm_inputs

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)
        for rid in request_ids:
            self._tracked.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def migrate_out(self) -> list[RequestOutput]:
        """The final outputs of the requests a drain moves (see ``EngineCore.migrate_out``)."""
        return [out for o in self.core.migrate_out() if (out := self._process(o)) is not None]

    def step(self) -> list[RequestOutput]:
        return [out for o in self.core.step() if (out := self._process(o)) is not None]

    def _process(self, o: EngineCoreOutput) -> RequestOutput | None:
        tr = self._tracked.get(o.req_id)
        if tr is None:
            return None
        out = tr.out
        out.token_ids.extend(o.new_token_ids)
        if o.prompt_logprobs is not None:
            tr.prompt_logprobs = list(o.prompt_logprobs)
        if out.logprobs is not None:
            out.logprobs.extend(o.new_logprobs)
        finish, stop_reason = o.finish_reason, o.stop_reason
        hit = tr.detok.add_tokens(o.new_token_ids)
        if hit is not None and finish is None:
            self.core.abort([o.req_id], RequestStatus.FINISHED_STOPPED)
            finish, stop_reason = "stop", hit
        if finish is not None:
            out.finish_reason, out.stop_reason = finish, stop_reason
            del self._tracked[o.req_id]
        delta = tr.detok.take_delta(final=finish is not None)
        out.text += delta
        return RequestOutput(
            request_id=o.req_id,
            prompt=tr.prompt,
            prompt_token_ids=tr.req.prompt_token_ids,
            outputs=[out],
            finished=finish is not None,
            num_cached_tokens=o.num_cached_tokens,
            delta_text=delta,
            delta_token_ids=list(o.new_token_ids),
            error=o.error,
            kv_transfer_params=o.kv_transfer_params,
            queue_time_s=o.queue_time_s,
            prompt_logprobs=tr.prompt_logprobs,
            embedding=list(o.embedding) if o.embedding is not None else None,
        )
