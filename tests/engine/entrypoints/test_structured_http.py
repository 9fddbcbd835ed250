"""Structured outputs over HTTP with the official openai client: every request form, and bad input as 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL, ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
MSG = [{"role": "user", "content": "Pick a color."}]


def test_response_format_json_schema_in_chat_and_completions(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(
        model=MODEL, messages=MSG, response_format=fmt, max_tokens=60, temperature=1.0, n=4, seed=3
    )
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    cmpl = client.completions.create(
        model=MODEL, prompt="x", max_tokens=60, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(cmpl.choices[0].text), SCHEMA)


def test_json_object_regex_choice_grammar_and_guided_fields(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=300, temperature=0, response_format={"type": "json_object"}
    )
    assert chat.choices[0].finish_reason == "length" or isinstance(
        json.loads(chat.choices[0].message.content), dict
    )
    forms = [
        ({"structured_outputs": {"regex": "[ab]{3}-[0-9]"}}, lambda t: re.fullmatch("[ab]{3}-[0-9]", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] "y"'}}, lambda t: re.fullmatch(r"x\dy", t)),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    for extra, valid in forms:
        out = client.completions.create(
            model=MODEL, prompt="go", max_tokens=40, temperature=1.0, extra_body=extra
        )
        assert valid(out.choices[0].text), (extra, out.choices[0].text)


def test_streamed_constrained_output_is_valid(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=60,
        stream=True,
        temperature=1.0,
        extra_body={"guided_json": SCHEMA},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


BAD = [
    ("two constraints", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("bad regex", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("bad grammar", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    (
        "schema not an object",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format",
    ),
    ("json_schema missing", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("unknown format type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("guided_json not JSON", {"guided_json": "{not json"}, "guided_json"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("structured_outputs empty", {"structured_outputs": {}}, "structured_outputs"),
]


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_constraints_are_400_naming_the_field(server: ServerProcess, body: dict, param: str) -> None:
    with server.http() as http:
        for path, base in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MSG})):
            r = http.post(path, json={**base, "max_tokens": 3, **body})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
