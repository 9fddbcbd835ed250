"""ResponsesSettings: the router's Responses API store (TTL, size cap, encryption key) and its flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.common.pool.pool_secret import read_pool_secret


class ResponsesSettings(BaseModel):
    """How stored responses are kept (in the pool's Redis when the router has one, else in memory)."""

    model_config = ConfigDict(extra="forbid")

    ttl_s: int = Field(86400, gt=0, description="How long a stored response stays (seconds).")
    max_bytes: int = Field(
        4 << 20, gt=0, description="Largest stored record: the conversation and the answer."
    )
    key: SecretStr | None = None  # stored bodies are AES-GCM sealed with a key derived from it


def add_responses_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--responses-ttl", type=int, default=86400, metavar="S", help="seconds a stored response stays"
    )
    parser.add_argument(
        "--responses-max-bytes",
        type=int,
        default=4 << 20,
        metavar="BYTES",
        help="largest stored response record (its conversation and answer); a bigger input is a 400",
    )
    parser.add_argument(
        "--responses-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="a secret file (e.g. the pool secret's mount): stored responses are encrypted with a key derived "
        "from it; every replica must get the same file",
    )


def responses_settings(args: argparse.Namespace) -> ResponsesSettings:
    """The settings of the flags (ValueError naming the flag when they are wrong)."""
    key = read_pool_secret(args.responses_key_file, "--responses-key-file")
    return ResponsesSettings(ttl_s=args.responses_ttl, max_bytes=args.responses_max_bytes, key=key)
