"""Scanning helpers the formats share: markers, bracket matching, strict JSON, call objects."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from services.common.openai.tool_parsers.base import (
    CallSpec,
    RegionFailure,
    ScanMemo,
    ScanProgress,
    arguments_json,
)

_JSON_STRUCTURE = re.compile(r'["{}\[\]]')
_PY_STRUCTURE = re.compile(r"""["'{}\[\]()]""")
# A string's body up to its closing quote, escapes included (unrolled: no per-character alternation).
_STRING_BODY: Mapping[str, re.Pattern[str]] = MappingProxyType(
    {
        '"': re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL),
        "'": re.compile(r"[^'\\]*(?:\\.[^'\\]*)*", re.DOTALL),
    }
)
_OPENERS = frozenset("{[(")


def marker_start(text: str, markers: Iterable[str]) -> tuple[int, bool] | None:
    """Earliest full occurrence of a marker (True), else earliest suffix that begins one (False)."""
    markers = tuple(markers)
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found), True
    longest = max(len(m) for m in markers)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return i, False
    return None


def strip_partial_suffix(text: str, marker: str) -> str:
    """``text`` without a trailing proper prefix of ``marker`` (a marker cut off by max_tokens)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def _bracket_end(structure: re.Pattern[str], text: str, pos: int, memo: ScanMemo | None) -> int | None:
    progress = ScanProgress(pos) if memo is None else memo.progress(pos)
    if progress.end is not None:
        return progress.end
    index, depth, quote = progress.resume, progress.depth, progress.quote
    while True:
        if quote is not None:
            body = _STRING_BODY[quote].match(text, index)  # always matches (maybe empty)
            index = len(text) if body is None else body.end()
            if index >= len(text) or text[index] != quote:  # still open (maybe a dangling backslash)
                progress.resume, progress.depth, progress.quote = index, depth, quote
                return None
            index, quote = index + 1, None
            continue
        match = structure.search(text, index)
        if match is None:
            progress.resume, progress.depth, progress.quote = len(text), depth, None
            return None
        token, index = match.group(), match.end()
        if token in _STRING_BODY:
            quote = token
            continue
        depth += 1 if token in _OPENERS else -1
        if depth <= 0:
            progress.end = index
            return index


def json_value_end(text: str, pos: int, memo: ScanMemo | None = None) -> int | None:
    """Index just past the JSON object or array opening at ``text[pos]``; None while it is open."""
    return _bracket_end(_JSON_STRUCTURE, text, pos, memo)


def python_value_end(text: str, pos: int, memo: ScanMemo | None = None) -> int | None:
    """Index just past the Python bracket expression opening at ``text[pos]``; None while open."""
    return _bracket_end(_PY_STRUCTURE, text, pos, memo)


def skip_whitespace(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str) -> object:
    """``json.loads`` that also rejects NaN and Infinity; every failure is a ValueError."""
    value, end = decode_strict(text, 0)
    if text[end:].strip():
        raise ValueError(f"extra data after the JSON value at char {end}")
    return value


def decode_strict(text: str, pos: int) -> tuple[object, int]:
    """One JSON value at ``text[pos]`` (leading whitespace skipped) and the index after it."""
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    value: object
    try:
        value, end = decoder.raw_decode(text, skip_whitespace(text, pos))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return value, end


def call_from_object(
    obj: object, tools: frozenset[str] | None, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> CallSpec | RegionFailure:
    """A ``{"name": ..., "arguments": {...}}`` object as a call; missing arguments mean ``{}``."""
    if not isinstance(obj, Mapping):
        return RegionFailure("tool call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return RegionFailure("tool call has no function name")
    arguments: object = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    return checked_call(name, arguments, tools)


def checked_call(name: str, arguments: object, tools: frozenset[str] | None) -> CallSpec | RegionFailure:
    """The call, or why not: the tool must be declared and the arguments a JSON object."""
    if tools is not None and name not in tools:
        return RegionFailure(f"unknown tool {name!r}")
    if not isinstance(arguments, Mapping):
        return RegionFailure(f"arguments of {name!r} are not a JSON object")
    if not all(isinstance(key, str) for key in arguments):
        return RegionFailure(f"arguments of {name!r} have non-string keys")
    try:
        return CallSpec(name, arguments_json(arguments))
    except (TypeError, ValueError, RecursionError) as exc:
        return RegionFailure(f"arguments of {name!r} are not JSON: {exc}")


def calls_from_json(
    value: object, tools: frozenset[str] | None, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[CallSpec, ...] | RegionFailure:
    """One call object or a non-empty list of them; a single bad call fails the whole region."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return RegionFailure("empty list of tool calls")
    calls: list[CallSpec] = []
    for item in items:
        call = call_from_object(item, tools, argument_keys)
        if isinstance(call, RegionFailure):
            return call
        calls.append(call)
    return tuple(calls)
