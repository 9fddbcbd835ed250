"""OpenAI / vLLM fields that used to vanish with a 200: each is now honoured or a 400 naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.openai.chat_prompt import chat_prompt_ids
from services.common.openai.errors import OpenAIError, parse_body
from services.common.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.common.openai.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}}

REFUSED: list[tuple[type, dict[str, Any], str]] = [
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
    (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    (CompletionRequest, {"prompt": "x", "suffix": "tail"}, "suffix"),
    (
        CompletionRequest,
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    (ChatCompletionRequest, {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0].image_url.detail"),
    (ChatCompletionRequest, {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "body", "param"), REFUSED)
def test_an_unserved_field_is_a_400_naming_it(model: type, body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        parse_body(model, body)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param, err.value.body()


def test_the_served_forms_pass() -> None:
    assert parse_body(CompletionRequest, {"prompt": "x", "n": 2, "best_of": 2}).best_of == 2
    assert parse_body(CompletionRequest, {"prompt": "x", "suffix": ""}).suffix == ""
    named = {"type": "function", "function": {"name": "f"}}
    body = {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False, "tool_choice": named}
    assert not parse_body(ChatCompletionRequest, body).parallel_tool_calls
    auto = {**IMAGE, "image_url": {**IMAGE["image_url"], "detail": "auto"}}
    parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [auto]}]})


def test_chat_template_kwargs_reach_the_template(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    tok.set_chat_template(
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
        "{{ messages[0]['content'] }}"
    )
    plain = parse_body(ChatCompletionRequest, {"messages": MESSAGES})
    off = parse_body(
        ChatCompletionRequest, {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert tok.decode(chat_prompt_ids(tok, plain)) == "hi"
    assert tok.decode(chat_prompt_ids(tok, off)) == "/no_think hi"
