"""The operator's RBAC is least privilege: every (group, resource, verb) the chart grants is one the operator
was seen to use against the emulator in this session's operator tests, or one a real cluster needs that
the emulator cannot show (each with its reason); and every call the operator made is granted.
(Runs after tests/operator/test_operator.py and test_pool_secret.py, whose emulator records the calls;
alone, it is skipped.)"""

from __future__ import annotations

from urllib.parse import parse_qs

import pytest
import yaml

from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from tests.operator.conftest import OPERATOR_CALLS, load_example
from tests.operator.test_chart import CHART, VARIANTS, _rules, helm

Grant = tuple[str, str, str]
# Needed by a real API server, not by the emulator. Nothing else may be granted unused.
UNSEEN_BUT_NEEDED: dict[Grant, str] = {
    ("kvferry.dev", "inferencepools/finalizers", "update"): "children carry blockOwnerDeletion; where the "
    "OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift), that needs update on the "
    "owner's finalizers",
}
# Cluster-wide (the default, and the emulator tests), kopf neither lists nor watches namespaces; serving
# named namespaces (operator.watchNamespaces) its namespace observer does, to see them come and go.
NAMESPACED_ONLY: dict[Grant, str] = {
    ("", "namespaces", "list"): "kopf's namespace observer, namespaced mode",
    ("", "namespaces", "watch"): "kopf's namespace observer, namespaced mode",
}
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def _permissions(method: str, path: str, query: str, content_type: str) -> set[Grant]:
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


def _granted(*values: str) -> set[Grant]:
    return _rules(list(yaml.safe_load_all(helm("template", "r", str(CHART), *values))))


def _escalation_floor() -> set[Grant]:
    """What the Roles the operator creates grant: Kubernetes lets only a holder of a permission grant it
    (the RBAC escalation check, which the emulator does not run), so the operator must hold these too."""
    manifests = PoolRenderer(parse_pool(load_example("disaggregated-pool.yaml"))).render()
    return _rules([m for m in manifests if m["kind"] == "Role"])


def test_the_operators_rbac_is_exactly_what_it_uses(pytestconfig: pytest.Config) -> None:
    calls = pytestconfig.stash.get(OPERATOR_CALLS, set())
    if not calls:
        pytest.skip("no operator calls recorded: run with tests/operator/test_operator.py")
    used = set().union(*(_permissions(*call) for call in calls))
    granted, floor = _granted(), _escalation_floor()
    assert used - granted == set(), "calls the chart's RBAC does not allow"
    assert floor - granted == set(), "the operator could not create the Roles it renders"
    assert granted - used - floor == set(UNSEEN_BUT_NEEDED), "granted but unused (and not UNSEEN_BUT_NEEDED)"
    assert set(UNSEEN_BUT_NEEDED) & used == set(), "now used: move it out of UNSEEN_BUT_NEEDED"


def test_the_routers_role_is_what_its_discovery_calls() -> None:
    """services/router/discovery.py lists the pool's pods by label, then watches them."""
    assert _escalation_floor() == {("", "pods", "list"), ("", "pods", "watch")}


def test_namespaced_mode_adds_only_the_namespace_observer() -> None:
    clusterwide, namespaced = _granted(), _granted(*VARIANTS["namespaced-with-sample"])
    assert namespaced - clusterwide == set(NAMESPACED_ONLY)
    assert clusterwide - namespaced == set()
