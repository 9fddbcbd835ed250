"""LLM: the offline batch API (vLLM-style): generate() and chat() over an LLMEngine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from services.common.media.video_inputs import VideoClip
from services.engine.core.config import EngineConfig
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams
from services.engine.llm_engine import LLMEngine, RequestOutput
from services.engine.worker.worker_stats import WorkerStats

Prompt = str | list[int] | dict[str, Any]  # a dict: {"prompt" | "prompt_token_ids", "multi_modal_data"}


class LLM:
    """Generate for a batch of prompts: ``LLM(model=path).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def worker_stats(self) -> WorkerStats:
        """Rank 0's resident weights, KV cache shape and bytes, layer kinds and feature counters."""
        return self.engine.core.worker_stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one device); the LLM cannot generate after it."""
        self.engine.core.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs are in prompt order, n sequences each.

        ``lora_name``: the LoRA adapter of every prompt, or one per prompt (None: the base model).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        param_list = (
            list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        )
        if len(param_list) != len(prompts):
            raise ValueError(f"params: got {len(param_list)} for {len(prompts)} prompts")
        loras: list[str | None] = (
            list(lora_name)
            if isinstance(lora_name, (list, tuple))
            else [cast(str | None, lora_name)] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"lora_name: got {len(loras)} for {len(prompts)} prompts")
        groups: list[list[str]] = []
        for prompt, p, lora in zip(prompts, param_list, loras, strict=True):
            ids = []
            for i in range(p.n):
                child = (
                    p if p.n == 1 else p.model_copy(update={"seed": None if p.seed is None else p.seed + i})
                )
                text, images = _split_prompt(prompt)
                ids.append(
                    self.engine.add_request(
                        text, child, cache_salt=cache_salt, lora_name=lora, index=i, images=images
                    )
                )
            groups.append(ids)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [self._merge([final[r] for r in ids]) for ids in groups]

    @staticmethod
    def _merge(outs: list[RequestOutput]) -> RequestOutput:
        first = outs[0]
        first.outputs = [o.outputs[0] for o in outs]
        return first

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[list[float]]:
        """Embeddings of each prompt, in order (the engine must have task 'embed')."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        params = SamplingParams(max_tokens=1)
        ids = [
            self.engine.add_request(_split_prompt(p)[0], params, pooling=pooling or PoolingParams())
            for p in batch
        ]
        final: dict[str, list[float]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    if out.embedding is None:
                        raise RuntimeError(f"embedding request {out.request_id} failed: {out.error}")
                    final[out.request_id] = out.embedding
        return [final[r] for r in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict[str, Any]]], [messages] if single else messages)
        prompts: list[Prompt] = [self.tokenizer.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, params)


def _split_prompt(prompt: Prompt) -> tuple[str | list[int], list[Any]]:
    """(text or token ids, images and videos) of a prompt; a dict prompt carries vLLM's ``multi_modal_data``
    (``image``: PIL images; ``video``: VideoClips, services.common.media.video_inputs)."""
    if not isinstance(prompt, dict):
        return prompt, []
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"prompt: unknown keys {sorted(unknown)}")
    text = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if text is None:
        raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    data = prompt.get("multi_modal_data") or {}
    if set(data) - {"image", "video"}:
        raise ValueError(f"multi_modal_data: only 'image' and 'video' are supported, got {sorted(data)}")
    images, videos = (_items(data.get("image", [])), _items(data.get("video", [])))
    if any(not isinstance(v, VideoClip) for v in videos):
        raise ValueError(
            "multi_modal_data: each video must be a VideoClip (services.common.media.video_inputs)"
        )
    return text, images + videos


def _items(value: Any) -> list[Any]:
    """One item or a list of them."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
