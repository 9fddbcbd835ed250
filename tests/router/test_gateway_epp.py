"""The endpoint picker (``kvferry router --epp-port``) behind a real Envoy, over two real engines and Redis.

First the GIE protocol spoken directly over gRPC (body modes, subset hints, refusals, health), then the
official ``openai`` client through Envoy (examples/gateway/envoy.yaml): same-prefix requests land on the
warm engine (the engines' own metrics say so); last, the picker is stopped and each listener follows its
``failure_mode_allow``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.epp.addresses import endpoint_address
from services.router.epp.gie_protocol import DESTINATION_HEADER, SUBSET_KEY, SUBSET_NAMESPACE
from tests.engine.entrypoints.helpers import MODEL, ServerProcess, free_port
from tests.redis_server import RedisServer
from tests.router.envoy_proxy import EnvoyProcess, start_envoy
from tests.router.stack import BLOCK, RouterProcess, start_engines, start_router
from tests.router.test_router_app import wait_indexed

PREFIX_TOKENS = 4 * BLOCK
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


@pytest.fixture(scope="module")
def gw_engines(llama_dir: Path, log_dir: Path, pool_redis: RedisServer) -> Iterator[list[ServerProcess]]:
    servers = start_engines(llama_dir, log_dir, 2, pool_redis.url)
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def epp(
    llama_dir: Path, log_dir: Path, gw_engines: list[ServerProcess], pool_redis: RedisServer
) -> Iterator[tuple[RouterProcess, int]]:
    port = free_port()
    urls = [e.url for e in gw_engines]
    router = start_router(llama_dir, log_dir, urls, "--epp-port", str(port), redis_url=pool_redis.url)
    yield router, port
    router.stop()


@pytest.fixture(scope="module")
def envoy(
    epp: tuple[RouterProcess, int], gw_engines: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnvoyProcess]:
    proxy = start_envoy(epp[1], [e.url for e in gw_engines], tmp_path_factory.mktemp("envoy"))
    yield proxy
    proxy.stop()


def addresses(engines: list[ServerProcess]) -> list[str]:
    return [endpoint_address(e.url) or "" for e in engines]


def request_headers(
    path: str = "/v1/completions",
    method: str = "POST",
    end_of_stream: bool = False,
    mode: int = FULL_DUPLEX,
    subset: list[str] | None = None,
) -> ep.ProcessingRequest:
    pairs = [(":path", path), (":method", method), ("content-type", "application/json")]
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=headers, end_of_stream=end_of_stream)
    )
    message.protocol_config.request_body_mode = mode
    message.protocol_config.response_body_mode = FULL_DUPLEX
    if subset is not None:
        message.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_KEY: subset})
    return message


def body_chunks(body: bytes, parts: int) -> list[ep.ProcessingRequest]:
    size = -(-len(body) // parts)
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return [
        ep.ProcessingRequest(request_body=ep.HttpBody(body=p, end_of_stream=i == len(pieces) - 1))
        for i, p in enumerate(pieces)
    ]


def process(port: int, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return list(ExternalProcessorStub(channel).Process(iter(messages), timeout=30))


def picked(response: ep.ProcessingResponse, kind: str = "request_headers") -> str:
    """The destination header the response sets; asserts the envoy.lb metadata holds the same value."""
    common = getattr(response, kind).response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER]
    assert header[DESTINATION_HEADER] == metadata.string_value
    assert common.clear_route_cache
    return header[DESTINATION_HEADER]


def completion_body(prompt: object, **extra: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}).encode()


def immediate(responses: list[ep.ProcessingResponse]) -> tuple[int, dict]:
    assert len(responses) == 1 and responses[0].HasField("immediate_response"), responses
    answer = responses[0].immediate_response
    return answer.status.code, json.loads(answer.body)


def test_full_duplex_body_in_chunks_is_picked_then_handed_back_unchanged(epp, gw_engines) -> None:
    body = completion_body("the ferry carries blocks across the river " * 20)
    responses = process(epp[1], [request_headers(), *body_chunks(body, 3)])
    assert responses[0].HasField("request_headers")
    assert picked(responses[0]) in addresses(gw_engines)
    streamed = [r.request_body.response.body_mutation.streamed_response for r in responses[1:]]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]


def test_buffered_body_passes_the_headers_then_picks_on_the_body(epp, gw_engines) -> None:
    mode = ProcessingMode.BUFFERED
    body = completion_body([7] * 40)
    responses = process(epp[1], [request_headers(mode=mode), *body_chunks(body, 1)])
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    assert not responses[0].request_headers.response.header_mutation.set_headers  # headers just continue
    assert picked(responses[1], "request_body") in addresses(gw_engines)
    assert not responses[1].request_body.response.HasField("body_mutation")  # the body goes on as it was


def test_a_request_without_body_is_picked_by_load(epp, gw_engines) -> None:
    responses = process(epp[1], [request_headers("/v1/models", "GET", end_of_stream=True)])
    assert picked(responses[0]) in addresses(gw_engines)


def test_the_subset_hint_limits_the_pick_and_an_unfit_subset_is_a_503(epp, gw_engines) -> None:
    only = addresses(gw_engines)[1]
    rng = random.Random(3)
    for _ in range(4):
        body = completion_body([rng.randrange(3, 400) for _ in range(40)])
        assert picked(process(epp[1], [request_headers(subset=[only]), *body_chunks(body, 2)])[0]) == only
    for subset in (["10.255.0.1:8000"], []):
        status, error = immediate(
            process(epp[1], [request_headers(subset=subset), *body_chunks(completion_body("x"), 1)])
        )
        assert status == 503
        assert error["error"]["code"] == "service_unavailable"


@pytest.mark.parametrize(
    ("body", "mode", "status", "says"),
    [
        (b'{"prompt": [1, 2', FULL_DUPLEX, 400, "could not parse the JSON"),
        (completion_body([1, 2, 3], max_tokens=-1), FULL_DUPLEX, 400, "max_tokens"),
        (json.dumps({"model": "no-such-model", "prompt": "x"}).encode(), FULL_DUPLEX, 404, "no-such-model"),
        (completion_body("x"), ProcessingMode.STREAMED, 500, "request_body_mode is STREAMED"),
        (completion_body("x"), ProcessingMode.NONE, 500, "request_body_mode is NONE"),
        (completion_body("x"), ProcessingMode.GRPC, 500, "request_body_mode is GRPC"),
        (completion_body([5] * 1100), FULL_DUPLEX, 400, "maximum context length is 1024"),
    ],
)
def test_refusals_are_immediate_openai_errors(epp, body: bytes, mode: int, status: int, says: str) -> None:
    got, error = immediate(process(epp[1], [request_headers(mode=mode), *body_chunks(body, 2)]))
    assert got == status
    assert says in error["error"]["message"]


def test_response_path_passes_through(epp) -> None:
    body = completion_body([9] * 20)
    answer = b'data: {"choices": []}\n\n' * 5000  # > one 64 KiB chunk
    messages = [request_headers(), *body_chunks(body, 1)]
    messages += [
        ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap())),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=answer, end_of_stream=True)),
    ]
    responses = process(epp[1], messages)
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[:3] == ["request_headers", "request_body", "response_headers"]
    echoed = [r.response_body.response.body_mutation.streamed_response for r in responses[3:]]
    assert b"".join(s.body for s in echoed) == answer and echoed[-1].end_of_stream


def test_health_services_of_the_protocol(epp) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{epp[1]}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_fallbacks_follow_the_primary_and_api_keys_are_checked(
    llama_dir, log_dir, gw_engines, pool_redis
) -> None:
    port = free_port()
    urls = [e.url for e in gw_engines]
    (log_dir / "engine-key").write_text("pool-internal-key-0123456789\n")
    flags = ("--epp-port", str(port), "--epp-fallbacks", "1", "--api-key", "sk-gw")
    flags += ("--engine-api-key-file", str(log_dir / "engine-key"))
    router = start_router(llama_dir, log_dir, urls, *flags, redis_url=pool_redis.url)
    body = body_chunks(completion_body([4] * 30), 1)
    keyed = request_headers()
    keyed.request_headers.headers.headers.add(key="authorization", raw_value=b"Bearer sk-gw")
    try:
        answer = process(port, [keyed, *body])[0]
        value = picked(answer)
        sets = {
            h.header.key: h.header.raw_value
            for h in answer.request_headers.response.header_mutation.set_headers
        }
        assert (
            sets["authorization"] == b"Bearer pool-internal-key-0123456789"
        )  # the engines' key, not the client's
        status, error = immediate(process(port, [request_headers(), *body]))
        jump = body_chunks(completion_body([4] * 30, priority=-(10**9)), 1)
        jumped, refusal = immediate(process(port, [keyed, *jump]))  # no --priority-api-key-file: no one may
    finally:
        router.stop()
    assert sorted(value.split(",")) == sorted(addresses(gw_engines))
    assert status == 401 and error["error"]["type"] == "invalid_request_error"
    assert jumped == 403 and refusal["error"]["param"] == "priority"


def engine_counts(engines: list[ServerProcess]) -> list[tuple[float, float]]:
    """(prompt tokens computed or cached, prefix-cache hit tokens) of each engine."""
    out = []
    for engine in engines:
        m = engine.metrics()
        out.append((m.get("kvferry_prompt_tokens_total", 0.0), m.get("kvferry_prefix_cache_hits_total", 0.0)))
    return out


def test_same_prefix_lands_on_the_warm_engine_through_envoy(envoy, epp, gw_engines, pool_redis) -> None:
    """Through both listeners: FULL_DUPLEX_STREAMED (fail_closed) and BUFFERED (fail_open) bodies."""
    clients = [
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for url in (envoy.fail_closed_url, envoy.fail_open_url)
    ]
    client = clients[0]
    rng = random.Random(11)
    prefix = [rng.randrange(3, 400) for _ in range(PREFIX_TOKENS)]
    before = engine_counts(gw_engines)
    client.completions.create(model=MODEL, prompt=prefix + [5], max_tokens=2, temperature=0)
    first = engine_counts(gw_engines)
    warm = next(i for i in range(2) if first[i][0] > before[i][0])  # the engine that computed it
    wait_indexed(pool_redis.url, prefix)
    for i in range(4):
        suffix = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 12))]
        clients[i % 2].completions.create(model=MODEL, prompt=prefix + suffix, max_tokens=2, temperature=0)
    after = engine_counts(gw_engines)
    cold = 1 - warm
    assert after[cold][0] == first[cold][0]  # the other engine saw no prompt token
    assert after[warm][1] - first[warm][1] >= 4 * PREFIX_TOKENS  # every follow-up reused the prefix
    assert epp[0].metrics()['kvferry_router_epp_requests_total{code="200"}'] >= 5


def test_streamed_chat_through_envoy_matches_the_engine(envoy, gw_engines) -> None:
    messages = [{"role": "user", "content": "Which engine holds my prompt?"}]
    client = openai.OpenAI(base_url=f"{envoy.fail_closed_url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    direct = openai.OpenAI(base_url=f"{gw_engines[0].url}/v1", api_key="unused", max_retries=0)
    reference = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert text == reference.choices[0].message.content


def test_the_pickers_refusals_reach_the_client_through_envoy(envoy) -> None:
    client = openai.OpenAI(base_url=f"{envoy.fail_closed_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "no-such-model" in str(err.value)


def test_a_picker_that_is_down_follows_the_failure_mode(envoy, epp) -> None:
    """Last in the module: it stops the picker."""
    epp[0].stop()
    open_client = openai.OpenAI(base_url=f"{envoy.fail_open_url}/v1", api_key="unused", max_retries=0)
    answer = open_client.completions.create(model=MODEL, prompt=[3] * 20, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2  # served: the pool's default route (no destination header)
    closed_client = openai.OpenAI(base_url=f"{envoy.fail_closed_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        closed_client.completions.create(model=MODEL, prompt=[3] * 20, max_tokens=2, temperature=0)
    assert err.value.status_code == 500  # Envoy's answer when ext_proc fails closed


def test_the_picker_admits_through_the_routers_tenants_and_quotas(
    llama_dir, log_dir, gw_engines, pool_redis
) -> None:
    """The same admission as the HTTP path: a tenant's quota (shared in Redis) refuses its second request with
    an immediate 429 carrying Retry-After and x-ratelimit-*; the slot of a picked request is given back when
    the gateway's stream ends."""
    port = free_port()
    tenants = log_dir / "epp-tenants.json"
    tenants.write_text(
        json.dumps({"tenants": [{"name": "gw", "apiKey": "sk-gw-tenant", "quota": {"requestsPerMinute": 1}}]})
    )
    flags = ("--epp-port", str(port), "--tenants-file", str(tenants), "--max-inflight-per-engine", "4")
    router = start_router(llama_dir, log_dir, [e.url for e in gw_engines], *flags, redis_url=pool_redis.url)
    keyed = request_headers()
    keyed.request_headers.headers.headers.add(key="authorization", raw_value=b"Bearer sk-gw-tenant")
    body = body_chunks(completion_body([4] * 30), 1)
    try:
        first = process(port, [keyed, *body])
        assert picked(first[0]) in addresses(gw_engines)
        second = process(port, [keyed, *body])
        metrics = router.metrics()
    finally:
        router.stop()
    status, error = immediate(second)
    sets = {
        h.header.key: h.header.raw_value.decode() for h in second[0].immediate_response.headers.set_headers
    }
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded", error
    assert int(sets["retry-after"]) >= 1 and sets["x-ratelimit-remaining-requests"] == "0"
    assert metrics["kvferry_router_inflight"] == 0  # the first stream ended: its slot is back
    assert metrics['kvferry_router_admission_total{outcome="admitted",reason="immediate"}'] == 1
