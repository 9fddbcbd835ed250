"""The kv_transfer_params contract and KV compatibility checks (torch-free)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.kv.kv_transfer import (
    KVAgent,
    KVCompat,
    KVHandshake,
    KVIncompatibleError,
    KVTransferParams,
    block_major_layout,
)

COMPAT = KVCompat(
    model_id="tiny",
    block_size=16,
    hash_version=1,
    dtype="float32",
    bytes_per_block=8192,
    kv_layout=block_major_layout(2, 16, 2, 16),
)


def test_prefill_answer_roundtrips_through_json() -> None:
    params = KVTransferParams.for_remote_decode(
        engine_id="e1",
        host="10.0.0.1",
        port=8000,
        request_id="req-1",
        block_ids=[4, 9],
        block_hashes=[b"\x01" * 32, b"\x02" * 32],
        block_size=16,
        lease_s=30,
    )
    again = KVTransferParams.model_validate_json(params.model_dump_json())
    assert again == params
    assert again.do_remote_prefill and not again.do_remote_decode
    assert again.num_tokens == 32 and again.hashes() == [b"\x01" * 32, b"\x02" * 32]
    assert again.address == "10.0.0.1:8000"
    assert not again.lease_expired() and again.lease_expired(now=again.lease_expires)


def test_vllm_shaped_request_is_accepted() -> None:
    params = KVTransferParams.model_validate({"do_remote_decode": True, "tp_size": 1})
    assert params.do_remote_decode and params.remote_block_ids == []


@pytest.mark.parametrize(
    "body",
    [
        {"do_remote_decode": True, "do_remote_prefill": True},
        {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e"},  # no host/port
        {"remote_block_ids": [1, 2], "block_hashes": ["00"]},
        {"remote_block_ids": [1], "block_hashes": ["zz"]},
        {"remote_block_ids": [-1]},
    ],
)
def test_inconsistent_params_are_rejected(body: dict) -> None:
    with pytest.raises(ValidationError):
        KVTransferParams.model_validate(body)


def test_compat_names_every_mismatched_field() -> None:
    COMPAT.check(COMPAT.model_copy())
    other = COMPAT.model_copy(update={"block_size": 32, "hash_version": 2})
    with pytest.raises(KVIncompatibleError) as err:
        COMPAT.check(other, peer="engine b")
    assert set(err.value.fields) == {"block_size", "hash_version"}
    assert "block_size: local=16 remote=32" in str(err.value) and "engine b" in str(err.value)
    int4 = COMPAT.model_copy(update={"weights": "int4"})  # same model, other weights: other KV
    with pytest.raises(KVIncompatibleError, match="weights: local='none' remote='int4'"):
        COMPAT.check(int4)


def test_handshake_json_carries_bytes_as_base64() -> None:
    hs = KVHandshake(engine_id="e", agent_metadata=b"\x00\xff", base_addr=4096, num_blocks=8, compat=COMPAT)
    assert '"AP8="' in hs.model_dump_json()
    assert KVHandshake.model_validate_json(hs.model_dump_json()) == hs


def test_a_tensor_parallel_handshake_names_one_agent_per_rank() -> None:
    tp2 = COMPAT.model_copy(update={"tensor_parallel_size": 2})
    rank1 = KVAgent(engine_id="e.tp1", agent_metadata=b"\x01", base_addr=8192, num_blocks=8)
    hs = KVHandshake(
        engine_id="e", agent_metadata=b"\x00", base_addr=4096, num_blocks=8, compat=tp2, tp_ranks=[rank1]
    )
    assert KVHandshake.model_validate_json(hs.model_dump_json()).tp_ranks == [rank1]
    with pytest.raises(ValidationError, match="needs 1 tp_ranks agents, got 0"):
        KVHandshake(engine_id="e", agent_metadata=b"", base_addr=0, num_blocks=8, compat=tp2)
    with pytest.raises(KVIncompatibleError, match="tensor_parallel_size: local=1 remote=2"):
        COMPAT.check(tp2)
