"""P2PSettings: when the router asks a prefix's holder to lease it to the engine it picked (``--p2p-*`` flags)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.common.pool.pool_secret import read_pool_secret

# Below this many tokens more on the holder, recomputing costs about as much as the export round trip and the
# READ (an HTTP call, a handshake the first time, one NIXL transfer): a 1024-token prefill is tens of ms on a
# GPU, the pull a few ms (benchmarks/p2p_pull.py measures both).
DEFAULT_P2P_MIN_TOKENS = 1024


class P2PSettings(BaseModel):
    """``enabled`` off: never pull; else pull when a holder's primary pool has ``min_tokens`` more of the prompt."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    min_tokens: int = Field(DEFAULT_P2P_MIN_TOKENS, ge=1)
    timeout_s: float = Field(2.0, gt=0)  # the holder's /kv/export answer; later: the picked engine recomputes
    pool_secret: SecretStr | None = None  # engines started with --pool-secret-file require it on /kv/*


def add_p2p_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--p2p-min-tokens",
        type=int,
        default=DEFAULT_P2P_MIN_TOKENS,
        metavar="N",
        help="the engine picked for a request READs the prompt's cached prefix from another engine (over "
        "NIXL, leased through that engine's /kv/export) when that engine holds at least N more of its "
        f"tokens in its KV cache ({DEFAULT_P2P_MIN_TOKENS}); needs --redis-url",
    )
    add("--no-p2p-pull", dest="p2p_pull", action="store_false", help="never pull a prefix from a peer engine")
    add(
        "--pool-secret-file",
        type=Path,
        default=None,
        help="the pool's shared secret (the engines' --pool-secret-file): sent on the engines' /kv/ side "
        "channel (P2P prefix pulls)",
    )


def p2p_settings(args: argparse.Namespace) -> P2PSettings:
    if args.p2p_min_tokens < 1:
        raise ValueError(f"--p2p-min-tokens {args.p2p_min_tokens}: must be at least 1 (--no-p2p-pull: off)")
    return P2PSettings(
        enabled=args.p2p_pull and args.redis_url is not None,
        min_tokens=args.p2p_min_tokens,
        pool_secret=read_pool_secret(args.pool_secret_file),
    )
