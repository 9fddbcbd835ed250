"""The operator's RBAC is least privilege: every verb on every resource the chart grants is one the operator
was seen to use against the emulator in this session's operator tests, and every call it made is granted.
(Runs after tests/operator/test_operator.py, whose emulator records the calls; alone, it is skipped.)"""

from __future__ import annotations

from urllib.parse import parse_qs

import pytest
import yaml

from tests.operator.conftest import OPERATOR_CALLS
from tests.operator.test_chart import CHART, _rules, helm

_CHILDREN = [
    ("", "configmaps"), ("", "services"), ("", "serviceaccounts"), ("", "pods"), ("apps", "deployments"),
    ("policy", "poddisruptionbudgets"), ("networking.k8s.io", "networkpolicies"),
    ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings"),
    ("monitoring.coreos.com", "podmonitors"), ("monitoring.coreos.com", "servicemonitors"),
    ("monitoring.coreos.com", "prometheusrules"), ("inference.networking.k8s.io", "inferencepools"),
]  # fmt: skip
# Granted, yet never used in the emulator tests: each with its reason. A ratchet: the test fails when a
# grant is added unused, and when one of these starts being used (then drop it from here).
UNEXERCISED = {
    # The operator lists its children by label and writes them with server-side apply: it never GETs or
    # WATCHes one. Candidates to drop (tests/operator/test_chart.py still requires get).
    **{(g, r, v): "never used: children are listed and applied" for g, r in _CHILDREN for v in ("get", "watch")},
    **{("", "namespaces", v): "kopf's namespace scanning (globs); the tests run cluster-wide" for v in
       ("get", "list", "watch")},
    ("", "events", "patch"): "never used: kopf creates events (candidate to drop)",
    ("apiextensions.k8s.io", "customresourcedefinitions", "get"): "kopf lists and watches CRDs (candidate)",
    ("kvferry.dev", "inferencepools", "get"): "kopf lists and watches pools (candidate)",
    ("kvferry.dev", "inferencepools", "update"): "never used: kopf patches (candidate)",
    ("kvferry.dev", "inferencepools/status", "get"): "never used: status is read with the pool (candidate)",
    ("kvferry.dev", "inferencepools/status", "update"): "never used: status is patched (candidate)",
}  # fmt: skip
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def _permissions(method: str, path: str, query: str, content_type: str) -> set[tuple[str, str, str]]:
    """(group, resource[/subresource], verb) an API request needs; none for discovery (non-resource URLs).
    A server-side apply also needs ``create``: it creates the object when it does not exist yet."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return set()  # /api, /apis, /apis/GROUP/VERSION, /version
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    if method == "GET":
        verb = "get" if named else ("watch" if parse_qs(query).get("watch") == ["true"] else "list")
    else:
        verb = _VERBS[method] if named or method == "POST" else "deletecollection"
    applied = method == "PATCH" and content_type.startswith("application/apply-patch")
    return {(group, resource, verb)} | ({(group, resource, "create")} if applied else set())


def test_the_operators_rbac_is_exactly_what_it_uses(pytestconfig: pytest.Config) -> None:
    calls = pytestconfig.stash.get(OPERATOR_CALLS, set())
    if not calls:
        pytest.skip("no operator calls recorded: run with tests/operator/test_operator.py")
    used = set().union(*(_permissions(*call) for call in calls))
    granted = _rules(list(yaml.safe_load_all(helm("template", "r", str(CHART)))))
    assert used - granted == set(), "calls the chart's RBAC does not allow"
    assert granted - used == set(UNEXERCISED), "granted but unused: not the known list (UNEXERCISED)"
