"""CUDA graphs of the decode step, tested without a GPU: buckets, padding, in-place buffer updates and the
eager fallback, with a stand-in capture that re-runs the function into the graph's static output (the
graph semantics: inputs read from the persistent buffers, output written to one tensor). The engine test
runs the real Triton kernels interpreted; greedy with graphs == without on a GPU is in test_gpu_requests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from services.engine import LLM, SamplingParams
from services.engine.worker.attention.metadata import AttentionMetadata, build_metadata
from services.engine.worker.cuda_graphs import DecodeGraphs, GraphFacts, capture_sizes
from services.engine.worker.input_batch import StepInputs


def replaying_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


def test_capture_sizes_are_vllms_buckets() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(10_000)[-1] == 512


def _decode_step(ids: list[int], positions: list[int], tables: list[list[int]], bs: int = 4) -> StepInputs:
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
    meta = build_metadata([1] * len(ids), [p + 1 for p in positions], tables, slots, bs, torch.device("cpu"))
    return StepInputs(torch.tensor(ids), torch.tensor(positions), meta, list(range(len(ids))),
                      torch.arange(len(ids)))  # fmt: skip


def test_steps_are_padded_to_their_bucket_and_buffers_update_in_place() -> None:
    seen: list[AttentionMetadata] = []

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        seen.append(meta)
        return torch.stack([ids.float(), pos.float(), meta.slot_mapping.float(), meta.seq_lens.float()], 1)

    graphs = DecodeGraphs(forward, [1, 2, 4], max_model_len=64, block_size=4, device=torch.device("cpu"),
                          capture=replaying_capture)  # fmt: skip
    buffers = [graphs.input_ids.data_ptr(), graphs.slot_mapping.data_ptr(), graphs.block_tables.data_ptr()]
    step = _decode_step([7, 8, 9], [5, 0, 12], [[3, 4], [6], [1, 2, 5, 9]])
    assert graphs.serves(step) and graphs.bucket(3) == 4
    out = graphs.run(step)
    assert out.tolist() == [[7, 5, 17, 6], [8, 0, 24, 1], [9, 12, 36, 13]]
    assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 1  # the pad row writes no KV
    assert seen[-1].max_seq_len == 64 and seen[-1].block_tables.shape == (4, 16)  # the longest context
    again = graphs.run(_decode_step([1], [2], [[8]]))  # bucket 1: a second graph
    assert again.tolist() == [[1, 2, 34, 3]] and sorted(graphs.graphs) == [1, 4] and graphs.replays == 2
    nxt = graphs.run(_decode_step([4, 5], [6, 1], [[3, 4], [6]]))  # bucket 2, captured now
    assert nxt.tolist() == [[4, 6, 18, 7], [5, 1, 25, 2]]
    assert [
        graphs.input_ids.data_ptr(),
        graphs.slot_mapping.data_ptr(),
        graphs.block_tables.data_ptr(),
    ] == buffers


def test_prefill_and_oversized_steps_run_eagerly() -> None:
    graphs = DecodeGraphs(
        lambda i, p, m: i.float()[:, None], [1, 2], 32, 4, torch.device("cpu"), replaying_capture
    )
    assert not graphs.serves(_decode_step([1, 2, 3], [1, 2, 3], [[1], [2], [3]]))  # 3 > the largest bucket
    prefill = _decode_step([1, 2], [0, 1], [[1], [1]])
    prefill.meta.max_query_len = 2
    assert not graphs.serves(prefill)
    assert not graphs.serves(_decode_step([1], [40], [[1] * 11]))  # past max_model_len


def test_graph_policy_names_why_graphs_are_off() -> None:
    base = dict(device=torch.device("cuda", 0), backend="triton", enforce_eager=False, generates=True, lora=False,
                speculative=False, vision=False, parallel=False, moe=False, quantized=False)  # fmt: skip
    assert GraphFacts(**base).refusal() is None
    assert GraphFacts(**base | {"enforce_eager": True}).refusal() == "--enforce-eager"
    assert GraphFacts(**base | {"device": torch.device("cpu")}).refusal() == "device cpu"
    assert GraphFacts(**base | {"lora": True}).refusal() == "LoRA"
    assert GraphFacts(**base | {"backend": "torch"}).refusal() == "attention backend torch"
    assert (
        GraphFacts(**base | {"latent_attention": True}).refusal()
        == "multi-head latent attention (torch path)"
    )


def test_engine_greedy_with_replayed_graphs_equals_eager(llama_dir: Path) -> None:
    """The Triton backend (interpreted) with decode steps served by DecodeGraphs: same tokens as eager,
    three requests (bucket 4: one pad row) of different lengths, then two (bucket 2) as one finishes."""
    kw = dict(num_kv_blocks=64, attention_backend="triton", device="cpu", dtype="float32", max_model_len=64)
    prompts = [[5, 9, 13, 200, 7], list(range(3, 25)), [42]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 6, 3)]
    eager = [o.outputs[0].token_ids for o in LLM(model=str(llama_dir), **kw).generate(prompts, params)]
    llm = LLM(model=str(llama_dir), **kw)
    core = llm.engine.core
    runner = core.runner
    assert not isinstance(runner.graphs, DecodeGraphs)  # graphs are for CUDA only
    runner.graphs = DecodeGraphs(
        lambda ids, pos, meta: runner.model(ids, pos, runner.kv_cache, meta, runner.backend),
        [1, 2, 4], core.max_model_len, core.block_size, torch.device("cpu"), replaying_capture,
    )  # fmt: skip
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert graphed == eager and runner.graphs.replays >= 5 and sorted(runner.graphs.graphs) == [2, 4]
