"""The shipped tool chat templates: they show the model its tools, and the tool calls they render read
back through the same-named parser (what the model is shown is what it will be parsed as)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.common.openai.tokenizer import Tokenizer
from services.common.openai.tool_parsers import get_tool_parser
from services.common.openai.tool_templates import NAMES, apply_tool_template, template_path

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call0abc12",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CHAT = [
    {"role": "system", "content": "SYSTEM-TEXT"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call0abc12", "content": "TOOL-RESULT-sunny"},
    {"role": "user", "content": "And tomorrow?"},
]
# Where each format's assistant turn begins and ends in the rendered text.
TURN = {
    "hermes": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3_json": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "mistral": ("[/INST]", "</s>"),
}


@pytest.mark.parametrize("name", NAMES)
def test_template_renders_tools_and_calls_that_parse_back(name: str, llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    tok.set_chat_template(template_path(name).read_text())
    assert tok.renders_tools()
    text = tok.apply_chat_template(CHAT, True, tools=[TOOL])
    assert "Weather in a city" in text and "SYSTEM-TEXT" in text and "TOOL-RESULT-sunny" in text
    assert text.index("Weather in Paris?") < text.index("TOOL-RESULT-sunny") < text.index("And tomorrow?")
    start, end = TURN[name]
    turn = text.split(start)[1].split(end)[0]
    parsed = get_tool_parser(name)().parse(turn, [TOOL])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert not parsed.failures


def test_flag_stands_for_template_parser_and_auto_choice() -> None:
    args = argparse.Namespace(
        tool_chat_template="llama3_json",
        chat_template=None,
        tool_call_parser=None,
        enable_auto_tool_choice=False,
    )
    apply_tool_template(args)
    assert Path(args.chat_template) == template_path("llama3_json") and args.tool_call_parser == "llama3_json"
    assert args.enable_auto_tool_choice
    both = argparse.Namespace(tool_chat_template="hermes", chat_template="x.jinja")
    with pytest.raises(ValueError, match="not both"):
        apply_tool_template(both)
    with pytest.raises(ValueError, match="--tool-chat-template: unknown template 'chatml'"):
        template_path("chatml")
