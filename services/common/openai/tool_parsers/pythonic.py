"""Pythonic tool calls (Llama 3.2, Llama 4, ToolACE): ``[get_weather(city="Paris"), f(x=1)]``."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from types import MappingProxyType

from services.common.openai.tool_parsers._scan import (
    checked_call,
    marker_start,
    python_value_end,
    strip_partial_suffix,
)
from services.common.openai.tool_parsers.base import (
    CallSpec,
    NotACall,
    RegionFailure,
    RegionResult,
    ScanMemo,
)
from services.common.openai.tool_parsers.parser import ToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_CALL_OPEN = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_CALL_OPEN_PARTIAL = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")
_JSON_NAMES: Mapping[str, object] = MappingProxyType({"true": True, "false": False, "null": None})


class PythonicToolParser(ToolParser):
    """A Python list of calls with keyword arguments, parsed with ``ast`` (literals only, no eval).

    A region starts wherever ``[name(`` appears (or at Llama 4's ``<|python_start|>``, which then
    must close with ``<|python_end|>``). Argument values are Python literals (``True``/``None``
    and JSON's ``true``/``null`` both work); positional arguments, ``**kwargs`` and expressions fail
    the call. A bracket expression that is not a list of calls (``[f(x) for x in y]``) is content.
    """

    name = "pythonic"
    markers = (PYTHON_START, PYTHON_END)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, bool] | None:
        """At ``<|python_start|>`` or at a ``[`` followed by a name and ``(``."""
        marker = marker_start(text, (PYTHON_START,))
        pos = text.find("[")
        while pos >= 0 and (marker is None or pos < marker[0]):
            if _CALL_OPEN.match(text, pos):
                return pos, True
            if _CALL_OPEN_PARTIAL.match(text, pos):
                return pos, False
            pos = text.find("[", pos + 1)
        return marker

    def find_end(self, region: str, memo: ScanMemo) -> int | None:
        """After the matching ``]`` (or after ``<|python_end|>`` for the wrapped form)."""
        if region.startswith(PYTHON_START):
            end = memo.find(region, PYTHON_END, len(PYTHON_START))
            return None if end < 0 else end + len(PYTHON_END)
        return python_value_end(region, 0, memo)

    def parse_region(self, region: str, tools: frozenset[str] | None, complete: bool) -> RegionResult:
        """Every element of the list as a call; any bad element fails the region."""
        wrapped = region.startswith(PYTHON_START)
        source = region
        if wrapped:
            source = source[len(PYTHON_START) :].rstrip()
            source = source.removesuffix(PYTHON_END) if complete else strip_partial_suffix(source, PYTHON_END)
        try:
            body = ast.parse(source.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            what = "truncated" if not complete else "invalid"
            return RegionFailure(f"{what} Python call syntax ({type(exc).__name__})")
        if isinstance(body, ast.List) and body.elts:
            nodes = body.elts
        elif isinstance(body, ast.Call) and wrapped:
            nodes = [body]
        else:
            return RegionFailure("not a list of calls") if wrapped else NotACall()
        calls: list[CallSpec] = []
        for node in nodes:
            if not isinstance(node, ast.Call):
                return RegionFailure("list element is not a call") if wrapped else NotACall()
            call = _call(node, tools)
            if isinstance(call, RegionFailure):
                return call
            calls.append(call)
        return tuple(calls)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def _call(node: ast.Call, tools: frozenset[str] | None) -> CallSpec | RegionFailure:
    name = _dotted_name(node.func)
    if name is None:
        return RegionFailure("called object is not a function name")
    if tools is not None and name not in tools:
        return RegionFailure(f"unknown tool {name!r}")
    if node.args:
        return RegionFailure(f"positional arguments in the call of {name!r}")
    arguments: dict[str, object] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return RegionFailure(f"**kwargs in the call of {name!r}")
        try:
            arguments[keyword.arg] = _literal(keyword.value)
        except (ValueError, RecursionError) as exc:
            return RegionFailure(f"argument {keyword.arg!r} of {name!r} is not a literal ({exc})")
    return checked_call(name, arguments, tools)


def _literal(node: ast.expr) -> object:
    """A JSON-representable Python literal; anything else raises ValueError."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise ValueError(f"{value!r} has no JSON form")
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, object] = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise ValueError("dict keys must be strings")
            out[key.value] = _literal(item)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _literal(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"{type(node).__name__} is not a literal")
