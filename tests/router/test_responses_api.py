"""/v1/responses through two router replicas sharing the pool's Redis store: the official openai client's
create / stream / previous_response_id chains with a router killed between turns, tenant isolation,
encryption at rest, expiry, tools and bad input (engine in-process, routers and Redis real processes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine.entrypoints.test_tools import TEMPLATE, WEATHER
from tests.engine_harness import InProcessEngine, start_in_process
from tests.redis_server import RedisServer
from tests.router.stack import RouterProcess, start_router

KEYS = ("key-alice-0123456789", "key-bob-0123456789")
CAP = 65536
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
ENDS = ("response.completed", "response.incomplete")
TOOL = {"type": "function", **WEATHER["function"]}


@dataclass
class Pool:
    """Two router replicas over one engine and one Redis; ``restart`` brings a killed replica back."""

    routers: list[RouterProcess]
    redis: RedisServer
    start: object

    def client(self, i: int, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.routers[i].url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pool(
    llama_dir: Path, pool_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    engine: InProcessEngine = start_in_process(
        llama_dir, "--max-model-len", "1024", "--redis-url", pool_redis.url, "--max-num-seqs", "8"
    )
    tmp = tmp_path_factory.mktemp("responses")
    (tmp / "keys").write_text("\n".join(KEYS) + "\n")
    (tmp / "secret").write_text("s3cret-token-of-the-pool-0123456789\n")
    flags = (
        "--api-key-file",
        str(tmp / "keys"),
        "--responses-key-file",
        str(tmp / "secret"),
        "--responses-max-bytes",
        str(CAP),
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )

    def start(port: int | None = None) -> RouterProcess:
        return start_router(llama_dir, tmp, [engine.url], *flags, redis_url=pool_redis.url, port=port)

    p = Pool([start(), start()], pool_redis, start)
    yield p
    for r in p.routers:
        r.stop()
    engine.stop()


def _port(router: RouterProcess) -> int:
    return int(router.url.rsplit(":", 1)[1])


def test_chain_across_replicas_with_a_router_killed_between_turns(pool: Pool) -> None:
    first = pool.client(0).responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.id.startswith("resp_")
    assert first.output_text and first.usage is not None and first.usage.input_tokens > 0
    port = _port(pool.routers[0])
    pool.routers[0].stop()  # the replica that served turn 1 is gone
    with pool.client(1).responses.stream(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=8
    ) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[0].type == "response.created" and events[-1].type in ENDS  # incomplete: max_output_tokens
    second = events[-1].response
    assert "".join(deltas) == second.output_text and second.previous_response_id == first.id
    pool.routers[0] = pool.start(port)  # restarted: nothing was in its memory
    third = pool.client(0).responses.create(
        model=MODEL, input="Last one", previous_response_id=second.id, max_output_tokens=4
    )
    items = pool.client(0).responses.input_items.list(third.id, order="asc")
    texts = [c.text for i in items.data if i.type == "message" for c in i.content]
    assert texts == ["Hello there", first.output_text, "And then?", second.output_text, "Last one"]
    assert pool.client(1).responses.retrieve(third.id).output_text == third.output_text


def test_another_tenant_gets_404_never_the_body(pool: Pool) -> None:
    mine = pool.client(0).responses.create(model=MODEL, input="private words", max_output_tokens=4)
    for i in (0, 1):
        with pytest.raises(openai.NotFoundError) as err:
            pool.client(i, KEYS[1]).responses.retrieve(mine.id)
        assert "private" not in str(err.value.body) and mine.output_text not in str(err.value.body)
        with pytest.raises(openai.NotFoundError):
            pool.client(i, KEYS[1]).responses.create(model=MODEL, input="x", previous_response_id=mine.id)
    # at rest: sealed, the tenant's key and the words unreadable in Redis
    raw = b"".join(
        v for k in pool.redis.client().keys("kvferry:responses:*") if (v := pool.redis.client().get(k))
    )
    assert raw and b"private words" not in raw and KEYS[0].encode() not in raw
    pool.client(1).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        pool.client(0).responses.retrieve(mine.id)


def test_unknown_and_expired_ids_are_404_naming_them(pool: Pool) -> None:
    with pytest.raises(openai.NotFoundError, match="resp_nope.*not found"):
        pool.client(0).responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    gone = pool.client(0).responses.create(model=MODEL, input="soon gone", max_output_tokens=2)
    r = pool.redis.client()
    (key,) = [k for k in r.keys(f"kvferry:responses:*:{gone.id}")]
    r.pexpire(key, 1)  # Redis lets the TTL run out
    with pytest.raises(openai.NotFoundError, match=f"{gone.id}.*expired"):
        pool.client(1).responses.create(model=MODEL, input="x", previous_response_id=gone.id)


def test_bad_input_is_a_clear_400(pool: Pool) -> None:
    oai = pool.client(1)
    with pytest.raises(openai.BadRequestError, match="too large"):
        oai.responses.create(model=MODEL, input="word " * (CAP // 4))
    with pytest.raises(openai.BadRequestError, match="call_id 'call_x'"):
        oai.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"},
            ],
        )
    bad = httpx.post(
        f"{pool.routers[1].url}/v1/responses",
        json={"input": [{"type": "bogus"}]},
        headers={"Authorization": f"Bearer {KEYS[0]}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_required_tool_call_then_its_output(pool: Pool) -> None:
    oai = pool.client(0)
    out = oai.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=120,
    )
    (call,) = [i for i in out.output if i.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    nxt = pool.client(1).responses.create(
        model=MODEL,
        previous_response_id=out.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[TOOL],
        max_output_tokens=4,
    )
    assert nxt.status in ("completed", "incomplete")


def test_text_format_json_schema_streamed(pool: Pool) -> None:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    with pool.client(0).responses.stream(
        model=MODEL, input="ok?", text=fmt, max_output_tokens=40, temperature=1.0, store=False
    ) as stream:
        final = stream.get_final_response()  # the schema's JSON ends before the token limit: completed
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    with pytest.raises(openai.NotFoundError):  # store=False: nothing kept
        pool.client(0).responses.retrieve(final.id)


def test_store_down_is_a_clear_503(pool: Pool) -> None:
    kept = pool.client(0).responses.create(model=MODEL, input="before", max_output_tokens=2)
    pool.redis.stop()
    try:
        with pytest.raises(openai.InternalServerError, match="response store .Redis. is unavailable"):
            pool.client(1).responses.create(model=MODEL, input="x", previous_response_id=kept.id)
    finally:
        pool.redis.start()
