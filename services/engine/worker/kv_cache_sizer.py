"""KVCacheSizer: how many KV blocks an engine gets (the flag, a GPU's memory after a profiled step, a CPU default)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from services.engine.core.config import EngineConfig
from services.engine.worker.attention import ComputeBackend
from services.engine.worker.memory_profile import dummy_prompts, profile_model
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.model_runner import bytes_per_block
from services.engine.worker.models.interface import CausalLM, EmbeddingModel

log = logging.getLogger(__name__)

DEFAULT_BATCHED_TOKENS = 2048  # per step; longer prompts are chunked (vLLM V1's default)
_DEFAULT_CPU_KV_GB = 2.0
_DEFAULT_GPU_UTILIZATION = 0.9  # vLLM's default
_ACTIVATION_RESERVE = 0.05  # of the device, kept for a step's activations where no profile step ran


@dataclass(frozen=True)
class KVCacheSizer:
    """Sizes one engine's (one rank's) paged KV cache once its weights are in memory."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kv_config: ModelConfig  # this rank's KV heads and layers
    draft_config: ModelConfig | None  # a draft model's KV shares the block ids
    max_model_len: int
    task: str
    encoder: bool
    sharded: bool  # tensor or pipeline parallel

    def profile(self, model: CausalLM | EmbeddingModel, backend: ComputeBackend) -> int | None:
        """One CUDA engine whose KV --gpu-memory-utilization sizes: the peak bytes of a step at the full
        token budget (None: not profiled; sharded engines keep a fixed reserve, as CPUs need none)."""
        c = self.config
        if self.device.type != "cuda" or c.num_kv_blocks or c.kv_cache_memory_gb or self.encoder:
            return None
        if self.task != "generate" or self.sharded:
            return None
        batched = c.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
        lengths = dummy_prompts(batched, c.max_num_seqs, self.max_model_len)
        peak = profile_model(
            cast(CausalLM, model), self.kv_config, self.dtype, backend, self.device, c.block_size, lengths
        )
        log.info("profile step: %d tokens in %d prompts peaked at %.2f GiB over the weights", sum(lengths),
                 len(lengths), peak / 2**30)  # fmt: skip
        return peak

    def num_blocks(self, activation_bytes: int | None) -> int:
        """The block count; ValueError naming the settings when it cannot hold one max_model_len sequence."""
        c, block_size = self.config, self.config.block_size
        if c.num_kv_blocks:
            return c.num_kv_blocks
        per_sequence = -(-self.max_model_len // block_size)
        if self.encoder:  # no KV is kept: blocks only count a batch's tokens
            return c.max_num_seqs * per_sequence
        per_block = bytes_per_block(self.kv_config, block_size, self.dtype)  # per rank
        if self.draft_config is not None:
            per_block += bytes_per_block(self.draft_config, block_size, self.dtype)
        blocks = min(int(self._budget_bytes(activation_bytes) // per_block), c.max_num_seqs * per_sequence)
        if blocks < per_sequence:
            raise ValueError(
                f"kv cache of {blocks} blocks cannot hold one max_model_len={self.max_model_len} "
                f"sequence ({per_sequence} blocks needed); raise kv_cache_memory_gb or lower max_model_len"
            )
        return blocks

    def _budget_bytes(self, activation_bytes: int | None) -> float:
        """--kv-cache-memory if given; on GPUs what --gpu-memory-utilization leaves after the weights and a
        profiled step at the full token budget (a sharded engine: a 5% reserve instead); on CPUs 2 GiB."""
        c = self.config
        if c.kv_cache_memory_gb:
            return c.kv_cache_memory_gb * 2**30
        if self.device.type == "cuda":
            util = c.gpu_memory_utilization or _DEFAULT_GPU_UTILIZATION
            free, total = torch.cuda.mem_get_info(self.device)
            steps = activation_bytes if activation_bytes is not None else total * _ACTIVATION_RESERVE
            budget = total * util - (total - free) - steps
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization={util}: the weights already use {(total - free) / 2**30:.1f} of "
                    f"{total / 2**30:.1f} GiB and a step {steps / 2**30:.1f} GiB; nothing is left for the KV "
                    "cache (raise it, or lower max_num_batched_tokens)"
                )
            return budget
        if c.gpu_memory_utilization is not None:
            log.warning("gpu_memory_utilization applies to GPU engines; this CPU engine sizes its KV cache "
                        "with kv_cache_memory_gb (default %.0f GiB)", _DEFAULT_CPU_KV_GB)  # fmt: skip
        return _DEFAULT_CPU_KV_GB * 2**30
