"""DecodeGraphs: the model's decode step captured as CUDA graphs, one per batch-size bucket, replayed per step.

A pure decode step (every request one token) of n requests is padded up to the next captured size; its
token ids, positions, slot mapping, sequence lengths and block tables are copied in place into persistent
buffers that the graph reads, and the graph replays the whole forward pass (every layer's kernels) with
one launch. Padded rows write no KV (slot -1: the cache-write kernel skips them) and their outputs are
dropped. Steps with a prefill, or more requests than the largest bucket, run eagerly. The decode kernels
are captured for the longest context (``max_model_len``), so one graph serves every length.

How a graph is made is a ``GraphCapture`` (CUDA's, or a stand-in that records and re-runs the function,
which lets the bucketing, padding and buffer updates be tested without a GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.engine.worker.attention.metadata import AttentionMetadata
from services.engine.worker.input_batch import StepInputs

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class GraphCapture(Protocol):
    """Captures ``fn`` (after warm-up) and returns (replay, the static output tensor ``fn`` returned)."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...


def cuda_capture() -> GraphCapture:
    """CUDA graph capture: two warm-up runs on a side stream (Triton compiles, the allocator settles), then
    capture into one memory pool shared by every bucket."""
    shared: dict[str, Any] = {"pool": None}

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared["pool"]):
            out = fn()
        shared["pool"] = graph.pool()
        return graph.replay, out

    return capture


def capture_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs, largest)."""
    top = max(1, min(max_num_seqs, largest))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sorted(set(sizes + [top]))


@dataclass
class _Graph:
    replay: Callable[[], None]
    out: torch.Tensor


class DecodeGraphs:
    """Persistent decode inputs and one captured graph per bucket (see the module docstring)."""

    def __init__(
        self,
        forward: Forward,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: GraphCapture,
    ) -> None:
        self.forward, self.sizes, self.capture = forward, sorted(sizes), capture
        self.max_model_len, self.block_size = max_model_len, block_size
        top, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((top, width), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0  # steps served by a graph, since start

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds n rows, or None (run eagerly)."""
        return next((s for s in self.sizes if s >= n), None)

    def serves(self, inputs: StepInputs) -> bool:
        """A pure decode step of at most the largest bucket's rows, within max_model_len."""
        meta = inputs.meta
        return (
            meta.max_query_len == 1
            and self.bucket(meta.num_tokens) is not None
            and meta.max_seq_len <= self.max_model_len
        )

    def capture_all(self) -> None:
        """Capture every bucket now (at start-up), logging the time and the device memory it took."""
        cuda = self.input_ids.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.input_ids.device) if cuda else 0
        t0 = time.perf_counter()
        for size in self.sizes:
            self._graph(size)
        used = (torch.cuda.memory_allocated(self.input_ids.device) - before) if cuda else 0
        log.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.0f MiB",
                 len(self.sizes), ",".join(map(str, self.sizes)), time.perf_counter() - t0, used / 2**20)  # fmt: skip

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The hidden states [n, H] of a decode step (``serves(inputs)`` must hold)."""
        n = inputs.meta.num_tokens
        size = self.bucket(n)
        assert size is not None
        self._load(inputs, n, size)
        graph = self._graph(size)
        graph.replay()
        self.replays += 1
        return graph.out[:n]

    def _load(self, inputs: StepInputs, n: int, size: int) -> None:
        """Copy the step into the persistent buffers in place; rows n..size are padding."""
        meta = inputs.meta
        # a wider table (spare capacity) holds nothing past max_model_len's blocks
        width = min(meta.block_tables.shape[1], self.block_tables.shape[1])
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables[:, :width], non_blocking=True)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()

    def _graph(self, size: int) -> _Graph:
        found = self.graphs.get(size)
        if found is None:
            meta = self._meta(size)
            replay, out = self.capture(
                lambda: self.forward(self.input_ids[:size], self.positions[:size], meta)
            )
            found = self.graphs[size] = _Graph(replay, out)
        return found

    def _meta(self, size: int) -> AttentionMetadata:
        """Metadata over the persistent buffers' first ``size`` rows, for the longest context."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            q_lens_host=[1] * size,
            seq_lens_host=[self.max_model_len] * size,
            block_tables_host=torch.zeros((size, self.block_tables.shape[1]), dtype=torch.int32),
        )


@dataclass(frozen=True)
class GraphFacts:
    """What decides whether an engine's decode steps can replay CUDA graphs."""

    device: torch.device
    backend: str
    enforce_eager: bool
    generates: bool  # task generate (not embeddings)
    lora: bool
    speculative: bool
    vision: bool
    parallel: bool  # tensor or pipeline parallel ranks
    moe: bool
    quantized: bool
    latent_attention: bool = False  # MLA: each step's plan is built in Python from the host metadata

    def refusal(self) -> str | None:
        """Why graphs stay off (None: they run). Off where a decode step syncs with the host or runs per
        step Python that a graph would freeze (adapter slots, drafts, images, collectives, expert counts)."""
        checks = [
            (self.device.type != "cuda", f"device {self.device.type}"),
            (self.enforce_eager, "--enforce-eager"),
            (self.backend != "triton", f"attention backend {self.backend}"),
            (not self.generates, "embedding task"),
            (self.lora, "LoRA"),
            (self.speculative, "speculative decoding"),
            (self.vision, "a vision model"),
            (self.parallel, "tensor/pipeline parallelism"),
            (self.moe, "a mixture-of-experts model"),
            (self.quantized, "quantized weights"),
            (self.latent_attention, "multi-head latent attention (torch path)"),
        ]
        return next((why for off, why in checks if off), None)


def decode_graphs(
    facts: GraphFacts, forward: Forward, max_num_seqs: int, max_model_len: int, block_size: int
) -> DecodeGraphs | None:
    """Captured decode graphs for an engine, or None (with a log line saying why, on CUDA)."""
    why = facts.refusal()
    if why is not None:
        if facts.device.type == "cuda":
            log.info("CUDA graphs off (%s): decode steps run eagerly", why)
        return None
    graphs = DecodeGraphs(
        forward, capture_sizes(max_num_seqs), max_model_len, block_size, facts.device, cuda_capture()
    )
    graphs.capture_all()
    return graphs
