"""ChatPlan: how a chat request's tools and reasoning shape its generation and its message (engine and router).

- ``tool_choice`` none: tools are not shown to the template and nothing is parsed.
- auto: the model's text is parsed by ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``).
- required / named: the output is constrained by a JSON schema built from the tools' parameter
  schemas (vLLM's approach), so the arguments always parse; named: the output is the arguments object,
  required: a non-empty array of ``{"name", "parameters"}`` (one element without parallel_tool_calls).
- ``--reasoning-parser``: the text before ``</think>`` goes to ``reasoning_content``, never ``content``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.openai.errors import bad_request
from services.common.openai.protocol_chat import ChatCompletionRequest
from services.common.openai.protocol_structured import StructuredSpec
from services.common.openai.protocol_tools import NamedToolChoice
from services.common.openai.reasoning_parsers import ReasoningParser, ReasoningStream, get_reasoning_parser
from services.common.openai.tool_parsers import (
    ContentDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
)
from services.common.openai.tool_parsers.base import random_call_id


@dataclass(frozen=True)
class ToolSettings:
    """Server flags (vLLM's names): ``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser``."""

    auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    template_renders_tools: bool = True


@dataclass(frozen=True)
class FinalMessage:
    """What a finished choice's text becomes."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ChatPlan:
    mode: str  # none | auto | required | named
    template_tools: list[dict[str, Any]] | None
    constraint: StructuredSpec | None
    tools: list[dict[str, Any]]
    tool_parser: ToolParser | None
    reasoning: ReasoningParser | None
    named: str | None = None

    def finish(self, text: str) -> FinalMessage:
        """The message of a finished choice with this text."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        body = content or ""
        if self.mode in ("named", "required"):
            try:
                if self.mode == "named":
                    return FinalMessage(None, reasoning, [_call(self.named or "", body)])
                calls = [_call(c["name"], json.dumps(c["parameters"])) for c in _array(body)]
                return FinalMessage(None, reasoning, calls)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:  # cut off by max_tokens
                return FinalMessage(
                    body or None, reasoning, None, [f"{self.mode} tool call incomplete: {exc}"]
                )
        if self.mode == "auto" and self.tool_parser is not None:
            parsed = self.tool_parser.parse(body, self.tools)
            found = [c.to_openai() for c in parsed.tool_calls]
            return FinalMessage(parsed.content, reasoning, found or None, list(parsed.failures))
        return FinalMessage(content, reasoning)


def _call(name: str, arguments: str) -> dict[str, Any]:
    args = json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":")) if arguments else "{}"
    return {"id": random_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _array(text: str) -> list[dict[str, Any]]:
    value = json.loads(text) if text else []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def plan_chat(body: ChatCompletionRequest, settings: ToolSettings) -> ChatPlan:
    """The plan for one request; 400s for what the server cannot honour (never a silent answer without tools)."""
    choice = body.effective_tool_choice()
    tools = [t.model_dump(mode="json", exclude_none=True) for t in body.tools or ()]
    reasoning = get_reasoning_parser(settings.reasoning_parser)() if settings.reasoning_parser else None
    if choice == "none" or not tools:
        return ChatPlan("none", None, body.structured_spec(), tools, None, reasoning)
    if not settings.template_renders_tools:
        raise bad_request(
            "this model's chat template does not show tools to the model, so it cannot call them; "
            "start the server with --tool-chat-template hermes|llama3_json|mistral or --chat-template FILE "
            "(a template that renders `tools`)",
            "tools",
        )
    if body.structured_spec() is not None:
        raise bad_request(
            "tools with a tool_choice other than 'none' cannot be combined with an output "
            "constraint (response_format / structured_outputs)",
            "tool_choice",
        )
    if choice == "auto":
        return _auto_plan(tools, settings, reasoning)
    if isinstance(choice, NamedToolChoice):
        params = _parameters(tools, choice.function.name)
        return ChatPlan(
            "named", tools, StructuredSpec.of("json", params), tools, None, reasoning, choice.function.name
        )
    return ChatPlan(
        "required",
        tools,
        StructuredSpec.of("json", _required_schema(tools, body.parallel_tool_calls)),
        tools,
        None,
        reasoning,
    )


def _auto_plan(
    tools: list[dict[str, Any]], settings: ToolSettings, reasoning: ReasoningParser | None
) -> ChatPlan:
    if not settings.auto_tool_choice or not settings.tool_call_parser:
        raise bad_request(
            '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
            "--tool-call-parser (or ask for tool_choice 'required' / a named tool)",
            "tool_choice",
        )
    parser = get_tool_parser(settings.tool_call_parser)()
    return ChatPlan("auto", tools, None, tools, parser, reasoning)


def _parameters(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    params: dict[str, Any] = fn.get("parameters") or {"type": "object", "properties": {}}
    return params


def _required_schema(tools: Sequence[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(tools, t["function"]["name"]),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def finish_reason(reason: str | None, message: FinalMessage) -> str | None:
    """``tool_calls`` when the model stopped after calling tools (OpenAI's finish_reason)."""
    return "tool_calls" if reason == "stop" and message.tool_calls else reason


class ChatDeltas:
    """One streamed choice's text -> OpenAI delta dicts (content, reasoning_content, tool_calls)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self._reasoning: ReasoningStream | None = plan.reasoning.stream() if plan.reasoning else None
        self._tools: ToolCallStream | None = (
            plan.tool_parser.stream(plan.tools) if plan.mode == "auto" and plan.tool_parser else None
        )
        self._buffer: list[str] = []  # required / named: the JSON arrives whole at the end
        self.saw_tool_calls = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._route(self._reasoning.feed(text) if self._reasoning else [ContentDelta(text)])

    def finish(self) -> list[dict[str, Any]]:
        out = self._route(self._reasoning.finish()) if self._reasoning else []
        if self._tools is not None:
            out += self._tool_events(self._tools.finish())
        if self.plan.mode in ("named", "required"):
            message = self.plan.finish("".join(self._buffer))
            calls = [{"index": i, **c} for i, c in enumerate(message.tool_calls or [])]
            if calls:
                self.saw_tool_calls = True
                out.append({"tool_calls": calls})
        return out

    def _route(self, events: Sequence[object]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                out += self._content(ev.text)
            else:
                out.append({"reasoning_content": getattr(ev, "text", "")})
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode in ("named", "required"):
            self._buffer.append(text)
            return []
        if self._tools is None:
            return [{"content": text}] if text else []
        return self._tool_events(self._tools.feed(text))

    def _tool_events(self, events: Sequence[ContentDelta | ToolCallDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                if ev.text:
                    out.append({"content": ev.text})
            else:
                self.saw_tool_calls = True
                out.append({"tool_calls": [ev.to_openai()]})
        return out


def check_tool_settings(settings: ToolSettings) -> None:
    """A start-up check: a configured parser must exist (ValueError naming the flag and the known ones)."""
    try:
        if settings.tool_call_parser:
            get_tool_parser(settings.tool_call_parser)
        if settings.reasoning_parser:
            get_reasoning_parser(settings.reasoning_parser)
    except ValueError as exc:
        raise ValueError(f"--tool-call-parser / --reasoning-parser: {exc}") from exc
    if settings.auto_tool_choice and not settings.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def read_chat_template(path: str | Path | None) -> str | None:
    """The text of ``--chat-template FILE`` (engines and routers both apply it); ValueError naming the flag."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {path}: {exc.strerror}") from exc
