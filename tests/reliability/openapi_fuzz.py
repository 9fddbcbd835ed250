"""OpenAPIFuzz: schemathesis cases for every operation of a live server's /openapi.json, checked as they come.

Each operation gets ``examples`` schema-valid (positive) cases and as many schema-invalid (negative) ones,
sent over real HTTP. A case fails on a 5xx, an undocumented status or content type, a body that breaks
its documented schema, or (negative cases) invalid data accepted with a 2xx.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class FuzzReport:
    """Cases sent per operation and mode, status codes seen, and the distinct failures (empty: all passed)."""

    cases: collections.Counter[str] = field(default_factory=collections.Counter)
    statuses: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)


def fuzz(base_url: str, examples: int) -> FuzzReport:
    """Run every operation of ``base_url``'s schema in both generation modes."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for result in schema.get_all_operations():
            operation = result.ok()
            _run(operation, mode, base_url, examples, report)
    return report


def _sent_as_valid(response) -> bool:  # noqa: ANN001 - a requests.Response
    """Whether a case went out with no query string and no body: schemathesis serializes some negative
    cases to nothing (an empty object in form-explode style, e.g. ``decisions={}`` on /ui/state), which on
    the wire is a valid request without parameters, so no server can reject it (negative_data_rejection
    does not apply; every other check still does)."""
    sent = response.request
    return not urlsplit(sent.url).query and not sent.body


def _run(operation, mode: GenerationMode, base_url: str, examples: int, report: FuzzReport) -> None:  # noqa: ANN001
    name = f"{mode.value} {operation.method.upper()} {operation.path}"
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    seen: set[str] = set()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # no shrinking: every case is a real request, report it
    )
    def one(case) -> None:  # noqa: ANN001
        report.cases[name] += 1
        response = case.call(base_url=base_url, timeout=60)
        report.statuses[(name, response.status_code)] += 1
        try:
            case.validate_response(response, checks=checks if not _sent_as_valid(response) else CHECKS)
        except BaseExceptionGroup as exc:  # schemathesis' FailureGroup: one entry per distinct failure
            what = "; ".join(f"{type(e).__name__}: {str(e).strip()[:400]}" for e in exc.exceptions)
            first = f"{name}: {response.status_code} {what[:300]}"
            if first not in seen:
                seen.add(first)
                report.failures.append(
                    f"{first}\n  body: {case.body!r:.300}\n  answer: {response.text[:300]}"
                )

    with contextlib.suppress(Unsatisfiable):  # no invalid input exists (an operation without parameters)
        one()
