"""SessionSettings: session affinity's flags (on/off, the token limit, how long a session is remembered)."""

from __future__ import annotations

import argparse

from pydantic import BaseModel, ConfigDict, Field


class SessionSettings(BaseModel):
    """``enabled``: sticky until saturated; ``limit_tokens``: the token load past which a session moves
    (a calibrated limit in the pool's Redis wins; neither: the engine's KV capacity)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    limit_tokens: float | None = Field(None, gt=0)
    ttl_s: int = Field(1800, gt=0)


def add_session_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--session-affinity",
        action="store_true",
        help="sticky until saturated: a session (x-session-id, a Responses chain, or user) stays on its warm "
        "engine until that engine's token load passes the limit",
    )
    add(
        "--sticky-limit",
        type=float,
        default=None,
        metavar="TOKENS",
        help="the token-load limit (default: "
        "the one `kvferry router calibrate` wrote to Redis, else the engine's KV capacity)",
    )
    add("--session-ttl", type=int, default=1800, metavar="S", help="seconds a session's engine is remembered")


def session_settings(args: argparse.Namespace) -> SessionSettings:
    return SessionSettings(
        enabled=args.session_affinity, limit_tokens=args.sticky_limit, ttl_s=args.session_ttl
    )
