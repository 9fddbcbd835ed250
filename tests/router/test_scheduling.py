"""The pure scheduling pipeline: filters, scorers, picker, strategies and the P/D decider."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.common.kv.prefix_index import PrefixMatch
from services.router.scheduling import (
    Endpoint,
    EndpointLoad,
    MaxScorePicker,
    PDDecider,
    RequestContext,
    Scheduler,
    SchedulingConfig,
    ScorerWeights,
)
from services.router.scheduling.filters import DECODE_ROLES, eligible
from services.router.scheduling.scorers import KVUsageScorer, PrefixScorer, QueueScorer

BS = 16


def ep(url: str, role: str = "both", waiting: int = 0, kv: float = 0.0, **kw: bool) -> Endpoint:
    return Endpoint(url, role, load=EndpointLoad(waiting=waiting, kv_usage=kv), **kw)  # type: ignore[arg-type]


def ctx(prompt_tokens: int, **longest: int) -> RequestContext:
    """Matches by host name: ``a=3`` means http://a holds 3 leading blocks in gpu."""
    matches = {f"http://{h}": PrefixMatch(h, f"http://{h}", gpu=n, longest=n) for h, n in longest.items()}
    return RequestContext(prompt_tokens, BS, matches)


def test_filters_drop_unhealthy_draining_wrong_role_and_tried() -> None:
    pool = [
        ep("http://a"),
        ep("http://b", healthy=False),
        ep("http://c", draining=True),
        ep("http://p", "prefill"),
        ep("http://d", "decode"),
        ep("http://e/"),
    ]
    assert [e.url for e in eligible(pool, DECODE_ROLES)] == ["http://a", "http://d", "http://e"]
    assert [e.url for e in eligible(pool, DECODE_ROLES, exclude=["http://a/", "http://e"])] == ["http://d"]


def test_scorers() -> None:
    pool = [ep("http://a", waiting=4, kv=0.25), ep("http://b", waiting=0, kv=1.5), ep("http://c", waiting=2)]
    c = RequestContext(
        10 * BS,
        BS,
        {
            "http://a": PrefixMatch("a", "http://a", gpu=8, longest=8),
            "http://b": PrefixMatch("b", "http://b", gpu=2, cpu=10, longest=10),
        },
    )
    cpu = {"gpu": 1.0, "cpu": 0.8}
    assert PrefixScorer(cpu).score(pool, c) == pytest.approx([0.8, 0.8, 0.0])  # b's cpu blocks weigh 0.8
    assert PrefixScorer({"gpu": 1.0}).score(pool, c) == pytest.approx([0.8, 0.2, 0.0])
    assert PrefixScorer().score(pool, RequestContext(160, BS, None)) == [0.0, 0.0, 0.0]  # index down
    assert QueueScorer().score(pool, c) == [0.0, 1.0, 0.5]
    assert QueueScorer().score(pool[:1], c) == [1.0]
    assert KVUsageScorer().score(pool, c) == [0.75, 0.0, 1.0]


def test_picker_breaks_ties_at_random_with_the_injected_rng() -> None:
    pool = [ep("http://a"), ep("http://b"), ep("http://c")]
    picker = MaxScorePicker(random.Random(7))
    picks = Counter(picker.pick(pool, [1.0, 1.0, 0.5]).url for _ in range(200))
    assert set(picks) == {"http://a", "http://b"} and min(picks.values()) > 60
    again = [MaxScorePicker(random.Random(7)).pick(pool, [1.0, 1.0, 0.5]).url for _ in range(5)]
    assert len(set(again)) == 1  # same seed, same choice
    assert MaxScorePicker().pick(pool, [0.1, 0.9, 0.5]).url == "http://b"
    with pytest.raises(ValueError):
        MaxScorePicker().pick([], [])


def test_prefix_aware_weighs_cache_against_load() -> None:
    sched = Scheduler(rng=random.Random(0))
    pool = [ep("http://a", waiting=8, kv=0.5), ep("http://b"), ep("http://c", waiting=4)]
    # a holds the whole prompt: 2*1 + 0 + 0.5 = 2.5 beats idle b: 0 + 1 + 1 = 2
    d = sched.schedule(pool, ctx(160, a=10))
    assert d.decode.url == "http://a" and d.decode_choice.scores["http://a"] == pytest.approx(2.5)
    # a third of the prompt is not worth a long queue: 2/3 + 0 + 0.5 < 2
    assert sched.schedule(pool, ctx(160 * 3, a=10)).decode.url == "http://b"
    heavy = Scheduler(SchedulingConfig(weights=ScorerWeights(prefix=10)))
    assert heavy.schedule(pool, ctx(160 * 3, a=10)).decode.url == "http://a"


def test_least_load_and_round_robin_ignore_the_cache() -> None:
    pool = [ep("http://b", waiting=3), ep("http://a", waiting=1, kv=0.9), ep("http://c", waiting=2)]
    least = Scheduler(SchedulingConfig(strategy="least-load"))
    assert least.schedule(pool, ctx(160, b=10)).decode.url == "http://c"  # c: 0.5 + 1 beats a: 1 + 0.1
    rr = Scheduler(SchedulingConfig(strategy="round-robin"))
    urls = [rr.schedule(pool, ctx(160, b=10)).decode.url for _ in range(4)]
    assert urls == ["http://a", "http://b", "http://c", "http://a"]


def test_decider_threshold() -> None:
    decider = PDDecider()
    assert decider.threshold == 256
    assert decider.disaggregate(256, 0) and decider.disaggregate(300, 32)
    assert not decider.disaggregate(255, 0) and not decider.disaggregate(300, 64)
    assert decider.uncached_tokens(100, 160) == 0
    with pytest.raises(ValueError):
        PDDecider(-1)


def test_disaggregates_only_past_the_threshold_of_what_decode_lacks() -> None:
    sched = Scheduler(SchedulingConfig(pd_threshold=256), rng=random.Random(0))
    pool = [ep("http://d", "decode"), ep("http://p1", "prefill", waiting=3), ep("http://p2", "prefill")]
    short = sched.schedule(pool, ctx(255))
    assert short.prefill is None and short.uncached_tokens == 255
    long = sched.schedule(pool, ctx(1024))
    assert long.disaggregated and long.prefill.url == "http://p2" and long.decode.url == "http://d"
    cached = sched.schedule(pool, ctx(1024, d=48))  # decode holds 768 tokens: 256 left -> still split
    assert cached.disaggregated and cached.cached_tokens == 768
    mostly = sched.schedule(pool, ctx(1024, d=49))
    assert not mostly.disaggregated and mostly.uncached_tokens == 1024 - 49 * BS
    assert sched.schedule(pool, ctx(1024), exclude=["http://p2"]).prefill.url == "http://p1"


def test_no_prefill_pool_or_no_decoder() -> None:
    sched = Scheduler()
    both = [ep("http://a"), ep("http://b")]
    assert not sched.schedule(both, ctx(4096)).disaggregated  # aggregated pools never split
    assert sched.schedule([ep("http://p", "prefill")], ctx(4096)) is None
    assert sched.schedule([ep("http://a", healthy=False)], ctx(16)) is None
    assert sched.schedule([], ctx(16)) is None


def test_context_rekeys_the_index_answer_by_url() -> None:
    lookup = {"engine-7": PrefixMatch("engine-7", "http://10.0.0.7:8000/", gpu=3, longest=3)}
    c = RequestContext.from_lookup(100, BS, lookup)
    assert c.cached_tokens(ep("http://10.0.0.7:8000")) == 48
    assert c.cached_tokens(ep("http://other")) == 0
    assert RequestContext.from_lookup(100, BS, None).matches is None
    assert (
        RequestContext(40, BS, {"http://x": PrefixMatch("x", "http://x", gpu=3, longest=3)}).cached_tokens(
            ep("http://x")
        )
        == 40
    )
