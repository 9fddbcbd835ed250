"""The simulated engine against the real one on a tiny model: same token counts, same KV events."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common.kv.hashing import HASH_VERSION, BlockHasher
from services.common.kv.kv_events import KVEvent
from services.engine.core.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.llm_engine import LLMEngine
from services.sim.sim_engine import SimEngine
from services.sim.timing_model import TimingModel
from services.sim.virtual_clock import VirtualClock

BLOCKS = 24  # small: the second wave evicts the first one's blocks
SHARED = list(range(40, 75))
PROMPTS = [SHARED + [3, 4, 5], SHARED + [6, 7], list(range(100, 130)), SHARED + [3, 4, 5, 9]]


def _real(model: Path) -> tuple[dict[str, tuple[list[int], int]], list[KVEvent]]:
    """Run the prompts in two waves on the real engine (the second wave hits the first one's blocks and
    the small pool evicts): per request (output tokens, cached prompt tokens), and every KV event."""
    config = EngineConfig(
        model=str(model), dtype="float32", num_kv_blocks=BLOCKS, block_size=4, max_num_seqs=3
    )
    engine = LLMEngine(config)
    engine.core.kv_manager.pool.record_events = True
    events: list[KVEvent] = []
    out: dict[str, tuple[list[int], int]] = {}
    for wave in (PROMPTS[:3], PROMPTS[3:] + PROMPTS[:1]):
        for i, prompt in enumerate(wave):
            rid = f"w{len(out)}-{i}"
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True), rid)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = (list(o.outputs[0].token_ids), o.num_cached_tokens)
            events += engine.core.kv_manager.pool.take_events()
    return out, events


def test_the_simulated_engine_emits_the_real_engines_kv_events(llama_dir: Path) -> None:
    real, real_events = _real(llama_dir)
    timing = TimingModel(
        source="test",
        block_size=4,
        num_kv_blocks=BLOCKS,
        max_num_seqs=3,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        step_overhead_s=0.01,
        s_per_prefill_token=0.001,
        s_per_decode_seq=0.001,
    )
    clock = VirtualClock()
    sim = SimEngine("e", "both", timing, clock, BlockHasher(llama_dir.name, 4, HASH_VERSION), None)
    sim_events = sim.keep_events()
    got: dict[str, tuple[int, int]] = {}

    def listener(rid: str, new: int, finished: bool, cached: int) -> None:
        n, _ = got.get(rid, (0, 0))
        got[rid] = (n + new, cached)

    done = 0
    for wave in (PROMPTS[:3], PROMPTS[3:] + PROMPTS[:1]):
        for i, prompt in enumerate(wave):
            rid = f"w{done}-{i}"
            sim.submit(rid, prompt, real[rid][0], listener)
        asyncio.run(clock.run())
        done += len(wave)
    assert got == {rid: (len(tokens), cached) for rid, (tokens, cached) in real.items()}
    assert any(c for _, c in got.values()) and any(type(e).__name__ == "BlockRemoved" for e in real_events)
    assert sim_events == real_events


def test_a_prefill_step_costs_its_tokens_and_the_context_they_attend_to() -> None:
    """One 64-token prompt in one step: 64 x 0.001 s per token, plus 64 tokens x 32 attended on average x
    1e-6 s; then a prompt that extends it by 16 tokens over its 64 cached ones: 16 x (64 + 8) x 1e-6."""
    timing = TimingModel(
        source="test",
        block_size=16,
        num_kv_blocks=64,
        step_overhead_s=0.0,
        s_per_prefill_token=0.001,
        s_per_decode_seq=0.0,
        s_per_prefill_context_token=1e-6,
    )
    clock = VirtualClock()
    sim = SimEngine("e", "both", timing, clock, BlockHasher("m", 16, HASH_VERSION), None)
    first: dict[str, float] = {}

    def listener(rid: str, new: int, finished: bool, cached: int) -> None:
        first.setdefault(rid, clock.now)

    prompt = list(range(64))
    sim.submit("a", prompt, [1], listener)
    asyncio.run(clock.run())
    assert first["a"] == pytest.approx(64 * 0.001 + 64 * 32 * 1e-6)
    start = clock.now
    sim.submit("b", [*prompt, *range(100, 116)], [1], listener)
    asyncio.run(clock.run())
    assert first["b"] - start == pytest.approx(16 * 0.001 + 16 * (64 + 8) * 1e-6)
