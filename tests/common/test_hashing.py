"""Block hashes: chained, salted, versioned, and identical across processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.kv.hashing import HASH_VERSION, BlockHasher, BlockHashExtras

TOKENS = list(range(100, 150))


def test_only_full_blocks_and_chaining() -> None:
    h = BlockHasher("m", 16)
    hashes = h.hash_tokens(TOKENS)
    assert len(hashes) == 3
    assert h.hash_tokens(TOKENS[:32]) == hashes[:2]
    changed = h.hash_tokens([0] + TOKENS[1:])
    assert all(a != b for a, b in zip(hashes, changed, strict=True))  # a change propagates down the chain
    grown = h.extend(list(hashes[:1]), TOKENS)
    assert grown == hashes


def test_salt_lora_model_block_size_and_version_isolate() -> None:
    base = BlockHasher("m", 16).hash_tokens(TOKENS)
    assert BlockHasher("m", 16).hash_tokens(TOKENS, BlockHashExtras(cache_salt="t1")) != base
    assert BlockHasher("m", 16).hash_tokens(TOKENS, BlockHashExtras(lora_name="a"))[1] != base[1]
    assert BlockHasher("other", 16).hash_tokens(TOKENS) != base
    assert BlockHasher("m", 16, HASH_VERSION + 1).hash_tokens(TOKENS) != base
    assert BlockHasher("m", 8).hash_tokens(TOKENS)[0] != base[0]


def test_partial_block_is_rejected() -> None:
    with pytest.raises(ValueError, match="full blocks"):
        BlockHasher("m", 16).hash_block(b"", TOKENS[:5])


def test_two_processes_compute_identical_hashes() -> None:
    code = (
        "from services.common.kv.hashing import BlockHasher, BlockHashExtras;"
        f"print(','.join(h.hex() for h in BlockHasher('m', 16).hash_tokens({TOKENS!r}, BlockHashExtras(cache_salt='s'))))"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root
    ).stdout.strip()
    here = ",".join(
        h.hex() for h in BlockHasher("m", 16).hash_tokens(TOKENS, BlockHashExtras(cache_salt="s"))
    )
    assert out == here
