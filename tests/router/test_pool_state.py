"""The pool page's data: the decision log, the engine history, and the ``/ui`` routes of the router app
(served in-process without its lifespan: no engine is needed to read the state the page is given)."""

from __future__ import annotations

import base64
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from services.common.kv.prefix_index import PrefixMatch
from services.common.openai.protocol import CompletionRequest
from services.common.pool.load_report import LoadReport
from services.router.app import build_app
from services.router.decision_log import DecisionLog
from services.router.endpoints import EndpointSpec
from services.router.engine_history import EngineHistory
from services.router.prompt import PreparedRequest
from services.router.router_state import RouterState
from services.router.scheduling import (
    Endpoint,
    EndpointLoad,
    RequestContext,
    Scheduler,
    SchedulingConfig,
    ScorerWeights,
)
from services.router.settings import RouterSettings

BS = 16
A, B, P = "http://a:8000", "http://b:8000", "http://p:8000"


def _req(tokens: int, stream: bool = False, **body: object) -> PreparedRequest:
    return PreparedRequest("completion", [list(range(tokens))], [], {"max_tokens": 2, **body}, stream)


def _ctx(tokens: int, **blocks: int) -> RequestContext:
    """``a=3``: http://a:8000 holds the prompt's first 3 blocks."""
    urls = {"a": A, "b": B, "p": P}
    matches = {urls[h]: PrefixMatch(h, urls[h], gpu=n, longest=n) for h, n in blocks.items()}
    return RequestContext(tokens, BS, matches)


def test_a_decision_records_each_scorers_part_of_every_candidates_total() -> None:
    sched = Scheduler(rng=random.Random(0))
    pool = [Endpoint(A, load=EndpointLoad(waiting=4, kv_usage=0.5)), Endpoint(B)]
    log = DecisionLog(threshold=256, has_index=True, clock=lambda: 1000.0)
    ctx = _ctx(160, a=10)
    decision = sched.schedule(pool, ctx)
    assert decision is not None
    log.add(decision, _req(160), ctx, "req-1", 0)
    (record,) = log.recent()
    by_url = {c.url: c for c in record.candidates}
    assert record.decode == A and by_url[A].chosen and not by_url[B].chosen
    assert by_url[A].parts == pytest.approx({"prefix": 2.0, "queue": 0.0, "kv": 0.5})
    assert by_url[B].parts == pytest.approx({"prefix": 0.0, "queue": 1.0, "kv": 1.0})
    for c in record.candidates:
        assert c.total == pytest.approx(sum(c.parts.values()))
    assert by_url[A].cached_tokens == 160 and by_url[B].cached_tokens == 0
    assert by_url[A].tiers == {"gpu": 10} and by_url[B].tiers == {}
    assert (record.seq, record.at, record.request_id, record.attempt) == (1, 1000.0, "req-1", 0)
    assert (record.mode, record.index, record.prompt_blocks) == ("aggregated", "ok", 10)
    assert record.pd_reason == "aggregated pool: the engine computes the whole prompt"


def test_the_pd_decision_says_why() -> None:
    sched = Scheduler(SchedulingConfig(pd_threshold=256), rng=random.Random(0))
    pool = [Endpoint(A, "decode"), Endpoint(P, "prefill")]
    log = DecisionLog(threshold=256, has_index=True)

    def reason(
        tokens: int, req: PreparedRequest | None = None, endpoints: list[Endpoint] = pool, **kw: int
    ) -> str:
        ctx = _ctx(tokens, **kw)
        if req is not None and not req.splittable:
            ctx = RequestContext(tokens, BS, ctx.matches, splittable=False)
        decision = sched.schedule(endpoints, ctx)
        assert decision is not None
        log.add(decision, req or _req(tokens), ctx, "r", 0)
        return log.recent(1)[0].pd_reason

    assert reason(1024) == "1024 uncached tokens >= threshold 256: a prefill engine computes them"
    assert reason(1024, a=60) == "64 uncached tokens < threshold 256: decode computes the rest itself"
    assert reason(1024, _req(1024, prompt_logprobs=1)).startswith("decode computes the prompt: several")
    no_prefill = [Endpoint(A, "decode"), Endpoint(P, "prefill", healthy=False)]
    assert reason(1024, endpoints=no_prefill).endswith("but no prefill engine was eligible")
    split = log.recent(4)[-1]
    assert split.mode == "disaggregated" and split.prefill == P
    assert [c.url for c in split.prefill_candidates] == [P] and split.prefill_candidates[0].chosen
    assert {r.mode for r in log.recent()[:3]} == {"decode_only"}
    assert log.counts == {"disaggregated": 1, "decode_only": 3}


def test_the_log_is_bounded_newest_first_and_knows_the_index_state() -> None:
    log = DecisionLog(threshold=256, has_index=False, capacity=3)
    sched = Scheduler(SchedulingConfig(strategy="round-robin"))
    for i in range(5):
        ctx = RequestContext(32, BS, None)
        decision = sched.schedule([Endpoint(A), Endpoint(B)], ctx)
        assert decision is not None
        log.add(decision, _req(32), ctx, f"r{i}", 0)
    assert [r.request_id for r in log.recent()] == ["r4", "r3", "r2"]
    assert [r.request_id for r in log.recent(1)] == ["r4"]
    assert log.counts["aggregated"] == 5 and log.recent()[0].index == "off"
    only = log.recent()[0].candidates  # round-robin weighs nobody: the chosen engine, without scores
    assert len(only) == 1 and only[0].chosen and only[0].total is None and only[0].parts == {}
    down = DecisionLog(threshold=256, has_index=True)
    d = sched.schedule([Endpoint(A)], RequestContext(32, BS, None))
    assert d is not None
    down.add(d, _req(32), RequestContext(32, BS, None), "x", 1)
    assert down.recent()[0].index == "down" and down.recent()[0].attempt == 1


def _report(ttft: tuple[float, float], itl: tuple[float, float], hits: float = 0.0) -> LoadReport:
    return LoadReport(
        ttft_sum=ttft[0],
        ttft_count=ttft[1],
        itl_sum=itl[0],
        itl_count=itl[1],
        prefix_cache_queries=100.0,
        prefix_cache_hits=hits,
    )


def test_history_keeps_per_poll_means_with_gaps() -> None:
    now = iter(range(100, 200))
    history = EngineHistory(points=4, clock=lambda: float(next(now)))
    history.observe({A: _report((0.0, 0), (0.0, 0)), B: None})
    history.observe({A: _report((0.3, 2), (0.1, 10)), B: None})  # 2 first tokens: 150 ms mean
    history.observe({A: _report((0.3, 2), (0.1, 10)), B: _report((1.0, 1), (0.0, 0))})  # A idle
    history.observe({A: _report((0.5, 3), (0.16, 13), hits=40)})  # B left the pool
    history.observe({A: _report((0.1, 1), (0.0, 0))})  # A restarted: its counters went back
    points = history.points(A)
    assert len(points) == 4 and [p.at for p in points] == [101.0, 102.0, 103.0, 104.0]
    assert [p.ttft_s for p in points] == pytest.approx([0.15, None, 0.2, None])
    assert [p.itl_s for p in points] == pytest.approx([0.01, None, 0.02, None])
    assert history.points(B) == [] and history.latest(B) is None
    assert history.latest(A) == _report((0.1, 1), (0.0, 0))
    with pytest.raises(ValueError):
        EngineHistory(points=1)


@pytest.fixture
def router_state(llama_dir: Path) -> Iterator[tuple[RouterState, TestClient]]:
    yield from _app(llama_dir, [])


def _app(
    llama_dir: Path, keys: list[str], admins: tuple[str, ...] = ()
) -> Iterator[tuple[RouterState, TestClient]]:
    settings = RouterSettings(
        endpoints=[EndpointSpec(url=A), EndpointSpec(url=B)],
        tokenizer=llama_dir,
        model_name="tiny",
        api_keys=keys,
        admin_api_keys=list(admins),
        scheduling=SchedulingConfig(weights=ScorerWeights(prefix=3)),
    )
    state = RouterState.build(settings, random.Random(0))
    yield state, TestClient(build_app(settings, state))  # no lifespan: nothing polls the (absent) engines


def _route(state: RouterState, request_id: str, prompt: list[int]) -> None:
    """One real pick: the router's preparer and scheduler over two engines, logged as the flow does."""
    req = state.preparer.completion(CompletionRequest(model="tiny", prompt=prompt, max_tokens=2), None)
    ctx = RequestContext(req.prompt_tokens, BS, {})
    pool = [Endpoint(A, load=EndpointLoad(running=2, kv_usage=0.25)), Endpoint(B)]
    decision = state.flow.scheduler.schedule(pool, ctx)
    assert decision is not None
    state.note_route(decision, req, ctx, request_id, 0)


def test_ui_state_shows_engines_history_and_decisions(router_state: tuple[RouterState, TestClient]) -> None:
    state, client = router_state
    state.history.observe({A: _report((0.0, 0), (0.0, 0)), B: _report((0.0, 0), (0.0, 0))})
    state.history.observe({A: _report((0.25, 1), (0.03, 3), hits=25), B: None})
    for i in range(3):
        _route(state, f"req-{i}", [7, 11, 13] * (10 + i))
    reply = client.get("/ui/state", params={"decisions": 2})
    assert reply.status_code == 200
    body = reply.json()
    router = body["router"]
    assert router["model"] == "tiny" and router["strategy"] == "prefix-aware"
    assert router["weights"] == {"prefix": 3.0, "queue": 1.0, "kv": 1.0}
    assert router["index"] == "none" and router["decisions_by_mode"] == {"aggregated": 3}
    assert "no healthy engine" in router["problems"]
    engines = {e["url"]: e for e in body["engines"]}
    assert list(engines) == [A, B] and {e["health"] for e in engines.values()} == {"down"}
    a = engines[A]
    assert a["series"]["ttft_ms"] == [None, 250.0] and a["series"]["itl_ms"] == [None, 10.0]
    assert (a["ttft_ms"], a["itl_ms"], a["prefix_hit_rate"]) == (250.0, 10.0, 0.25)
    assert engines[B]["prefix_hit_rate"] == 0.0 and engines[B]["series"]["ttft_ms"] == [None, None]
    assert (a["prediction_accuracy"], a["load_only"]) == (None, False)  # nothing measured yet
    assert [d["request_id"] for d in body["decisions"]] == ["req-2", "req-1"]
    newest = body["decisions"][0]
    assert newest["prompt_tokens"] == 36 and newest["kind"] == "completion"
    assert {c["url"] for c in newest["candidates"]} == {A, B}
    assert "7, 11, 13" not in reply.text and "[7,11" not in reply.text  # token ids never leave the router
    assert len(client.get("/ui/state").json()["decisions"]) == 3


@pytest.mark.parametrize(
    "query", ["decisions=-1", "decisions=101", "decisions=many", "decisions[x]=1", "decision=3"]
)
def test_ui_state_rejects_bad_queries_with_a_clear_400(
    router_state: tuple[RouterState, TestClient], query: str
) -> None:
    reply = router_state[1].get(f"/ui/state?{query}")
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error" and "decisions" in reply.text


def test_the_page_loads_nothing_from_outside_the_router(router_state: tuple[RouterState, TestClient]) -> None:
    client = router_state[1]
    kinds = {"/ui": "text/html", "/ui/pool.js": "text/javascript", "/ui/pool.css": "text/css"}
    for path, kind in kinds.items():
        reply = client.get(path)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
        assert "default-src 'none'" in reply.headers["content-security-policy"]
        urls = set(re.findall(r"\bhttps?://[^\s\"'`)]+", reply.text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{path} names outside URLs: {urls}"
    page = client.get("/ui").text
    assert re.findall(r'(?:src|href)="([^"]+)"', page) == ["data:,", "/ui/pool.css", "/ui/pool.js"]


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_with_api_keys_the_page_needs_one(llama_dir: Path) -> None:
    state, client = next(_app(llama_dir, ["key-one-123", "key-two-456"]))
    for path in ("/ui", "/ui/state", "/ui/pool.js"):
        denied = client.get(path)
        assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic realm=")
        assert "API keys" in denied.json()["error"]["message"]
        assert client.get(path, headers={"Authorization": "Bearer key-two-456"}).status_code == 200
        assert client.get(path, headers=_basic("ops", "key-one-123")).status_code == 200
    for bad in (
        {"Authorization": "Bearer key-one-124"},
        _basic("key-one-123", "wrong"),
        {"Authorization": "Basic !!not-base64!!"},
        {"Authorization": "Basic " + base64.b64encode(b"no-colon").decode()},
    ):
        assert client.get("/ui/state", headers=bad).status_code == 401
    assert "key-one-123" not in json.dumps(client.get("/ui/state", headers=_basic("", "key-one-123")).json())
    assert client.get("/health").status_code == 503  # the ops routes stay as they were (open)


def test_request_ids_are_shown_to_an_admin_key_only(llama_dir: Path) -> None:
    """A tenant's key opens the page but never sees the request ids (other tenants' labels) in it."""
    state, client = next(_app(llama_dir, ["tenant-one-123", "tenant-two-456"], ("admin-789",)))
    _route(state, "tenant-one-secret-id", [7, 11, 13] * 10)
    as_tenant = client.get("/ui/state", headers={"Authorization": "Bearer tenant-two-456"})
    assert as_tenant.status_code == 200 and len(as_tenant.json()["decisions"]) == 1
    assert "tenant-one-secret-id" not in as_tenant.text
    as_admin = client.get("/ui/state", headers=_basic("ops", "admin-789"))
    assert [d["request_id"] for d in as_admin.json()["decisions"]] == ["tenant-one-secret-id"]
    assert client.post("/v1/models", headers={"Authorization": "Bearer admin-789"}).status_code == 401


def test_the_page_says_which_engine_is_routed_by_load_only(
    router_state: tuple[RouterState, TestClient],
) -> None:
    """An engine whose cached-token predictions went wrong: its accuracy and why it is routed by load."""
    state, client = router_state
    pool = [Endpoint(A), Endpoint(B, load=EndpointLoad(running=5))]
    ctx = RequestContext(64, BS, {A: PrefixMatch("a", A, gpu=4, longest=4)})
    decision = state.flow.scheduler.schedule(pool, ctx)
    assert decision is not None and decision.decode.url == A
    wrong = {"usage": {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": 0}}}
    for _ in range(20):  # the default verdict needs 20 answers
        state.accuracy.observe(decision, ctx, wrong)
    engines = {e["url"]: e for e in client.get("/ui/state").json()["engines"]}
    assert (engines[A]["prediction_accuracy"], engines[A]["load_only"]) == (0.0, True)
    assert engines[B]["load_only"] is False
    assert "routed by load only" in client.get("/ui/pool.js").text
