"""/v1/messages (Anthropic Messages API) through the router, with the official ``anthropic`` client: text,
streaming events, tool_use / tool_result round trips, stop reasons, usage and bad input (engine
in-process, the router a real process)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import pytest
from PIL import Image

from tests.engine.entrypoints.helpers import MODEL
from tests.engine.entrypoints.test_tools import TEMPLATE, WEATHER
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import RouterProcess, start_router

KEY = "anthropic-test-key-0123456789"
TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def router(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engine: InProcessEngine = start_in_process(llama_dir, "--max-model-len", "1024")
    r = start_router(
        llama_dir,
        tmp_path_factory.mktemp("messages"),
        [engine.url],
        "--api-key",
        KEY,
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield r
    r.stop()
    engine.stop()


def _client(router: RouterProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, auth_token=KEY, api_key=None, max_retries=0, timeout=60)


def test_text_and_usage(router: RouterProcess) -> None:
    msg = _client(router).messages.create(
        model=MODEL,
        max_tokens=6,
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        extra_body={"temperature": 0},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 6


def test_streaming_events(router: RouterProcess) -> None:
    with _client(router).messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Tell me more"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens > 0


def test_tool_use_then_tool_result(router: RouterProcess) -> None:
    client = _client(router)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for stream in (False, True):
        kwargs = {
            "model": MODEL,
            "max_tokens": 120,
            "messages": ask,
            "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "extra_body": {"temperature": 1.0},
        }
        if stream:
            with client.messages.stream(**kwargs) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kwargs)
        assert msg.stop_reason == "tool_use"
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["function"]["parameters"])
    answer = client.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=[TOOL],
        messages=[
            *ask,
            {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
    )
    assert answer.content and answer.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_bad_input_is_a_clear_400(router: RouterProcess) -> None:
    client = _client(router)
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id 'toolu_x'"):
        client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
        )
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.post(
            "/v1/messages",
            body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            cast_to=object,
        )
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    image = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png.getvalue()).decode()}
    with pytest.raises(anthropic.BadRequestError, match="image"):  # a text-only model takes no images
        client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": image}, {"type": "text", "text": "?"}],
                }
            ],
        )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=router.url, auth_token="wrong-key", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
