"""Two real NIXL agents in one process (a prefill cache and a decode cache) and requests hashed like theirs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from services.common.kv.hashing import BlockHasher
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams
from services.engine.kv_transfer.nixl_transfer import NixlTransfer
from tests.engine.kv_transfer.nixl_peer import BLOCK_SIZE, compat, make_cache

HASHER = BlockHasher("tiny", BLOCK_SIZE)


@dataclass
class Agents:
    prefill: NixlTransfer
    decode: NixlTransfer
    prefill_cache: torch.Tensor
    decode_cache: torch.Tensor

    def notifications(self, timeout: float = 5.0) -> list[bytes]:
        """What prefill's agent was told (waits for the first one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            notes = self.prefill.get_notifications()
            if notes:
                return [msg for _peer, msg in notes]
            time.sleep(0.005)
        return []


@contextmanager
def nixl_agents(num_blocks: int = 16) -> Iterator[Agents]:
    """A prefill agent over random blocks, a decode agent over zeros that has loaded prefill's handshake."""
    prefill_cache = make_cache(seed=5, num_blocks=num_blocks)
    decode_cache = torch.zeros_like(prefill_cache)
    with NixlTransfer(prefill_cache, compat()) as prefill, NixlTransfer(decode_cache, compat()) as decode:
        decode.add_peer(prefill.handshake_json(), address="127.0.0.1:1")
        yield Agents(prefill, decode, prefill_cache, decode_cache)


def request(rid: str, num_tokens: int, **kw) -> Request:
    """A request of ``num_tokens`` prompt tokens hashed with the agents' block size."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return Request(rid, list(range(1, num_tokens + 1)), params, eos_token_id=0, hash_fn=HASHER.extend, **kw)
