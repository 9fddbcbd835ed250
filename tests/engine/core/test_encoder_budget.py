"""The per-step encoder budget: a prefill chunk is cut before an image that is neither cached nor within the
step's budget; every image a chunk reads is cached or encoded in that step; randomized invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.core.encoder_cache_manager import EncoderCacheManager, needs_features
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.mm_input import MMInput
from services.engine.core.outputs import SchedulerOutput
from services.engine.core.request import Request
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from tests.engine.helpers import FakeRunner, make_request


def _sched(encoder_budget: int, capacity: int = 1000, budget: int = 64, blocks: int = 64) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        max_num_encoder_input_tokens=encoder_budget,
    )
    return Scheduler(cfg, KVCacheManager(blocks, 4), encoder_cache=EncoderCacheManager(capacity))


def _image(start: int, length: int, name: str, every_other: bool = False) -> MMInput:
    """An image at [start, start + length); ``every_other``: features at even positions only (separators)."""
    is_embed = tuple(i % 2 == 0 for i in range(length)) if every_other else None
    return MMInput(start, length, name, None, is_embed)


def _request(rid: str, n: int, images: tuple[MMInput, ...], max_tokens: int = 2) -> Request:
    """Tokens of its own (no prefix hit on another request's blocks: the test hasher keys no images)."""
    base = 1000 * (1 + sum(map(ord, rid)))
    return make_request(rid, list(range(base, base + n)), max_tokens=max_tokens, mm_inputs=images)


def test_chunk_is_cut_before_the_image_past_the_budget() -> None:
    """Budget 16: the first step runs the text, image A and the text up to B; the next step encodes B."""
    s, runner = _sched(encoder_budget=16), FakeRunner()
    s.add_request(_request("r", 60, (_image(10, 16, "A"), _image(30, 16, "B"))))
    out = s.schedule()
    assert out.num_scheduled_tokens == (("r", 30),) and out.encoder_inputs == (("r", 0),)
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == (("r", 30),) and out.encoder_inputs == (("r", 1),)


def test_second_request_waits_for_budget_and_a_shared_image_is_free() -> None:
    """The second request's image does not fit after the first's, so its chunk is cut before the image (its
    text runs); a third request reading the first one's image in the same step costs no budget."""
    s, runner = _sched(encoder_budget=20), FakeRunner()
    s.add_request(_request("a", 20, (_image(0, 16, "A"),)))
    s.add_request(_request("b", 30, (_image(5, 16, "B"),)))
    s.add_request(_request("c", 20, (_image(0, 16, "A"),)))
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"a": 20, "b": 5, "c": 20}
    assert out.encoder_inputs == (("a", 0),)
    assert s.encoder is not None and (s.encoder.queries, s.encoder.hits) == (2, 1)
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert dict(out.num_scheduled_tokens)["b"] == 25 and out.encoder_inputs == (("b", 0),)


def test_a_waiting_request_at_its_image_is_blocked_without_budget() -> None:
    s, runner = _sched(encoder_budget=16), FakeRunner()
    s.add_request(_request("a", 20, (_image(0, 16, "A"),)))
    s.add_request(_request("b", 20, (_image(0, 16, "B"),)))
    out = s.schedule()
    assert out.num_scheduled_tokens == (("a", 20),)
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert dict(out.num_scheduled_tokens)["b"] == 20 and out.encoder_inputs == (("b", 0),)


def test_separator_positions_need_no_features() -> None:
    """A window that holds only an image's separator tokens reads none of its features."""
    mm = _image(10, 6, "A", every_other=True)  # features at 10, 12, 14
    assert not needs_features(mm, 0, 10) and not needs_features(mm, 11, 12)
    assert needs_features(mm, 11, 13) and needs_features(mm, 14, 20)


def test_eviction_is_lru_of_images_not_read_in_the_step() -> None:
    cache = EncoderCacheManager(capacity=32)
    a, b, c = _image(0, 16, "A"), _image(20, 16, "B"), _image(40, 16, "C")
    cache.begin_step()
    assert cache.read_chunk((a, b), 0, 40) == [0, 1]
    cache.begin_step()
    assert cache.read_chunk((a,), 0, 16) == []  # a hit: A is now the most recent, B goes first
    assert cache.held_with({"C"}) == 16
    assert cache.read_chunk((c,), 40, 56) == [0]
    assert cache.take_freed() == ("B",) and set(cache.sizes) == {"A", "C"} and cache.used == 32
    assert (cache.queries, cache.hits) == (4, 1)
    cache.reset()
    assert cache.take_freed() == ("A", "C") and not cache.sizes and cache.used == 0


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 12), st.lists(st.integers(1, 12), max_size=3), st.integers(0, 5)),
        min_size=1,
        max_size=6,
    ),
    encoder_budget=st.integers(12, 30),
    capacity_extra=st.integers(0, 20),
    budget=st.integers(4, 40),
)
def test_invariants_over_random_image_prompts(shapes, encoder_budget, capacity_extra, budget) -> None:
    """Budget never exceeded, the cache never over capacity, every image a chunk reads is held by the runner
    (encoded then or before, not dropped since), and every request finishes."""
    s = _sched(encoder_budget, capacity=encoder_budget + capacity_extra, budget=budget, blocks=200)
    runner, held, images = FakeRunner(), set(), {}
    for i, (lead, sizes, name_pool) in enumerate(shapes):
        pos, mms = lead, []
        for j, size in enumerate(sizes):
            mms.append(_image(pos, size, f"img{(i + j) % (name_pool + 1)}-{size}", every_other=j % 2 == 1))
            pos += size + 1
        request = _request(f"r{i}", pos + 1, tuple(mms))
        images[request.request_id] = request.mm_inputs
        s.add_request(request)
    for _ in range(500):
        if not s.has_unfinished():
            break
        out = s.schedule()
        held -= set(out.freed_encoder_hashes)
        _check_step(out, images, held, encoder_budget)
        assert s.encoder is not None and s.encoder.used <= s.encoder.capacity
        s.update_from_output(out, runner.execute(out))
    assert not s.has_unfinished()


def _check_step(
    out: SchedulerOutput, images: dict[str, tuple[MMInput, ...]], held: set[str], encoder_budget: int
) -> None:
    encoded = [images[rid][i] for rid, i in out.encoder_inputs]
    assert sum(mm.num_embeds for mm in encoded) <= encoder_budget
    held |= {mm.content_hash for mm in encoded}
    starts = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
    starts |= {c.req_id: c.num_computed_tokens for c in out.cached_reqs}
    for rid, n in out.num_scheduled_tokens:
        for mm in images[rid]:
            if needs_features(mm, starts[rid], starts[rid] + n):
                assert mm.content_hash in held, (rid, mm)
