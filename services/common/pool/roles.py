"""Engine role names (``kvferry serve --role``), the role labels of engine pods, and how they map.

(The engine's ``EngineRole`` Protocol is the behaviour of a role; ``RoleName`` is its name.)
"""

from __future__ import annotations

from typing import Final, Literal, get_args

RoleName = Literal["both", "prefill", "decode"]
"""What one engine does: ``both`` (aggregated), ``prefill`` (keeps KV for decode), ``decode`` (pulls it)."""

ROLE_NAMES: Final[tuple[RoleName, ...]] = get_args(RoleName)

EnginePodRole = Literal["prefill", "decode", "engine"]
"""The ``kvferry.dev/role`` label value of engine pods (``engine``: the engines of an aggregated pool)."""

ENGINE_POD_ROLES: Final[tuple[EnginePodRole, ...]] = get_args(EnginePodRole)

DECODE_ROLES: Final[frozenset[RoleName]] = frozenset({"decode", "both"})
"""Engines that generate tokens: where a router sends a request for its answer."""

PREFILL_ROLES: Final[frozenset[RoleName]] = frozenset({"prefill"})
"""Engines that only compute prompts for a decode engine."""

# (pod role label, engine role name) of every engine pod role.
_POD_ROLES: Final[tuple[tuple[EnginePodRole, RoleName], ...]] = (
    ("prefill", "prefill"),
    ("decode", "decode"),
    ("engine", "both"),
)


def parse_role_name(value: str) -> RoleName:
    """``value`` as a RoleName; ValueError (naming the choices) for anything else."""
    for name in ROLE_NAMES:
        if value == name:
            return name
    raise ValueError(f"invalid choice {value!r} (choose from {', '.join(ROLE_NAMES)})")


def role_of_pod_label(label: str | None) -> RoleName | None:
    """The role of the engine in a pod whose role label is ``label``; None when it is no engine pod."""
    return next((name for pod, name in _POD_ROLES if pod == label), None)


def serve_role(pod_role: EnginePodRole) -> RoleName:
    """The ``--role`` an engine pod labelled ``pod_role`` is started with."""
    return next(name for pod, name in _POD_ROLES if pod == pod_role)
