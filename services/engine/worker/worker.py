"""Worker: one rank's model, KV cache and model runner with its features, built the same way on every rank."""

from __future__ import annotations

import logging
from typing import cast

import torch

from services.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from services.engine.worker.attention import ComputeBackend, select_backend
from services.engine.worker.cuda_graphs import GraphFacts, decode_graphs
from services.engine.worker.loader.model_loader import load_embedding_model, load_model
from services.engine.worker.lora.lora_manager import LoRAManager
from services.engine.worker.model_runner import ModelRunner, RunnerFeatures, bytes_per_block, kv_cache_shape
from services.engine.worker.models.capabilities import ModelCapabilities
from services.engine.worker.models.interface import CausalLM, EmbeddingModel
from services.engine.worker.models.moe import expert_token_counts, moe_layers
from services.engine.worker.parallel.groups import ParallelGroups, rank_kv_config
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.pooling import pooling_config_for
from services.engine.worker.spec_decode.full_vocab import FullVocab
from services.engine.worker.spec_decode.setup import build_spec_decoder
from services.engine.worker.spec_decode.spec_decoder import SpecDecoder
from services.engine.worker.structured.manager import StepConstraints
from services.engine.worker.worker_plan import WorkerPlan
from services.engine.worker.worker_stats import WorkerStats

log = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (one per rank), else the CPU."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank)
    return torch.device("cpu")


class Worker:
    """One rank: ``load`` reads its shard of the weights; ``build_runner`` allocates the KV cache rank 0
    sized and builds the runner with pooling, LoRA slots, the speculative decoder and CUDA graphs."""

    def __init__(
        self, plan: WorkerPlan, groups: ParallelGroups | None, device: torch.device, backend: ComputeBackend
    ) -> None:
        self.plan, self.groups, self.device, self.backend = plan, groups, device, backend
        self.rank = groups.rank if groups is not None else 0
        self.kv_config = rank_kv_config(plan.model_config, groups)  # this rank's KV heads and layers
        self.model: CausalLM | EmbeddingModel = self._load()
        self.moe_layers = moe_layers(cast(torch.nn.Module, self.model))
        self.lora: LoRAManager | None = None
        self.runner: ModelRunner | None = None  # once build_runner ran

    @classmethod
    def load(cls, plan: WorkerPlan, groups: ParallelGroups | None, device: torch.device) -> Worker:
        """This rank's model, its weights read (only its slices under tensor parallelism)."""
        return cls(plan, groups, device, select_backend(device, plan.backend))

    def _load(self) -> CausalLM | EmbeddingModel:
        plan, cfg = self.plan, self.plan.model_config
        tp = self.groups.tp if self.groups is not None else None
        pp = self.groups.pp if self.groups is not None else None
        args = (plan.config.model, cfg, plan.dtype, self.device, plan.max_model_len, plan.quant, plan.kernels)
        dummy = plan.config.load_format == "dummy"
        if plan.task == "embed":
            return load_embedding_model(*args, tp=tp, dummy=dummy)
        return load_model(*args, tp=tp, pp=pp, dummy=dummy)

    def build_runner(self, num_blocks: int) -> ModelRunner:
        """The KV cache of ``num_blocks`` blocks and the runner with every feature this engine serves."""
        plan = self.plan
        kv_cache = self._kv_cache(num_blocks)
        self.lora = self._lora_manager()
        features = RunnerFeatures(
            pooling=pooling_config_for(plan.config.model, plan.model_config.architecture)
            if plan.task == "embed"
            else None,
            lora=self.lora,
            spec=self._spec_decoder(num_blocks),
        )
        runner = ModelRunner(
            self.model,
            self.kv_config,
            kv_cache,
            plan.config.block_size,
            self.backend,
            self.device,
            plan.model_config.eos_token_ids,
            seed=plan.config.seed,
            features=features,
        )
        model = self.model
        graphs = decode_graphs(
            self._graph_facts(runner),
            lambda ids, pos, meta: model(ids, pos, kv_cache, meta, self.backend),
            plan.config.max_num_seqs,
            plan.max_model_len,
            plan.config.block_size,
        )
        if graphs is not None:
            runner.graphs = graphs
        self.runner = runner
        return runner

    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput:
        """One step on this rank's runner."""
        if self.runner is None:
            raise RuntimeError("build_runner() first")
        return self.runner.execute(sched, constraints)

    def _kv_cache(self, num_blocks: int) -> torch.Tensor:
        """The paged KV cache (an encoder keeps none: an empty tensor)."""
        if self.plan.encoder:
            return torch.empty(0, dtype=self.plan.dtype, device=self.device)
        shape = kv_cache_shape(self.kv_config, num_blocks, self.plan.config.block_size)
        return torch.zeros(shape, dtype=self.plan.dtype, device=self.device)

    def _lora_manager(self) -> LoRAManager | None:
        """--enable-lora: the adapter slots around the model's linears (this rank's shard of each adapter),
        with the --lora-modules loaded."""
        c, plan = self.plan.config, self.plan
        if not c.enable_lora:
            if c.lora_modules:
                raise ValueError("lora_modules: LoRA adapters need enable_lora (--enable-lora)")
            return None
        if plan.task == "embed" or plan.encoder:
            raise ValueError("enable_lora: LoRA adapters are for generation models")
        if plan.model_config.vision is not None:
            raise ValueError("enable_lora: LoRA adapters on vision-language models are not supported yet")
        targets = ModelCapabilities.of(type(cast(torch.nn.Module, self.model))).lora
        if targets is None:
            raise ValueError(
                f"enable_lora: the model class of {plan.model_config.architecture} declares no lora_targets"
            )
        manager = LoRAManager(
            cast(torch.nn.Module, self.model),
            plan.model_config,
            targets,
            c.max_loras,
            c.max_lora_rank,
            c.max_cpu_loras or c.max_loras,
            plan.dtype,
            self.device,
            self.backend.name,
            tp=self.groups.tp if self.groups is not None else None,
        )
        for name, path in c.lora_modules.items():
            manager.add(name, path)
        return manager

    def _spec_decoder(self, num_blocks: int) -> SpecDecoder | None:
        """The proposer of --speculative-config, on rank 0 only (the other ranks verify the same drafts)."""
        plan, spec = self.plan, self.plan.config.speculative_config
        if spec is None or self.rank != 0:
            return None
        draft = plan.draft_config
        draft_kv = kv_cache_shape(draft, num_blocks, plan.config.block_size) if draft else ()
        target = cast(CausalLM, self.model)
        if spec.method == "eagle" and self.groups is not None and self.groups.tp is not None:
            # the target's embedding and head are vocabulary shards: the head reads whole copies
            target = cast(
                CausalLM, FullVocab.load(plan.config.model, plan.model_config, plan.dtype, self.device)
            )
        return build_spec_decoder(
            spec,
            target,
            draft,
            draft_kv,
            plan.dtype,
            self.device,
            self.backend,
            plan.max_model_len,
        )

    def update_lora(self, name: str, path: str | None) -> None:
        """Load an adapter (``path``) or unload it (None); ValueError without --enable-lora."""
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        if path is None:
            self.lora.remove(name)
        else:
            self.lora.add(name, path)

    def stats(self) -> WorkerStats:
        """This rank's weights, KV cache, layer kinds and feature counters (after build_runner)."""
        if self.runner is None:
            raise RuntimeError("build_runner() first")
        return WorkerStats.of(cast(torch.nn.Module, self.model), self.runner)

    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """Each tensor-parallel rank's (first KV head, count), rank order (one rank: all heads)."""
        heads = self.plan.model_config.num_key_value_heads
        tp = self.groups.tp if self.groups is not None else None
        if tp is None:
            return [(0, heads)]
        return [TPGroup(r, tp.size).kv_head(heads) for r in range(tp.size)]

    def moe_expert_tokens(self) -> list[tuple[int, list[int]]]:
        """Tokens routed to each expert of each MoE layer since start (empty for dense models)."""
        return expert_token_counts(self.moe_layers)

    def bytes_per_block(self) -> int:
        """One KV block's bytes on this rank (its heads and layers)."""
        return bytes_per_block(self.kv_config, self.plan.config.block_size, self.plan.dtype)

    def _graph_facts(self, runner: ModelRunner) -> GraphFacts:
        plan = self.plan
        return GraphFacts(
            device=self.device,
            backend=self.backend.name,
            enforce_eager=plan.config.enforce_eager,
            generates=plan.task == "generate",
            lora=self.lora is not None,
            speculative=plan.config.speculative_config is not None,
            vision=runner.vision.serves,
            parallel=self.groups is not None,
            moe=bool(self.moe_layers),
            quantized=plan.quant.quantized,
            latent_attention=plan.model_config.mla is not None,
        )
