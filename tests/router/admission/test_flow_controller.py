"""FlowController and Admission on the event loop: requests wait while the pool is full and leave in band
and fair order as room appears; TTL -> 429 with Retry-After; a client that leaves is out of the queue at once;
a client cannot raise its band; the critical band is not slowed by any amount of sheddable load."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.openai.errors import OpenAIError
from services.router.admission.admission import Admission, Lease
from services.router.admission.admission_settings import AdmissionSettings
from services.router.admission.saturation import SaturationLimits
from services.router.admission.tenants import Band, Quota, Tenant
from services.router.scheduling.endpoint import Endpoint, EndpointLoad

GOLD = Tenant(name="gold", key_id="k-gold", band=Band.critical, quota=Quota())
BULK = Tenant(name="bulk", key_id="k-bulk", band=Band.sheddable, quota=Quota())
TEAM = Tenant(name="team", key_id="k-team", band=Band.standard, quota=Quota())


def _admission(engines: list[Endpoint], **kw: object) -> Admission:
    settings = AdmissionSettings(
        flow_control=True,
        tenants=(GOLD, BULK, TEAM),
        max_inflight_per_engine=1,
        **kw,  # type: ignore[arg-type]
    )
    return Admission(settings, lambda: engines, CollectorRegistry())


def _count(adm: Admission, outcome: str, reason: str) -> float:
    return adm.metrics.decisions.labels(outcome=outcome, reason=reason)._value.get()


def on_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on a fresh event loop."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


@on_loop
async def test_requests_wait_while_full_and_leave_bands_first_then_fairly() -> None:
    adm = _admission([Endpoint("http://e1")])
    first = await adm.admit("k-team", None, 10, 10)  # the one slot
    order: list[str] = []

    async def wait(key: str, tag: str, cost: int = 10) -> Lease:
        lease = await adm.admit(key, None, cost, 0)
        order.append(tag)
        return lease

    tasks = [asyncio.create_task(wait("k-bulk", "bulk1")), asyncio.create_task(wait("k-team", "team1"))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(wait("k-gold", "gold1")), asyncio.create_task(wait("k-bulk", "bulk2"))]
    tasks += [asyncio.create_task(wait("k-gold", "gold2"))]
    await asyncio.sleep(0.01)
    assert order == [] and len(adm.flow.queue) == 5
    current, seen = first, set()
    while len(order) < 5:
        current.finish(0)  # the request in flight ends: exactly one queued one goes
        await asyncio.sleep(0.01)
        fresh = [t for t in tasks if t.done() and t not in seen]
        assert len(fresh) == 1
        seen.add(fresh[0])
        current = fresh[0].result()
    assert order == ["gold1", "gold2", "team1", "bulk1", "bulk2"]
    assert _count(adm, "admitted", "queued") == 5 and _count(adm, "admitted", "immediate") == 1


@on_loop
async def test_a_queued_request_expires_into_a_429_with_retry_after() -> None:
    adm = _admission([], queue_ttl_s={Band.sheddable: 0.2})  # no engine in rotation: everything is held
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(OpenAIError) as refused:
        await adm.admit("k-bulk", None, 5, 5)
    assert 0.19 < asyncio.get_running_loop().time() - t0 < 1.0
    err = refused.value
    assert err.status == 429 and err.info.code == "queue_ttl" and int(err.headers["Retry-After"]) >= 1
    assert len(adm.flow.queue) == 0 and _count(adm, "rejected", "queue_ttl") == 1


@on_loop
async def test_a_client_that_disconnects_leaves_the_queue_at_once() -> None:
    adm = _admission([])
    gone = asyncio.Event()
    task = asyncio.create_task(adm.admit("k-team", None, 5, 5, gone.wait))
    await asyncio.sleep(0.01)
    assert adm.flow.queue.length(Band.standard, "team") == 1
    gone.set()
    with pytest.raises(OpenAIError):
        await asyncio.wait_for(task, 1.0)
    assert len(adm.flow.queue) == 0 and _count(adm, "rejected", "client_gone") == 1


@on_loop
async def test_a_client_may_lower_its_band_never_raise_it() -> None:
    adm = _admission([Endpoint("http://e1")])
    assert (await adm.admit("k-team", "sheddable", 1, 1)).band is Band.sheddable
    with pytest.raises(OpenAIError) as raised:
        await adm.admit("k-team", "critical", 1, 1)
    assert raised.value.status == 403 and raised.value.info.param == "x-kvferry-band"
    with pytest.raises(OpenAIError) as bad:
        await adm.admit("k-team", "urgent", 1, 1)
    assert bad.value.status == 400 and bad.value.info.param == "x-kvferry-band"


@on_loop
async def test_sheddable_requests_are_shed_first_when_the_queue_is_full() -> None:
    adm = _admission([], max_queue=2)
    bulk = asyncio.create_task(adm.admit("k-bulk", None, 1, 1))
    team = asyncio.create_task(adm.admit("k-team", None, 1, 1))
    await asyncio.sleep(0.01)
    gold = asyncio.create_task(adm.admit("k-gold", None, 1, 1))
    await asyncio.sleep(0.01)
    with pytest.raises(OpenAIError) as shed:
        await bulk
    assert shed.value.status == 429 and shed.value.info.code == "shed"
    assert not gold.done() and not team.done() and _count(adm, "shed", "shed") == 1
    for t in (gold, team):
        t.cancel()
    await asyncio.gather(gold, team, return_exceptions=True)
    assert len(adm.flow.queue) == 0


@on_loop
async def test_the_critical_band_waits_the_same_under_any_sheddable_backlog() -> None:
    """A saturated engine (polled waiting over the limit) holds everyone; as room appears, critical requests
    leave first: their wait does not grow with the sheddable backlog."""
    engine = [Endpoint("http://e1", load=EndpointLoad(waiting=50))]
    adm = _admission(engine)
    adm.detector.limits = SaturationLimits(max_waiting=8, max_inflight_per_engine=None)
    bulk = [asyncio.create_task(adm.admit("k-bulk", None, 1, 1)) for _ in range(200)]
    gold = [asyncio.create_task(adm.admit("k-gold", None, 1, 1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    engine[0] = Endpoint("http://e1", load=EndpointLoad(waiting=0))
    adm.detector.limits = SaturationLimits(max_waiting=8, max_inflight_per_engine=3)
    adm.kick()
    await asyncio.sleep(0.01)
    assert all(t.done() for t in gold) and not any(t.done() for t in bulk)
    for t in bulk:
        t.cancel()
    await asyncio.gather(*bulk, return_exceptions=True)


@on_loop
async def test_engines_appearing_release_the_held_queue_at_their_admission_rate() -> None:
    """Scale from zero: 30 held requests; the first engine's poll releases max_waiting (8) of them, a finished
    request lets one more go, and the next poll (real loads) lets the rest go while there is room."""
    engines: list[Endpoint] = []
    adm = Admission(
        AdmissionSettings(flow_control=True, tenants=(TEAM,)), lambda: engines, CollectorRegistry()
    )
    held = [asyncio.create_task(adm.admit("k-team", None, 1, 1)) for _ in range(30)]
    await asyncio.sleep(0.01)
    adm.kick()  # a poll: still no engine
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in held)
    engines.append(Endpoint("http://e1"))
    adm.kick()  # the poll that sees the first engine ready
    await asyncio.sleep(0.01)
    done = [t for t in held if t.done()]
    assert len(done) == 8 and adm.flow.inflight == 8
    done[0].result().finish(1)
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in held) == 9
    engines[0] = Endpoint("http://e1", load=EndpointLoad(waiting=2, running=6))
    adm.kick()  # the next poll: the engine's real load, 2 waiting of 8
    await asyncio.sleep(0.01)
    assert all(t.done() for t in held)


@on_loop
async def test_sheddable_requests_leave_reserved_room_for_the_other_bands() -> None:
    """--sheddable-share 0.5 of 4 slots: sheddable requests fill 2, then wait; critical ones still get in."""
    engines = [Endpoint("http://e1")]
    settings = AdmissionSettings(
        flow_control=True, tenants=(GOLD, BULK), max_inflight_per_engine=4, sheddable_share=0.5
    )
    adm = Admission(settings, lambda: engines, CollectorRegistry())
    bulk = [asyncio.create_task(adm.admit("k-bulk", None, 1, 1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert [t.done() for t in bulk] == [True, True, False]
    gold = [await asyncio.wait_for(adm.admit("k-gold", None, 1, 1), 1) for _ in range(2)]
    assert adm.flow.inflight == 4 and not bulk[2].done()
    for lease in [bulk[0].result(), bulk[1].result(), *gold]:
        lease.finish(1)
    await asyncio.sleep(0.01)
    assert bulk[2].done() and adm.flow.inflight == 1
