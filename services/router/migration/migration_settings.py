"""MigrationSettings: how the router resumes a stream whose engine failed (``--migration-*`` flags)."""

from __future__ import annotations

import argparse

from pydantic import BaseModel, ConfigDict, Field


class MigrationSettings(BaseModel):
    """Bounded attempts per request, and the silence after which a streaming engine counts as stalled."""

    model_config = ConfigDict(extra="forbid")

    attempts: int = Field(
        2, ge=0, le=16
    )  # migrations per stream at most; 0: a failed stream ends in an error
    stall_timeout_s: float | None = Field(60.0, gt=0)  # silence between two events; None: no bound


def add_migration_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--migration-attempts",
        type=int,
        default=2,
        metavar="N",
        help="a stream whose engine fails after its first token (reset, 5xx, stall) is resumed on another "
        "engine with its tokens so far, at most N times (0: it ends with an error event)",
    )
    add(
        "--migration-stall-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="silence between two events of a stream after which its engine counts as failed (0: no bound)",
    )


def migration_settings(args: argparse.Namespace) -> MigrationSettings:
    return MigrationSettings(
        attempts=args.migration_attempts, stall_timeout_s=args.migration_stall_timeout or None
    )
