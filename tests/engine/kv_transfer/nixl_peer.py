"""A NixlTransfer in its own process for the two-process tests: prints its handshake, answers commands."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from services.common.kv.hashing import HASH_VERSION
from services.common.kv.kv_transfer import KVCompat, block_major_layout
from services.engine.kv_transfer.nixl_transfer import NixlConfig, NixlTransfer

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 16, 2, 16


def compat(block_size: int = BLOCK_SIZE, model_id: str = "tiny") -> KVCompat:
    """The tiny test layout (float32, 8 KiB per block)."""
    return KVCompat(
        model_id=model_id,
        block_size=block_size,
        hash_version=HASH_VERSION,
        dtype="float32",
        bytes_per_block=LAYERS * 2 * block_size * HEADS * HEAD_DIM * 4,
        kv_layout=block_major_layout(LAYERS, block_size, HEADS, HEAD_DIM),
    )


def make_cache(seed: int, num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """A block-major cache whose contents depend only on ``seed`` (the other process recomputes it)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((num_blocks, LAYERS, 2, block_size, HEADS, HEAD_DIM), generator=gen)


def _answer(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--delay-us", type=int, default=1000)
    args = p.parse_args()
    torch.set_num_threads(1)
    cache = make_cache(args.seed, args.num_blocks, args.block_size)
    config = NixlConfig(progress_delay_us=args.delay_us)
    transfer = NixlTransfer(cache, compat(args.block_size), config=config)
    _answer({"handshake": transfer.handshake_json()})
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "notifs":  # wait up to N seconds for at least one notification
            deadline, got = time.monotonic() + float(rest[0]), []
            while not got and time.monotonic() < deadline:
                got = transfer.get_notifications()
                time.sleep(0.01)
            _answer({"notifs": [[peer, msg.decode()] for peer, msg in got]})
        elif cmd == "idle":  # CPU seconds this process used per wall second while idle
            cpu0, wall0 = time.process_time(), time.monotonic()
            time.sleep(float(rest[0]))
            _answer({"cpu_per_s": (time.process_time() - cpu0) / (time.monotonic() - wall0)})
        elif cmd == "quit":
            break
    transfer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
