"""Pick named samples out of Prometheus text exposition without building every metric family.

Routers and the operator scrape engines' /metrics on their event loops; prometheus_client's full
parser took ~3 ms per engine page here, blocking every request the router was routing meanwhile.
This scanner looks at each line's metric name first and parses only the lines asked for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class Sample(NamedTuple):
    """One sample line: metric name (with its _total/_bucket suffix), labels and value."""

    name: str
    labels: dict[str, str]
    value: float


def _labels(text: str) -> dict[str, str]:
    """The labels inside ``{...}``; ValueError when they are not ``name="value"`` pairs."""
    labels, pos = {}, 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise ValueError(f"malformed labels: {{{text}}}")
        labels[match.group(1)] = re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], match.group(2))
        pos = match.end()
    return labels


def _sample(line: str, name: str, brace: int) -> Sample:
    """Parse the rest of a sample line whose name ends at ``brace`` (a '{') or at the first space."""
    if line.startswith("{", brace):
        close = line.rfind("}")
        if close < brace:
            raise ValueError(f"unclosed labels: {line!r}")
        labels, rest = _labels(line[brace + 1 : close]), line[close + 1 :]
    else:
        labels, rest = {}, line[brace:]
    fields = rest.split()
    if not fields:
        raise ValueError(f"sample without a value: {line!r}")
    return Sample(name, labels, float(fields[0]))


def scan_samples(text: str, wanted: Callable[[str], bool]) -> Iterator[Sample]:
    """The samples whose metric name ``wanted`` accepts, in page order; ValueError on a malformed one."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            at = line.find(stop)
            if 0 <= at < end:
                end = at
        name = line[:end]
        if wanted(name):
            yield _sample(line, name, end)
