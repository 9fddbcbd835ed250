"""Engine roles, engine pod role labels, and the mapping between them (router, operator, engine CLI)."""

from __future__ import annotations

import pytest

from services.common.pool.roles import (
    DECODE_ROLES,
    ENGINE_POD_ROLES,
    PREFILL_ROLES,
    ROLE_NAMES,
    parse_role_name,
    role_of_pod_label,
    serve_role,
)


def test_the_role_sets() -> None:
    assert ROLE_NAMES == ("both", "prefill", "decode")
    assert ENGINE_POD_ROLES == ("prefill", "decode", "engine")
    assert sorted(DECODE_ROLES) == ["both", "decode"]
    assert sorted(PREFILL_ROLES) == ["prefill"]
    assert sorted(DECODE_ROLES | PREFILL_ROLES) == sorted(ROLE_NAMES)


def test_pod_labels_map_to_engine_roles() -> None:
    assert [serve_role(r) for r in ENGINE_POD_ROLES] == ["prefill", "decode", "both"]
    assert [role_of_pod_label(r) for r in ENGINE_POD_ROLES] == ["prefill", "decode", "both"]
    for label in ("router", "kvstore", "redis", "both", "", None):
        assert role_of_pod_label(label) is None


def test_parse_role_name() -> None:
    assert [parse_role_name(r) for r in ROLE_NAMES] == list(ROLE_NAMES)
    with pytest.raises(ValueError, match=r"invalid choice 'engine' \(choose from both, prefill, decode\)"):
        parse_role_name("engine")
