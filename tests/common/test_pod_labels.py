"""The labels and annotations of a pool's objects: one spelling for the operator and the router."""

from __future__ import annotations

from services.common.pool.pod_labels import (
    DRAINING_ANNOTATION,
    POOL_LABEL,
    ROLE_LABEL,
    is_draining,
    pool_labels,
    pool_selector,
    role_selector,
    selector_string,
)


def test_labels_of_a_role_and_of_the_pool() -> None:
    assert pool_labels("p", "decode") == {
        "app.kubernetes.io/name": "kvferry",
        "app.kubernetes.io/instance": "p",
        "app.kubernetes.io/component": "decode",
        "app.kubernetes.io/part-of": "kvferry",
        "app.kubernetes.io/managed-by": "kvferry-operator",
        "kvferry.dev/pool": "p",
        "kvferry.dev/role": "decode",
    }
    assert ROLE_LABEL not in pool_labels("p", None) and pool_labels("p", None)[POOL_LABEL] == "p"


def test_selectors() -> None:
    assert selector_string(role_selector("p", "prefill")) == "kvferry.dev/pool=p,kvferry.dev/role=prefill"
    assert (
        selector_string(pool_selector("p"))
        == "kvferry.dev/pool=p,app.kubernetes.io/managed-by=kvferry-operator"
    )


def test_draining_is_the_annotation_set_to_true() -> None:
    assert is_draining({DRAINING_ANNOTATION: "true"})
    assert not is_draining({DRAINING_ANNOTATION: "false"}) and not is_draining({}) and not is_draining(None)
