"""Filters: the endpoints a request may go to at all (healthy, not draining, of the right role)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from services.common.pool.roles import DECODE_ROLES, PREFILL_ROLES
from services.router.scheduling.endpoint import Endpoint, Role, normalize_url

__all__ = [
    "DECODE_ROLES",
    "PREFILL_ROLES",
    "Filter",
    "apply_filters",
    "eligible",
    "is_healthy",
    "is_not_draining",
    "not_in",
    "role_in",
]

Filter = Callable[[Endpoint], bool]


def is_healthy(endpoint: Endpoint) -> bool:
    return endpoint.healthy


def is_not_draining(endpoint: Endpoint) -> bool:
    return not endpoint.draining


def role_in(roles: Collection[Role]) -> Filter:
    """Keep endpoints whose role is one of ``roles``."""
    allowed = frozenset(roles)
    return lambda endpoint: endpoint.role in allowed


def not_in(urls: Iterable[str]) -> Filter:
    """Drop endpoints already tried for this request (a retry goes elsewhere)."""
    excluded = frozenset(normalize_url(u) for u in urls)
    return lambda endpoint: endpoint.url not in excluded


def apply_filters(endpoints: Sequence[Endpoint], filters: Iterable[Filter]) -> list[Endpoint]:
    """Endpoints that pass every filter, in their original order."""
    checks = list(filters)
    return [e for e in endpoints if all(check(e) for check in checks)]


def eligible(
    endpoints: Sequence[Endpoint], roles: Collection[Role], exclude: Iterable[str] = ()
) -> list[Endpoint]:
    """The standard chain: healthy, not draining, of one of ``roles``, not already tried."""
    return apply_filters(endpoints, [is_healthy, is_not_draining, role_in(roles), not_in(exclude)])
