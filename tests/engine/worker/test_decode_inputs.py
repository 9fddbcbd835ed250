"""DecodeInputs advances the last decode step in place and gives exactly what a rebuild gives."""

from __future__ import annotations

import random

import torch

from services.engine.core.outputs import SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.worker.attention.cpu_backend import CpuBackend
from services.engine.worker.attention.torch_backend import TorchBackend
from services.engine.worker.decode_inputs import DecodeInputs
from services.engine.worker.input_batch import CachedRequestState, StepInputs, build_inputs

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=64)


def _states(rng: random.Random, n: int) -> dict[str, CachedRequestState]:
    out = {}
    for i in range(n):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randint(1, 20))]
        blocks = rng.sample(range(200), -(-(len(prompt) + 1) // BS))
        out[f"r{i}"] = CachedRequestState(prompt, [7], PARAMS, blocks, len(prompt), token_ids=prompt + [7])
    return out


def _sched(states: dict[str, CachedRequestState]) -> SchedulerOutput:
    return SchedulerOutput((), (), tuple((r, 1) for r in states), len(states))


def _same(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "logits_idx"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens"):
        assert torch.equal(getattr(a.meta, name).long(), getattr(b.meta, name).long()), name
    width = b.meta.block_tables.shape[1]
    assert torch.equal(a.meta.block_tables[:, :width], b.meta.block_tables), "block tables"
    assert a.sample_rows == b.sample_rows and a.meta.max_seq_len == b.meta.max_seq_len


def _step(states: dict[str, CachedRequestState], rng: random.Random, used: set[int]) -> None:
    """What the runner does after a decode step: one more token; a new block when one filled up."""
    for st in states.values():
        st.num_computed += 1
        st.token_ids.append(rng.randrange(1, 100))
        if len(st.token_ids) > len(st.block_ids) * BS:
            new = next(b for b in range(200, 10_000) if b not in used)
            used.add(new)
            st.block_ids.append(new)


def test_in_place_decode_equals_rebuild_across_block_boundaries() -> None:
    rng = random.Random(3)
    states = _states(rng, 6)
    used = {b for st in states.values() for b in st.block_ids}
    fast = DecodeInputs(CpuBackend(ops=None), BS, torch.device("cpu"))  # ops are never called here
    for _ in range(40):  # 40 tokens: every request crosses several blocks, the table outgrows its slack
        expected = build_inputs(_sched(states), states, fast.backend, BS, torch.device("cpu"))
        _same(fast.build(_sched(states), states), expected)
        _step(states, rng, used)
    assert fast.num_updated >= 30  # most steps were served in place


def test_a_changed_batch_or_a_planning_backend_rebuilds() -> None:
    rng = random.Random(4)
    states = _states(rng, 3)
    fast = DecodeInputs(CpuBackend(ops=None), BS, torch.device("cpu"))
    fast.build(_sched(states), states)
    _step(states, rng, set())
    del states["r1"]  # r1 finished: the order changed
    _same(
        fast.build(_sched(states), states),
        build_inputs(_sched(states), states, fast.backend, BS, torch.device("cpu")),
    )
    assert fast.num_updated == 0
    planning = DecodeInputs(TorchBackend(), BS, torch.device("cpu"))
    planning.build(_sched(states), states)
    _step(states, rng, set())
    planning.build(_sched(states), states)
    assert planning.num_updated == 0  # the torch backend builds its own per-step plan
