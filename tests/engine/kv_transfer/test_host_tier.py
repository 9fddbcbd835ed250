"""The host-memory KV tier: blocks evicted from the primary pool come back from host memory, token for
token the same as never evicted; a full tier or queue drops stores (counted) and changes no output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.kv_transfer.host_tier import HostKVTier

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block_size x KV heads x head_dim x fp32


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(length)] for _ in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def baseline(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=256)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_evicted_prefixes_come_back_from_host_memory(llama_dir: Path, baseline: LLM, policy: str) -> None:
    """16 primary blocks of 16 tokens: a 100-token prompt's 6 full blocks are evicted by the next prompts,
    then found in the host tier (loaded back, not recomputed), with the same tokens, under either policy."""
    llm = LLM(
        model=str(llama_dir), dtype="float32", num_kv_blocks=16, max_num_seqs=2, kv_offload_cpu_bytes=2**22,
        kv_offload_policy=policy,
    )  # fmt: skip
    first, others = _prompts(1, 1, 100), _prompts(2, 6, 100)
    assert _tokens(llm, first) == _tokens(baseline, first)
    for prompt in others:  # one at a time: each fills the primary pool
        assert _tokens(llm, [prompt]) == _tokens(baseline, [prompt])
    again = llm.generate(first, GREEDY)[0]
    assert again.outputs[0].token_ids == _tokens(baseline, first)[0]
    assert again.num_cached_tokens >= 96  # six blocks, none recomputed
    blocks, failures = llm.engine.core.transfer_stats()
    assert blocks[("received", "cpu")] >= 6 and blocks[("sent", "cpu")] >= 6
    assert not failures
    llm.shutdown()


def test_a_tier_too_small_drops_stores_and_changes_nothing(llama_dir: Path, baseline: LLM) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=16, max_num_seqs=2,
              kv_offload_cpu_bytes=2 * PER_BLOCK)  # fmt: skip
    prompts = _prompts(3, 4, 100)
    assert [_tokens(llm, [p])[0] for p in prompts] == _tokens(baseline, prompts)
    _, failures = llm.engine.core.transfer_stats()
    assert failures["offload_dropped"] >= 1
    with pytest.raises(ValueError, match="kv_offload_cpu_bytes=100: below one KV block"):
        LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=16, kv_offload_cpu_bytes=100)
    llm.shutdown()


def test_tier_lru_pins_and_queue() -> None:
    kv = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)  # 6 blocks of 4 values
    tier = HostKVTier(kv, num_slots=2, queue_depth=4)
    try:
        assert tier.store("a", [0, 1], [b"h0", b"h1"])
        _wait(tier, 1)
        pinned = tier.lookup([b"h0", b"h1", b"h2"])
        assert len(pinned) == 2  # stops at the first miss
        assert not tier.store("b", [2], [b"h2"])  # both slots pinned: dropped, counted
        assert tier.dropped == 1
        assert tier.load("c", [4, 5], pinned)
        _wait(tier, 1)
        assert torch.equal(kv[4:6], kv[0:2])
        assert tier.store("d", [3], [b"h3"])  # unpinned now: the least recently used slot goes
        _wait(tier, 1)
        assert tier.lookup([b"h3"]) and tier.evicted == 1 and tier.used == 2
    finally:
        tier.close()


def _wait(tier: HostKVTier, jobs: int) -> None:
    import time

    done: list = []
    deadline = time.monotonic() + 10
    while len(done) < jobs and time.monotonic() < deadline:
        done += tier.finished()
        time.sleep(0.01)
    assert len(done) == jobs and all(ok for _, ok in done)


def _disk_engine(llama_dir: Path, folder: Path) -> LLM:
    """Four host slots; what they evict goes to disk."""
    return LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=16, max_num_seqs=2,
               kv_offload_cpu_bytes=4 * PER_BLOCK, kv_offload_disk_path=str(folder),
               kv_offload_disk_bytes=2**22)  # fmt: skip


def test_blocks_demoted_to_disk_come_back_and_survive_a_restart(
    llama_dir: Path, baseline: LLM, tmp_path: Path
) -> None:
    first, others = _prompts(4, 1, 100), _prompts(5, 3, 100)
    expected = _tokens(baseline, first)
    llm = _disk_engine(llama_dir, tmp_path / "kv")
    assert _tokens(llm, first) == expected
    for prompt in others:  # each evicts the previous prompt's blocks: primary -> host -> disk
        assert _tokens(llm, [prompt]) == _tokens(baseline, [prompt])
    again = llm.generate(first, GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0] and again.num_cached_tokens >= 64
    blocks, failures = llm.engine.core.transfer_stats()
    assert blocks[("sent", "disk")] >= 4 and blocks[("received", "disk")] >= 4
    assert set(failures) == {"offload_dropped"}  # six blocks a prompt, four host slots: the tail is dropped
    llm.shutdown()
    files = sorted((tmp_path / "kv").glob("*.kvb"))
    assert files
    restarted = _disk_engine(llama_dir, tmp_path / "kv")  # the files of the last run are found again
    out = restarted.generate(_prompts(5, 3, 100)[1:2], GREEDY)[0]
    assert out.outputs[0].token_ids == _tokens(baseline, _prompts(5, 3, 100)[1:2])[0]
    assert out.num_cached_tokens >= 64
    restarted.shutdown()


@pytest.mark.parametrize("damage", ["flip", "truncate", "layout"])
def test_a_damaged_block_file_is_never_served(
    llama_dir: Path, baseline: LLM, tmp_path: Path, damage: str
) -> None:
    prompts = _prompts(6, 3, 100)
    llm = _disk_engine(llama_dir, tmp_path / "kv")
    for prompt in prompts:
        _tokens(llm, [prompt])
    llm.shutdown()
    for path in (tmp_path / "kv").glob("*.kvb"):
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-5] ^= 0xFF
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data[10] ^= 0xFF  # the layout digest: another model's or dtype's block
        path.write_bytes(bytes(data))
    again = _disk_engine(llama_dir, tmp_path / "kv")
    out = again.generate(prompts[:1], GREEDY)[0]
    assert out.outputs[0].token_ids == _tokens(baseline, prompts[:1])[0]  # recomputed
    _, failures = again.engine.core.transfer_stats()
    assert failures["offload_disk_corrupt"] >= 1
    again.shutdown()


def test_tier_log_keeps_the_order_of_changes() -> None:
    """A block stored then evicted between two steps ends removed; one evicted then stored again ends held."""
    from services.common.kv.kv_events import BlockRemoved, BlockStored
    from services.engine.kv_transfer.tier_log import TierLog

    log = TierLog("disk")
    log.stored([b"a", b"b"])
    log.removed([b"a"])
    log.removed([b"c"])
    log.stored([b"c"])
    assert log.take(16) == [
        BlockStored((b"a", b"b"), None, (), 16, "disk"),
        BlockRemoved((b"a", b"c"), "disk"),
        BlockStored((b"c",), None, (), 16, "disk"),
    ]
    assert log.take(16) == []


@pytest.mark.parametrize(("policy", "kept"), [("lru", 0), ("arc", 2)])
def test_arc_keeps_a_reused_prefix_through_a_scan(policy: str, kept: int) -> None:
    """Four slots: a prefix used twice, then a scan of six one-off blocks. LRU flushes the prefix; ARC
    evicts only among the blocks seen once (and keeps the reused ones)."""
    kv = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
    tier = HostKVTier(kv, num_slots=4, queue_depth=8, policy=policy)
    try:
        assert tier.store("hot", [0, 1], [b"h0", b"h1"])
        _wait(tier, 1)
        tier.unpin(tier.lookup([b"h0", b"h1"]))  # used again
        for i in range(6):
            assert tier.store(f"scan{i}", [2 + i], [b"s%d" % i])
            _wait(tier, 1)
        slots = tier.lookup([b"h0", b"h1"])
        tier.unpin(slots)
        assert len(slots) == kept and tier.used == 4
        assert tier.lookup([b"s5"])  # the scan's latest block is held either way
    finally:
        tier.close()


def test_a_policy_needs_the_host_tier(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_offload_policy: the host tier's eviction policy"):
        LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=16, kv_offload_policy="arc")


def test_arc_adapts_to_blocks_stored_again_after_their_eviction() -> None:
    """A block evicted from the seen-once list and stored again soon after goes to the reused list and grows
    the seen-once target; pinned blocks are never chosen."""
    from services.engine.kv_transfer.arc_policy import ARCPolicy

    arc = ARCPolicy(capacity=2)
    arc.admit(b"a")
    arc.admit(b"b")
    assert arc.evict(lambda k: k == b"a") == b"b"  # a is pinned: b goes (to the ghosts)
    assert arc.evict(lambda k: True) is None  # every held block pinned: nothing to evict
    arc.admit(b"b")  # back soon after its eviction
    assert arc.p == 1.0 and list(arc.t2) == [b"b"] and list(arc.t1) == [b"a"]
