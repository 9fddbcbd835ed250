"""PullConnector with two real NIXL agents: every outcome of a decode request's pull from prefill."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl")

from services.common.kv.kv_transfer import KVTransferParams  # noqa: E402
from services.engine.core.kv_connector import FinishedTransfers  # noqa: E402
from services.engine.kv_transfer.pull_connector import ABORT_PREFIX, PullConnector  # noqa: E402
from tests.kv_agents import BLOCK_SIZE, HASHER, Agents, nixl_agents, request  # noqa: E402


def _params(
    agents: Agents,
    prompt_len: int,
    remote_ids: list[int],
    lease_s: float = 30.0,
    engine_id: str | None = None,
) -> KVTransferParams:
    hashes = HASHER.hash_tokens(list(range(1, prompt_len + 1)))[: len(remote_ids)]
    return KVTransferParams.for_remote_decode(
        engine_id=engine_id or agents.prefill.engine_id,
        host="127.0.0.1",
        port=1,
        request_id="prefill-req",
        block_ids=remote_ids,
        block_hashes=hashes,
        block_size=BLOCK_SIZE,
        lease_s=lease_s,
    )


def _wait(pull: PullConnector) -> FinishedTransfers:
    deadline = time.monotonic() + 10
    while not (done := pull.get_finished()):
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.002)
    return done


def test_blocks_past_the_local_hit_are_read_into_ours() -> None:
    with nixl_agents() as agents:
        pull = PullConnector(agents.decode, BLOCK_SIZE)
        req = request("d1", 50, kv_transfer_params=_params(agents, 50, [3, 5, 7]))
        assert pull.get_num_new_matched_tokens(req, 16) == (32, True)  # 48 loadable, 16 already local
        pull.update_state_after_alloc(req, [9, 10, 11], 32)
        assert req.kv_transfer_params is None  # consumed
        assert pull.request_finished(req, [9, 10, 11]) == (
            True,
            None,
        )  # aborted now: keep blocks until the read ends
        assert _wait(pull).received == {"d1"}
        assert torch.equal(agents.decode_cache[10], agents.prefill_cache[5])
        assert torch.equal(agents.decode_cache[11], agents.prefill_cache[7])
        assert not agents.decode_cache[9].any()  # the local hit's block is not overwritten
        assert agents.notifications() == [b"prefill-req"]  # prefill may free the lease
        assert pull.stats().blocks["received", "nixl"] == 2


def test_full_prompt_is_capped_one_token_short() -> None:
    with nixl_agents() as agents:
        pull = PullConnector(agents.decode, BLOCK_SIZE)
        req = request("d2", 48, kv_transfer_params=_params(agents, 48, [1, 2, 3]))
        assert pull.get_num_new_matched_tokens(req, 0) == (47, True)  # the last token is computed here


def test_local_hit_covering_prefills_blocks_releases_the_lease() -> None:
    with nixl_agents() as agents:
        pull = PullConnector(agents.decode, BLOCK_SIZE)
        req = request("d3", 50, kv_transfer_params=_params(agents, 50, [3, 5]))
        assert pull.get_num_new_matched_tokens(req, 32) == (0, False)
        assert req.kv_transfer_params is None and agents.notifications() == [ABORT_PREFIX + b"prefill-req"]
        assert not pull.stats().failures


@pytest.mark.parametrize("case", ["hash_mismatch", "unknown_peer", "lease_expired", "no_transfer_path"])
def test_unusable_params_are_counted_and_the_prompt_served_locally(case: str) -> None:
    with nixl_agents() as agents:
        pull = PullConnector(None if case == "no_transfer_path" else agents.decode, BLOCK_SIZE)
        params = _params(
            agents,
            50,
            [3, 5, 7],
            lease_s=-1 if case == "lease_expired" else 30,
            engine_id="somebody-else" if case == "unknown_peer" else None,
        )
        req = request("d4", 50 if case != "hash_mismatch" else 49, kv_transfer_params=params)
        if case == "hash_mismatch":
            req.prompt_token_ids[0] = req.all_token_ids[0] = 999
            req.block_hashes[:] = HASHER.hash_tokens(req.all_token_ids)
        assert pull.get_num_new_matched_tokens(req, 0) == (0, False)
        assert req.kv_transfer_params is None and dict(pull.stats().failures) == {case: 1}


def test_read_that_cannot_start_is_reported_failed() -> None:
    with nixl_agents(num_blocks=8) as agents:
        pull = PullConnector(agents.decode, BLOCK_SIZE)
        req = request("d5", 50, kv_transfer_params=_params(agents, 50, [3, 5, 70]))  # 70: no such block
        assert pull.get_num_new_matched_tokens(req, 0) == (48, True)
        pull.update_state_after_alloc(req, [0, 1, 2], 48)
        assert pull.get_finished().failed == {"d5"} and pull.stats().failures["transfer_error"] == 1
        assert pull.request_finished(req, [0, 1, 2]) == (
            False,
            None,
        )  # nothing writes into its blocks any more


def test_request_ending_before_its_pull_releases_the_lease() -> None:
    with nixl_agents() as agents:
        pull = PullConnector(agents.decode, BLOCK_SIZE)
        req = request("d6", 50, kv_transfer_params=_params(agents, 50, [3, 5, 7]))
        assert pull.request_finished(req, []) == (False, None)
        assert agents.notifications() == [ABORT_PREFIX + b"prefill-req"]
