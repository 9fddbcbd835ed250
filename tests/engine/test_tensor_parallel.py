"""Tensor parallelism on CPU (gloo, 2 processes): TP=2 greedy tokens equal TP=1 (chunked, preempted,
prefix-cached; dense, replicated KV heads, MoE, sliding window), each rank holds its shard, seeded
sampling agrees across ranks, a killed rank stops the engine loudly, unsupported settings are refused."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.engine import LLM, SamplingParams
from services.engine.executor.worker_messages import WorkerDiedError
from tests.engine.entrypoints.helpers import MODEL, start_server
from tests.engine_harness import start_in_process

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompts(n: int = 16, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 200] + [rng.randint(1, 300) for _ in range(n - 5)]
    return [[rng.randrange(3, 400) for _ in range(k)] for k in lengths]


def _shared(seed: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 400) for _ in range(70)]
    return [prefix + [rng.randrange(3, 400) for _ in range(rng.randint(1, 30))] for _ in range(6)]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _pair(model: Path, **kw) -> Iterator[tuple[LLM, LLM]]:
    one = LLM(model=str(model), dtype="float32", **kw)
    two = LLM(model=str(model), dtype="float32", tensor_parallel_size=2, **kw)
    try:
        yield one, two
    finally:
        two.shutdown()


@pytest.fixture(scope="module")
def llama_pair(llama_dir: Path) -> Iterator[tuple[LLM, LLM]]:
    yield from _pair(llama_dir, num_kv_blocks=512, max_num_batched_tokens=37, max_num_seqs=8)


def test_tp2_equals_tp1_chunked_and_prefix_cached(llama_pair) -> None:
    one, two = llama_pair
    assert _tokens(two, _prompts()) == _tokens(one, _prompts())
    shared = _shared()
    assert _tokens(two, shared) == _tokens(one, shared)
    again = two.generate(shared, GREEDY)  # the prefix is cached on every rank
    assert [o.outputs[0].token_ids for o in again] == _tokens(one, shared)
    assert all(o.num_cached_tokens >= 64 for o in again)


def test_each_rank_holds_its_shard(llama_pair) -> None:
    one, two = llama_pair
    full, shard = one.worker_stats(), two.worker_stats()
    assert shard.weight_bytes < 0.6 * full.weight_bytes  # norms (and nothing else) are replicated
    assert shard.kv_cache_shape[4] == full.kv_cache_shape[4] // 2


def test_seeded_sampling_agrees_across_ranks(llama_pair) -> None:
    """Every rank samples from the same all-gathered logits with the same seeds: rank 0 checks that the
    workers' tokens equal its own each step (a mismatch would raise WorkerDiedError)."""
    _, two = llama_pair
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)
    outs = _tokens(two, _prompts(6), params)
    assert all(len(t) == 12 for t in outs)


def test_tp2_equals_tp1_under_preemption(llama_dir: Path) -> None:
    for one, two in _pair(llama_dir, num_kv_blocks=40, max_num_seqs=16, max_model_len=512):
        assert _tokens(two, _prompts()) == _tokens(one, _prompts())
        assert two.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", ["qwen2", "mixtral", "phi3"])
def test_tp2_equals_tp1_across_families(kind: str, family_dir, qwen2_dir: Path) -> None:
    """Qwen2: one KV head, replicated on both ranks; Mixtral: every expert's MLP sharded; Phi-3: fused
    checkpoint tensors split per rank and a sliding window that frees blocks."""
    model = qwen2_dir if kind == "qwen2" else family_dir(kind)
    for one, two in _pair(model, num_kv_blocks=256, max_num_batched_tokens=61):
        assert _tokens(two, _prompts(8)) == _tokens(one, _prompts(8))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_tp2_equals_tp1_with_speculative_decoding(llama_dir: Path, method: str, tmp_path: Path) -> None:
    """n-gram, draft-model and EAGLE speculation under TP=2: drafts proposed on rank 0 (the draft, or the
    EAGLE head with whole copies of the target's embedding and LM head, unsharded), verified alike on
    every rank; greedy and seeded tokens equal TP=1's."""
    from tests.checkpoints import build_eagle_head

    model = {"ngram": None, "draft_model": llama_dir, "eagle": None}[method]
    if method == "eagle":
        model = build_eagle_head(llama_dir, tmp_path / "eagle")
    spec = {"method": method, "num_speculative_tokens": 3} | ({"model": str(model)} if model else {})
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(3, 40)), [9] * 5]
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    for one, two in _pair(llama_dir, num_kv_blocks=128, speculative_config=spec):
        assert _tokens(two, prompts) == _tokens(one, prompts)
        assert _tokens(two, prompts, seeded) == _tokens(one, prompts, seeded)
        assert two.worker_stats().speculative


def test_unsupported_settings_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_offload_cpu_bytes is not supported with tensor parallelism yet"):
        LLM(model=str(llama_dir), tensor_parallel_size=2, kv_offload_cpu_bytes=2**20)
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=4"):
        LLM(model=str(llama_dir), tensor_parallel_size=3)


def test_a_killed_rank_fails_requests_and_health(llama_dir: Path) -> None:
    engine = start_in_process(llama_dir, "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        core = engine.ctx.llm.engine.core
        (worker,) = core._parallel.procs
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        # a healthy step first; the generous timeout is for a loaded CI machine (it once took > 30 s there)
        assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120).status_code == 200
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        r = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=90)
        # the rank's death is found by this request's step, or already by an idle step before it
        assert r.status_code >= 500 and ("tensor-parallel rank 1" in r.text or "not ready" in r.text), r.text
        assert time.monotonic() - start < 30
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 503
        assert isinstance(engine.ctx.llm.fatal, WorkerDiedError) and "rank 1" in str(engine.ctx.llm.fatal)
    finally:
        engine.stop()


def _rank_processes(pid: int) -> list[int]:
    """The spawned tensor-parallel workers among a process's children (not multiprocessing's tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"multiprocessing.spawn" in cmd and b"resource_tracker" not in cmd:
                out.append(int(child))
    return out


def test_serve_exits_nonzero_when_a_rank_dies(llama_dir: Path, tmp_path: Path) -> None:
    """So that Kubernetes restarts the pod: the serving process ends with exit code 1."""
    server = start_server(llama_dir, tmp_path, "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        (worker,) = _rank_processes(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        with contextlib.suppress(httpx.TransportError):  # the server may already be closing
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=90)
        assert server.proc.wait(timeout=60) == 1
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.mark.gpu
def test_tp2_equals_tp1_on_two_gpus_with_nccl(llama_dir: Path) -> None:
    """The same equality over NCCL on two CUDA devices (skipped without two)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    for one, two in _pair(llama_dir, num_kv_blocks=512, max_num_batched_tokens=37, device="cuda"):
        assert _tokens(two, _prompts()) == _tokens(one, _prompts())
