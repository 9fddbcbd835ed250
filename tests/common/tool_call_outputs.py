"""Model outputs per tool-call format (what the models emit) and what each parser makes of them.

Shared by the parser unit tests and usable as scripted outputs in end-to-end tool-calling tests.
"""

from __future__ import annotations

from dataclasses import dataclass

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time", "create_event", "get_current_temperature")
]
PARIS = '{"city":"Paris"}'
TIME_PARIS = '{"timezone":"Europe/Paris"}'
EVENT = (
    '{"event":{"title":"Réunion \\"Q3\\" — 東京 ☕","when":{"start":"2024-10-01T09:00","minutes":30},'
    '"attendees":[{"name":"Zoë","email":"zoe@example.fr"}],"note":"line1\\nline2"}}'
)
EVENT_JSON = (
    '{"event": {"title": "R\\u00e9union \\"Q3\\" — 東京 ☕", "when": {"start": "2024-10-01T09:00", '
    '"minutes": 30}, "attendees": [{"name": "Zoë", "email": "zoe@example.fr"}], "note": "line1\\nline2"}}'
)


@dataclass(frozen=True)
class Case:
    """One model output and what parse must make of it."""

    id: str
    text: str
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()
    failures: int = 0


def hermes_block(name: str, args: str, key: str = "arguments") -> str:
    """One Qwen2.5-style ``<tool_call>`` block."""
    return f'<tool_call>\n{{"name": "{name}", "{key}": {args}}}\n</tool_call>'


HERMES_TRUNCATED = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
HERMES = [
    Case(
        "qwen-single",
        hermes_block("get_current_temperature", '{"location": "San Francisco, CA, USA", "unit": "celsius"}'),
        None,
        (("get_current_temperature", '{"location":"San Francisco, CA, USA","unit":"celsius"}'),),
    ),
    Case(
        "qwen-parallel",
        hermes_block("get_weather", '{"city": "Paris"}')
        + "\n"
        + hermes_block("get_time", '{"timezone": "Europe/Paris"}'),
        None,
        (("get_weather", PARIS), ("get_time", TIME_PARIS)),
    ),
    Case(
        "content-before",
        "I'll look up the weather for you.\n\n" + hermes_block("get_weather", '{"city": "Paris"}'),
        "I'll look up the weather for you.",
        (("get_weather", PARIS),),
    ),
    Case("content-after", hermes_block("get_time", "{}") + "\n\nDone.", "Done.", (("get_time", "{}"),)),
    Case("nested-unicode", hermes_block("create_event", EVENT_JSON), None, (("create_event", EVENT),)),
    Case(
        "smollm-list",
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]</tool_call>',
        None,
        (("get_weather", PARIS), ("get_time", TIME_PARIS)),
    ),
    Case(
        "parameters-key",
        hermes_block("get_weather", '{"city": "Paris"}', "parameters"),
        None,
        (("get_weather", PARIS),),
    ),
    Case("no-arguments", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, (("get_time", "{}"),)),
    Case(
        "close-eaten-by-stop",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        None,
        (("get_weather", PARIS),),
    ),
    Case(
        "close-cut-off",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_',
        None,
        (("get_weather", PARIS),),
    ),
    Case(
        "close-missing-then-next",
        hermes_block("get_weather", '{"city": "Paris"}').removesuffix("</tool_call>")
        + hermes_block("get_time", "{}"),
        None,
        (("get_weather", PARIS), ("get_time", "{}")),
    ),
    Case("truncated", HERMES_TRUNCATED, HERMES_TRUNCATED, failures=1),
    Case("unknown-tool", hermes_block("rm_rf", "{}"), hermes_block("rm_rf", "{}"), failures=1),
    Case(
        "arguments-string",
        hermes_block("get_weather", '"Paris"'),
        hermes_block("get_weather", '"Paris"'),
        failures=1,
    ),
    Case(
        "nan-argument",
        hermes_block("get_weather", '{"x": NaN}'),
        hermes_block("get_weather", '{"x": NaN}'),
        failures=1,
    ),
    Case(
        "bad-json",
        "<tool_call>{name: get_weather}</tool_call>",
        "<tool_call>{name: get_weather}</tool_call>",
        failures=1,
    ),
    Case(
        "valid-then-unknown",
        hermes_block("get_time", "{}") + "\n" + hermes_block("rm_rf", "{}"),
        hermes_block("rm_rf", "{}"),
        (("get_time", "{}"),),
        failures=1,
    ),
    Case(
        "markers-inside-json-string",
        hermes_block("get_weather", '{"city": "<tool_call>Paris</tool_call>"}'),
        None,
        (("get_weather", '{"city":"<tool_call>Paris</tool_call>"}'),),
    ),
    Case(
        "unclosed-then-text",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\nHope that helps.',
        "Hope that helps.",
        (("get_time", "{}"),),
    ),
    Case(
        "not-json",
        '<tool_call>get_weather(city="Paris")</tool_call> ok',
        '<tool_call>get_weather(city="Paris")</tool_call> ok',
        failures=1,
    ),
    Case(
        "deeply-nested",
        hermes_block("get_time", "[" * 5000 + "]" * 5000),
        hermes_block("get_time", "[" * 5000 + "]" * 5000),
        failures=1,
    ),
    Case("plain-angles", "Use <b>bold</b>; 3 < 4 and <tool", "Use <b>bold</b>; 3 < 4 and <tool"),
    Case("plain-text", "Paris is sunny today.\n", "Paris is sunny today.\n"),
]

LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'
LLAMA3 = [
    Case(
        "llama31-bare",
        '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}',
        None,
        (("get_weather", '{"city":"San Francisco, CA","unit":"fahrenheit"}'),),
    ),
    Case("python-tag", "<|python_tag|>" + LLAMA_WEATHER, None, (("get_weather", PARIS),)),
    Case(
        "type-function",
        '{"type": "function", "name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        None,
        (("get_time", TIME_PARIS),),
    ),
    Case("chain", f"{LLAMA_WEATHER}; {LLAMA_TIME}", None, (("get_weather", PARIS), ("get_time", TIME_PARIS))),
    Case("leading-newlines", f"\n\n{LLAMA_WEATHER}\n", None, (("get_weather", PARIS),)),
    Case(
        "content-before-tag",
        f"Let me check the weather in Paris. <|python_tag|>{LLAMA_WEATHER}",
        "Let me check the weather in Paris.",
        (("get_weather", PARIS),),
    ),
    Case(
        "nested-unicode",
        '{"name": "create_event", "arguments": ' + EVENT_JSON + "}",
        None,
        (("create_event", EVENT),),
    ),
    Case("json-answer", '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}'),
    Case("json-in-prose", f"The payload is {LLAMA_WEATHER}.", f"The payload is {LLAMA_WEATHER}."),
    Case("truncated", LLAMA_WEATHER[:-8], LLAMA_WEATHER[:-8], failures=1),
    Case(
        "truncated-second",
        f"{LLAMA_WEATHER}; {LLAMA_TIME[:20]}",
        f"{LLAMA_WEATHER}; {LLAMA_TIME[:20]}",
        failures=1,
    ),
    Case(
        "unknown-tool",
        '<|python_tag|>{"name": "rm_rf", "parameters": {}}',
        '<|python_tag|>{"name": "rm_rf", "parameters": {}}',
        failures=1,
    ),
    Case(
        "builtin-python",
        '<|python_tag|>brave_search.call(query="Paris weather")',
        '<|python_tag|>brave_search.call(query="Paris weather")',
        failures=1,
    ),
]

MISTRAL_WEATHER = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL = [
    Case("v3-single", MISTRAL_WEATHER, None, (("get_weather", PARIS),)),
    Case(
        "v3-parallel",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
        None,
        (("get_weather", PARIS), ("get_time", TIME_PARIS)),
    ),
    Case(
        "content-before",
        f"Sure, let me check.\n{MISTRAL_WEATHER}",
        "Sure, let me check.",
        (("get_weather", PARIS),),
    ),
    Case(
        "model-written-id",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
        None,
        (("get_weather", PARIS),),
    ),
    Case(
        "v3-nested",
        '[TOOL_CALLS] [{"name": "create_event", "arguments": ' + EVENT_JSON + "}]",
        None,
        (("create_event", EVENT),),
    ),
    Case("v11-named", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, (("get_weather", PARIS),)),
    Case(
        "v11-parallel",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}',
        None,
        (("get_weather", PARIS), ("get_time", TIME_PARIS)),
    ),
    Case(
        "v13-call-id",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
        None,
        (("get_weather", PARIS),),
    ),
    Case("v3-truncated", MISTRAL_WEATHER[:-10], MISTRAL_WEATHER[:-10], failures=1),
    Case(
        "v11-truncated",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        failures=1,
    ),
    Case("marker-only", "Hm. [TOOL_CALLS]", "Hm. [TOOL_CALLS]", failures=1),
    Case(
        "unknown-tool",
        '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}',
        '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}',
        failures=1,
    ),
    Case("plain-brackets", "Arrays look like [1, 2]. [TOOL", "Arrays look like [1, 2]. [TOOL"),
]

EVENT_PY = (
    '[create_event(event={"title": "Réunion \\"Q3\\" — 東京 ☕", "when": {"start": "2024-10-01T09:00", '
    '"minutes": 30}, "attendees": [{"name": "Zoë", "email": "zoe@example.fr"}], "note": "line1\\nline2"})]'
)
PYTHONIC = [
    Case(
        "llama32-single",
        '[get_weather(city="San Francisco", metric="celsius")]',
        None,
        (("get_weather", '{"city":"San Francisco","metric":"celsius"}'),),
    ),
    Case(
        "parallel",
        '[get_weather(city="Paris"), get_time(timezone="Europe/Paris")]',
        None,
        (("get_weather", PARIS), ("get_time", TIME_PARIS)),
    ),
    Case(
        "llama4-wrapped",
        '<|python_start|>[get_weather(city="Paris")]<|python_end|>',
        None,
        (("get_weather", PARIS),),
    ),
    Case(
        "content-before",
        "I'll check both for you.\n[get_weather(city='Paris'), get_time(timezone='Europe/Paris')]",
        "I'll check both for you.",
        (("get_weather", PARIS), ("get_time", TIME_PARIS)),
    ),
    Case("nested-unicode", EVENT_PY, None, (("create_event", EVENT),)),
    Case(
        "python-and-json-literals",
        "[create_event(all_day=True, reminder=None, ok=true, none=null, offset=-15, ratio=0.5, tags=('a', 'b'))]",
        None,
        (
            (
                "create_event",
                '{"all_day":true,"reminder":null,"ok":true,"none":null,"offset":-15,"ratio":0.5,"tags":["a","b"]}',
            ),
        ),
    ),
    Case(
        "escaped-quote",
        "[get_weather(city='Saint-Jean-d\\'Angély')]",
        None,
        (("get_weather", '{"city":"Saint-Jean-d\'Angély"}'),),
    ),
    Case("no-arguments", "[get_time()]\n", None, (("get_time", "{}"),)),
    Case(
        "wrapped-end-cut-off",
        '<|python_start|>[get_weather(city="Paris")]<|python_',
        None,
        (("get_weather", PARIS),),
    ),
    Case("truncated", 'Sure.\n[get_weather(city="San Fran', 'Sure.\n[get_weather(city="San Fran', failures=1),
    Case("positional", '[get_weather("Paris")]', '[get_weather("Paris")]', failures=1),
    Case("expression", "[get_weather(city=input())]", "[get_weather(city=input())]", failures=1),
    Case("unknown-tool", '[rm_rf(path="/")]', '[rm_rf(path="/")]', failures=1),
    Case("comprehension", "Use [len(x) for x in rows] to count.", "Use [len(x) for x in rows] to count."),
    Case(
        "links-and-lists",
        "See [the docs](https://x.y), [1, 2] or [a",
        "See [the docs](https://x.y), [1, 2] or [a",
    ),
]

CASES = [("hermes", c) for c in HERMES] + [("llama3_json", c) for c in LLAMA3]
CASES += [("mistral", c) for c in MISTRAL] + [("pythonic", c) for c in PYTHONIC]
IDS = [f"{name}-{case.id}" for name, case in CASES]
