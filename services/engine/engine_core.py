"""EngineCore: builds the model, KV cache, scheduler and runner, and runs one step at a time."""

from __future__ import annotations

import logging

import torch

from services.common.kv.hashing import HASH_VERSION, BlockHasher
from services.common.kv.kv_transfer import KVCompat, block_major_layout
from services.engine.core.config import EngineConfig
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.kv_connector import KVConnector, TransferStats, compose
from services.engine.core.outputs import EngineCoreOutput
from services.engine.core.request import Request, RequestStatus
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.startup_heap import release_startup_heap
from services.engine.executor.executor import Executor, UniprocExecutor
from services.engine.executor.multiproc_executor import MultiprocExecutor
from services.engine.executor.tp_checks import check_tensor_parallel
from services.engine.kv_transfer.context import ConnectorFactory, KVTransferContext, aggregated_connectors
from services.engine.platforms.detect import current_platform
from services.engine.worker.kv_cache_sizer import DEFAULT_BATCHED_TOKENS, KVCacheSizer
from services.engine.worker.structured.manager import StructuredOutputManager
from services.engine.worker.worker import Worker
from services.engine.worker.worker_plan import WorkerPlan
from services.engine.worker.worker_stats import WorkerStats

log = logging.getLogger(__name__)


class EngineCore:
    """The engine without a front end: requests in, per-step token outputs out.

    ``connectors`` builds the KV connectors of this engine's role from its KV cache (a role package
    passes its own; the default is the kvstore tier when one is configured).
    """

    def __init__(self, config: EngineConfig, connectors: ConnectorFactory = aggregated_connectors) -> None:
        self.config = config
        self.platform = current_platform(config.device)
        log.info("platform: %s", self.platform.describe())
        self.device = torch.device(self.platform.device)
        plan = WorkerPlan.resolve(config, self.device, self.platform.ops_backend)
        self.model_config, self.task, self.encoder = plan.model_config, plan.task, plan.encoder
        self.max_model_len, self.dtype, self.quant = plan.max_model_len, plan.dtype, plan.quant
        self.block_size = config.block_size
        self.hasher = BlockHasher(config.model_name, self.block_size, HASH_VERSION)
        torch.manual_seed(config.seed)
        self._start_parallel(plan)
        try:  # the KV cache is sized after the weights are in memory
            self.worker = Worker.load(plan, self._groups, self.device)
            self.num_blocks = self._size_kv_cache()
            self.runner = self.worker.build_runner(self.num_blocks)
        except BaseException:
            if self._parallel is not None:
                self._parallel.shutdown()
            raise
        self.lora = self.worker.lora
        self.executor: Executor = UniprocExecutor(self.worker)
        if self._parallel is not None:
            self._parallel.attach(self.worker, self.num_blocks)
            self.executor = self._parallel
        self.kv_config = self.worker.kv_config
        self.kv_manager = KVCacheManager(
            self.num_blocks,
            self.block_size,
            config.enable_prefix_caching,
            sliding_window=self.model_config.kv_window,
        )
        self._build_connector(self.runner.kv_cache, connectors)
        kv = self.runner.kv_cache
        # one block of this rank's cache (0: an embedding engine keeps none)
        self.kv_block_bytes = kv[0].numel() * kv.element_size() if len(kv) else 0
        self.scheduler = self._build_scheduler()
        self.last_step_tokens = 0
        # attached by LLMEngine (it owns the tokenizer)
        self.structured: StructuredOutputManager | None = None
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%d KV bytes per token), dtype %s, weights %s, "
            "device %s",
            config.model_name,
            self.num_blocks,
            self.block_size,
            self.kv_block_bytes // self.block_size,
            self.dtype,
            self.quant.describe(),
            self.device,
        )

    def _start_parallel(self, plan: WorkerPlan) -> None:
        """Tensor / pipeline parallelism: check what it supports, then start the other ranks' workers."""
        config, cfg = self.config, self.model_config
        self._parallel: MultiprocExecutor | None = None
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            check_tensor_parallel(config, cfg, self.quant, self.task == "generate")
            self._parallel = MultiprocExecutor(plan)
        self._groups = self._parallel.groups if self._parallel is not None else None
        self.tp, self.pp = (self._groups.tp, self._groups.pp) if self._groups is not None else (None, None)

    def _build_connector(self, kv_cache: torch.Tensor, connectors: ConnectorFactory) -> None:
        """The role's KV connectors over this engine's cache (every rank's: tensor shards and pipeline stages)."""
        ranks = self._parallel.kv_ranks if self._parallel is not None else []
        self.kv_transfer = KVTransferContext(
            self.config, kv_cache, self.kv_compat(), ranks, self.worker.kv_head_ranges(),
            emit=self.kv_manager.pool.emit, task=self.task,
        )  # fmt: skip
        try:
            self.connector: KVConnector = compose(list(connectors(self.kv_transfer)))
        except BaseException:
            self.executor.shutdown()
            self.kv_transfer.close()
            raise

    def _build_scheduler(self) -> Scheduler:
        """The scheduler over the KV manager and connectors, with the step's token and encoder budgets."""
        config, spec = self.config, self.config.speculative_config
        batched = config.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
        if self.task == "embed":  # whole prompts per step: the budget must hold the longest
            batched = max(batched, self.max_model_len)
        encoder_budget, encoder_cache = self.worker.plan.encoder_budget(batched)
        return Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=self.max_model_len,
                chunked_prefill=self.task != "embed",
                max_loras=config.max_loras if self.lora is not None else 0,
                num_lookahead_tokens=spec.lookahead if spec is not None else 0,
                max_num_encoder_input_tokens=encoder_budget,
            ),
            self.kv_manager,
            self.connector,
            encoder_cache,
        )

    def update_lora(self, name: str, path: str | None) -> None:
        """Load an adapter (``path``) or unload it (None) on every rank."""
        self.executor.update_lora(name, path)

    def lora_names(self) -> list[str]:
        """The adapters requests may name (empty without --enable-lora)."""
        return self.lora.names if self.lora is not None else []

    def _size_kv_cache(self) -> int:
        """KV blocks that fit beside the weights and the step's activations (profiled on rank 0)."""
        sizer = KVCacheSizer(
            self.config,
            self.device,
            self.dtype,
            self.worker.kv_config,
            self.worker.plan.draft_config,
            self.max_model_len,
            self.task,
            self.encoder,
            sharded=self._parallel is not None,
        )
        self._activation_bytes = sizer.profile(self.worker.model, self.worker.backend)  # the GPU memory test
        return sizer.num_blocks(self._activation_bytes)

    def kv_compat(self) -> KVCompat:
        """What a peer engine must match to exchange KV blocks with this one (under tensor parallelism:
        one rank's shard, and how many there are)."""
        cfg = self.kv_config
        return KVCompat(
            model_id=self.config.model_name,
            block_size=self.block_size,
            hash_version=HASH_VERSION,
            dtype=str(self.dtype).removeprefix("torch."),
            bytes_per_block=self.worker.bytes_per_block(),
            kv_layout=block_major_layout(
                cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim
            ),
            weights=self.quant.describe(),
            tensor_parallel_size=self.config.tensor_parallel_size,
            pipeline_parallel_size=self.config.pipeline_parallel_size,
        )

    def transfer_stats(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """Blocks moved by (direction, path) and failures by reason, over every connector."""
        stats = self.connector.stats()
        return dict(stats.blocks), dict(stats.failures)

    def kv_transfer_stats(self) -> TransferStats:
        """Every connector's counters, merged: moves, failures, what each KV tier holds, load latencies."""
        return self.connector.stats()

    def worker_stats(self) -> WorkerStats:
        """Rank 0's resident weights, KV cache, layer kinds and feature counters."""
        return self.worker.stats()

    def moe_expert_tokens(self) -> list[tuple[int, list[int]]]:
        """Tokens routed to each expert of each MoE layer since start (empty for dense models)."""
        return self.worker.moe_expert_tokens()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any), close the KV connectors and this engine's NIXL agent."""
        self.executor.shutdown()
        self.connector.close()
        self.kv_transfer.close()
        release_startup_heap()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(req_ids, status)
        if self.structured is not None:
            self.structured.release(req_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def migrate_out(self) -> list[EngineCoreOutput]:
        """Drain: finish every request that opted in (``migrate_on_drain``) with its computed full blocks
        leased; each output carries the kv_transfer_params another decode continues it from."""
        ids = [rid for rid, r in self.scheduler.requests.items() if r.migratable and not r.is_finished]
        for rid in ids:
            self.scheduler.requests[rid].migrating_out = True
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        if self.structured is not None:
            self.structured.release(ids)
        return [
            EngineCoreOutput(
                r.request_id,
                (),
                finish_reason="abort",
                kv_transfer_params=r.remote_kv_out.model_dump(mode="json") if r.remote_kv_out else None,
            )
            for r in done
        ]

    @property
    def num_held_finished(self) -> int:
        """Finished requests (and exported prefixes) whose blocks a connector still holds (leases not yet read,
        reads in flight)."""
        return len(self.scheduler.delayed_free) + len(self.scheduler.exports)

    def step(self) -> list[EngineCoreOutput]:
        failed = self._fail_bad_grammars()
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.total_num_scheduled_tokens
        if sched.is_empty:
            self.executor.execute(sched)  # only forgets finished requests
            return failed
        structured = self.structured if self.structured is not None and self.structured.active else None
        constraints = structured.for_step(sched, self.scheduler.requests) if structured else None
        result = self.executor.execute(sched, constraints)
        outputs = self.scheduler.update_from_output(sched, result)
        if structured is not None:
            structured.after_step(self.scheduler.requests)
        if self.lora is not None and self.lora.retiring:
            self.lora.forget({r.lora_name for r in self.scheduler.requests.values() if r.lora_name})
        return failed + outputs

    def _fail_bad_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar did not compile end with an error (the HTTP layer rejects them earlier)."""
        if self.structured is None or not self.structured.active:
            return []
        failed = self.structured.take_failures()
        self.scheduler.finish_requests([rid for rid, _ in failed], RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, (), finish_reason="error", error=str(err)) for rid, err in failed]
