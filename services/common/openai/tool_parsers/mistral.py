"""Mistral tool calls: ``[TOOL_CALLS] [{"name", "arguments"}, ...]`` and ``[TOOL_CALLS]name[ARGS]{...}``."""

from __future__ import annotations

import re

from services.common.openai.tool_parsers._scan import (
    calls_from_json,
    checked_call,
    json_value_end,
    loads_strict,
    marker_start,
    skip_whitespace,
)
from services.common.openai.tool_parsers.base import (
    RegionFailure,
    RegionResult,
    ScanMemo,
    random_call_id,
)
from services.common.openai.tool_parsers.parser import ToolParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAMED_CALL = re.compile(r"\s*([A-Za-z_][\w.\-]*)(?:\[CALL_ID\]\w*)?\[ARGS\](.*)\Z", re.DOTALL)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list of calls (tokenizer v3..v7, e.g. Mistral-7B-v0.3,
    Mistral-Nemo) or by ``name[ARGS]{json}`` once per call (v11+, e.g. Mistral-Small-3.2).

    ``[TOOL_CALLS]`` is a special token: keep special tokens in the detokenized text. Ids are 9
    alphanumerics, the only form Mistral's chat templates accept back in ``tool_call_id``; an
    ``id`` the model writes itself is ignored.
    """

    name = "mistral"
    markers = (TOOL_CALLS, ARGS, "[CALL_ID]")

    def default_call_id(self) -> str:
        """Nine alphanumerics (Mistral's templates reject any other tool-call id)."""
        return random_call_id(prefix="", length=9)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, bool] | None:
        """A region starts at ``[TOOL_CALLS]``."""
        return marker_start(text, (TOOL_CALLS,))

    def find_end(self, region: str, memo: ScanMemo) -> int | None:
        """After the JSON list/object, or after the ``{...}`` that follows ``[ARGS]``."""
        pos = skip_whitespace(region, len(TOOL_CALLS))
        if pos >= len(region):
            return None
        if region[pos] in "[{":
            return json_value_end(region, pos, memo)
        args = memo.find(region, ARGS, pos)
        if args < 0:
            return None
        pos = skip_whitespace(region, args + len(ARGS))
        if pos >= len(region) or region[pos] != "{":
            return None
        return json_value_end(region, pos, memo)

    def parse_region(self, region: str, tools: frozenset[str] | None, complete: bool) -> RegionResult:
        """The list (or single object) of calls, or one named call with its arguments object."""
        body = region[len(TOOL_CALLS) :]
        stripped = body.strip()
        named = None if stripped[:1] in ("[", "{") else _NAMED_CALL.match(body)
        what = "truncated" if not complete else "invalid"
        try:
            if named is None:
                return calls_from_json(loads_strict(stripped), tools, ("arguments", "parameters"))
            arguments = loads_strict(named.group(2))
        except ValueError as exc:
            return RegionFailure(f"{what} tool call JSON ({exc})")
        call = checked_call(named.group(1), arguments, tools)
        return call if isinstance(call, RegionFailure) else (call,)
