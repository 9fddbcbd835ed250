"""FairQueue's order (hypothesis): bands in order, FIFO within a tenant, fair share by tokens across
backlogged tenants, a new tenant served among the next ``tenants`` (no starvation), shedding lowest first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.admission.fair_queue import FairQueue, QueueItem
from services.router.admission.tenants import Band

bands = st.sampled_from(list(Band))
tenants = st.sampled_from(["a", "b", "c", "d"])
costs = st.integers(1, 4000)
items = st.builds(lambda b, t, c: QueueItem(b, t, c, deadline=1e9), bands, tenants, costs)


@settings(max_examples=200, deadline=None)
@given(st.lists(items, max_size=60))
def test_bands_in_order_and_fifo_within_a_tenant(batch: list[QueueItem]) -> None:
    q = FairQueue(capacity=1000)
    for item in batch:
        assert q.push(item) is None
    out = [q.pop() for _ in batch]
    assert q.pop() is None and len(q) == 0
    assert sorted(map(id, out)) == sorted(map(id, batch))  # every item leaves exactly once
    assert [i.band for i in out] == sorted(i.band for i in batch)  # never a less important band first
    for tenant in "abcd":
        for band in Band:
            mine = [i for i in batch if i.tenant == tenant and i.band == band]
            assert [i for i in out if i.tenant == tenant and i.band == band] == mine


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(2, 4), min_size=2, max_size=2), st.data())
def test_backlogged_tenants_share_tokens_within_ten_percent(counts: list[int], data: st.DataObject) -> None:
    """Tenants with different request sizes, all backlogged (kept topped up): over a window of 20 x the
    largest request per tenant, each gets within 10% of an equal share of the tokens served."""
    q = FairQueue(capacity=10_000)
    names = [f"t{i}" for i in range(counts[0])]
    size = {t: data.draw(st.integers(20, 500), label=f"cost {t}") for t in names}
    for t in names:
        for _ in range(3):
            q.push(QueueItem(Band.standard, t, size[t], 1e9))
    served = dict.fromkeys(names, 0)
    window = 20 * max(size.values()) * len(names)
    while sum(served.values()) < window:
        item = q.pop()
        assert item is not None
        served[item.tenant] += item.cost
        q.push(QueueItem(Band.standard, item.tenant, size[item.tenant], 1e9))  # still backlogged
    share = sum(served.values()) / len(names)
    for t in names:
        assert abs(served[t] - share) <= 0.10 * share, (served, size)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tenants, costs), min_size=1, max_size=80), costs, st.integers(0, 40))
def test_a_new_tenant_is_among_the_next_tenants_served(
    backlog: list[tuple[str, int]], cost: int, served_first: int
) -> None:
    """No starvation: however big the other tenants' backlog, an idle tenant's request leaves within
    ``number of tenants`` pops (so well within its TTL while the pool admits anything)."""
    q = FairQueue(capacity=1000)
    for tenant, c in backlog:
        q.push(QueueItem(Band.standard, tenant, c, 1e9))
    for _ in range(min(served_first, len(backlog))):
        q.pop()
    mine = QueueItem(Band.standard, "new", cost, 1e9)
    q.push(mine)
    waiting_tenants = {i.tenant for i in q} - {"new"}
    for _ in range(len(waiting_tenants) + 1):
        if q.pop() is mine:
            return
    raise AssertionError("the new tenant's request waited behind more than one request per tenant")


@settings(max_examples=100, deadline=None)
@given(st.lists(items, min_size=1, max_size=40), st.data())
def test_removed_and_expired_items_leave_and_others_keep_their_order(
    batch: list[QueueItem], data: st.DataObject
) -> None:
    q = FairQueue(capacity=1000)
    for n, item in enumerate(batch):
        item.deadline = float(n)
        q.push(item)
    gone = data.draw(st.lists(st.sampled_from(batch), unique_by=id), label="disconnected")
    for item in gone:
        assert q.remove(item) and not q.remove(item)
    now = data.draw(st.floats(-1, len(batch)), label="now")
    expired = q.expired(now)
    assert all(i.deadline <= now for i in expired) and all(i.deadline > now for i in q)
    left = [q.pop() for _ in range(len(q))]
    assert {id(i) for i in left} | {id(i) for i in expired} | {id(i) for i in gone} == {id(i) for i in batch}
    assert [i.band for i in left] == sorted(i.band for i in left)


def test_a_full_queue_sheds_the_newest_sheddable_first_and_refuses_below() -> None:
    q = FairQueue(capacity=3)
    old_shed = QueueItem(Band.sheddable, "b", 10, 1e9)
    new_shed = QueueItem(Band.sheddable, "b", 10, 1e9)
    std = QueueItem(Band.standard, "a", 10, 1e9)
    for item in (old_shed, new_shed, std):
        assert q.push(item) is None
    crit = QueueItem(Band.critical, "a", 10, 1e9)
    assert q.push(crit) is new_shed  # the newest of the least important band goes
    another = QueueItem(Band.sheddable, "c", 10, 1e9)
    assert q.push(another) is another  # nothing below sheddable: the newcomer is refused
    std2 = QueueItem(Band.standard, "c", 10, 1e9)
    assert q.push(std2) is old_shed
    assert [q.pop() for _ in range(3)] == [crit, std, std2]
