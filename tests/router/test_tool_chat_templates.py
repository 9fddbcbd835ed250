"""``--tool-chat-template hermes`` alone (no template file, parser or auto flag) on the engine and on the
router: a model whose own template drops tools answers tool requests, a ``required`` call comes back parsed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine.entrypoints.test_tools import ASK, WEATHER
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import start_router


@pytest.fixture(scope="module")
def urls(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    engine: InProcessEngine = start_in_process(
        llama_dir, "--max-model-len", "1024", "--tool-chat-template", "hermes"
    )
    logs = tmp_path_factory.mktemp("tpl")
    router = start_router(llama_dir, logs, [engine.url], "--tool-chat-template", "hermes")
    plain = start_router(llama_dir, logs, [engine.url])  # the model's own template: no tools shown
    yield {"engine": engine.url, "router": router.url, "plain": plain.url}
    router.stop()
    plain.stop()
    engine.stop()


@pytest.mark.parametrize("where", ["engine", "router"])
def test_required_call_parsed_and_auto_accepted(urls: dict[str, str], where: str) -> None:
    oai = openai.OpenAI(base_url=f"{urls[where]}/v1", api_key="unused", max_retries=0, timeout=60)
    out = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_tokens=120,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    auto = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_without_a_tool_template_the_clear_400_stays(urls: dict[str, str]) -> None:
    oai = openai.OpenAI(base_url=f"{urls['plain']}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="--tool-chat-template hermes"):
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4)
