"""PDFlow against real HTTP servers playing prefill and decode engines (the documented P/D contract)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import generate_latest

from services.common.openai.errors import OpenAIError
from services.router.engine_client import EngineClient
from services.router.metrics import RouterMetrics
from services.router.pd_flow import Dispatched, PDFlow
from services.router.prompt import PreparedRequest
from services.router.scheduling import Endpoint, EndpointLoad, RequestContext, Scheduler, SchedulingConfig

BS = 16
PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_port": 1234,
    "remote_request_id": "r1",
    "remote_block_ids": [3, 4],
    "num_tokens": 32,
    "block_hashes": ["ab" * 32, "cd" * 32],
    "lease_expires": time.time() + 30,
}


class FakeEngine:
    """Answers /v1/completions like an engine: prefill JSON with kv_transfer_params, or a decode stream."""

    def __init__(self, fail_status: int | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail_status = fail_status
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.bodies.append(body)
                if engine.fail_status:
                    return self._send(
                        engine.fail_status, b'{"error": {"message": "boom", "type": "server_error"}}'
                    )
                if body.get("kv_transfer_params", {}).get("do_remote_decode"):
                    return self._send(
                        200,
                        json.dumps(
                            {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": PARAMS}
                        ).encode(),
                    )
                if body.get("stream"):
                    events = [
                        {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]},
                        {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]},
                    ]
                    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                    return self._send(200, data + b"data: [DONE]\n\n", "text/event-stream")
                return self._send(200, json.dumps({"choices": [{"index": 0, "text": "hi!"}]}).encode())

            def _send(self, status: int, data: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes() -> Any:
    made: list[FakeEngine] = []

    def make(fail_status: int | None = None) -> FakeEngine:
        made.append(FakeEngine(fail_status))
        return made[-1]

    yield make
    for f in made:
        f.stop()


def run(
    pool: list[Endpoint], tokens: int, stream: bool = False, extra: dict | None = None, num_prompts: int = 1
) -> tuple[Dispatched, RouterMetrics, list[str]]:
    """One request through PDFlow; returns what was dispatched, the metrics and the streamed data lines."""
    ids = list(range(3, 3 + tokens))
    body = {
        "prompt": ids if num_prompts == 1 else [ids] * num_prompts,
        "max_tokens": 4,
        "stream": stream,
        **(extra or {}),
    }
    req = PreparedRequest("completion", [ids] * num_prompts, [], body, stream)
    metrics = RouterMetrics()

    async def go() -> tuple[Dispatched, list[str]]:
        client = EngineClient()
        flow = PDFlow(
            Scheduler(SchedulingConfig(pd_threshold=64), random.Random(0)), lambda: pool, client, metrics
        )
        try:
            d = await flow.run(req, RequestContext(tokens, BS, {}, splittable=req.splittable), "req-1")
            events = [e.data async for e in d.stream.events()] if d.stream else []
            return d, events
        finally:
            await client.aclose()

    d, events = asyncio.run(go())
    return d, metrics, events


def sample(metrics: RouterMetrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_prompt_under_the_threshold_goes_to_decode_only(fakes: Any) -> None:
    prefill, decode = fakes(), fakes()
    d, metrics, _ = run([Endpoint(prefill.url, "prefill"), Endpoint(decode.url, "decode")], tokens=40)
    assert d.decision.prefill is None and d.body == {"choices": [{"index": 0, "text": "hi!"}]}
    assert prefill.bodies == [] and "kv_transfer_params" not in decode.bodies[0]
    assert sample(metrics, 'kvferry_router_requests_total{decision="decode_only"}') == 1


def test_long_prompt_prefills_then_decodes_with_the_returned_params(fakes: Any) -> None:
    prefill, decode = fakes(), fakes()
    d, metrics, events = run(
        [Endpoint(prefill.url, "prefill"), Endpoint(decode.url, "decode")], tokens=100, stream=True
    )
    sent = prefill.bodies[0]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert sent["kv_transfer_params"] == {"do_remote_decode": True} and len(sent["prompt"]) == 100
    assert decode.bodies[0]["kv_transfer_params"] == PARAMS and decode.bodies[0]["stream"] is True
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "hi"
    assert d.decision.prefill is not None
    assert sample(metrics, 'kvferry_router_requests_total{decision="disaggregated"}') == 1


def test_failing_prefill_falls_back_to_decode_only_and_is_counted(fakes: Any) -> None:
    prefill, decode = fakes(500), fakes()
    d, metrics, _ = run([Endpoint(prefill.url, "prefill"), Endpoint(decode.url, "decode")], tokens=100)
    assert len(prefill.bodies) == 1 and "kv_transfer_params" not in decode.bodies[0]
    assert d.body is not None
    assert sample(metrics, 'kvferry_router_fallbacks_total{kind="prefill"}') == 1


def test_decode_failing_before_the_first_token_is_retried_once_elsewhere(fakes: Any) -> None:
    bad, good = fakes(503), fakes()
    pool = [Endpoint(bad.url, "both"), Endpoint(good.url, "both", load=EndpointLoad(waiting=5))]
    d, metrics, events = run(pool, tokens=20, stream=True)
    assert d.decision.decode.url == good.url and len(bad.bodies) == 1 and events[-1] == "[DONE]"
    assert sample(metrics, "kvferry_router_retries_total") == 1


def test_all_decoders_failing_is_a_503(fakes: Any) -> None:
    pool = [Endpoint(fakes(500).url, "both"), Endpoint(fakes(502).url, "both")]
    with pytest.raises(OpenAIError) as err:
        run(pool, tokens=20)
    assert err.value.status == 503 and "HTTP 50" in err.value.info.message


def test_client_errors_are_not_retried(fakes: Any) -> None:
    bad, other = fakes(400), fakes()
    with pytest.raises(OpenAIError) as err:
        run([Endpoint(bad.url, "both"), Endpoint(other.url, "both", load=EndpointLoad(waiting=5))], tokens=20)
    assert err.value.status == 400 and other.bodies == []


@pytest.mark.parametrize(
    ("extra", "num_prompts"),
    [
        ({"prompt_logprobs": 1}, 1),
        ({"echo": True, "logprobs": 0}, 1),
        ({}, 2),
    ],
)
def test_requests_decode_must_compute_whole_are_never_split(
    fakes: Any, extra: dict, num_prompts: int
) -> None:
    """Prompt logprobs are computed where the prompt runs, and one request has one KV hand-off."""
    prefill, decode = fakes(), fakes()
    d, metrics, _ = run(
        [Endpoint(prefill.url, "prefill"), Endpoint(decode.url, "decode")],
        tokens=100,
        extra=extra,
        num_prompts=num_prompts,
    )
    assert d.decision.prefill is None and prefill.bodies == []
    assert "kv_transfer_params" not in decode.bodies[0]
    assert all(decode.bodies[0][k] == v for k, v in extra.items())
    assert sample(metrics, 'kvferry_router_requests_total{decision="decode_only"}') == 1
