"""LeaseConnector with a real NIXL agent: leases, decode's notifications, expiry, no-NIXL and no-lease cases."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")

from services.common.kv.kv_transfer import KVTransferParams  # noqa: E402
from services.engine.core.request import RequestStatus  # noqa: E402
from services.engine.kv_transfer.lease_connector import ABORT_PREFIX, LeaseConnector  # noqa: E402
from tests.kv_agents import BLOCK_SIZE, nixl_agents, request  # noqa: E402

REMOTE_DECODE = KVTransferParams(do_remote_decode=True)


def _finished(rid: str, num_tokens: int, status: RequestStatus = RequestStatus.FINISHED_LENGTH):
    req = request(rid, num_tokens, kv_transfer_params=REMOTE_DECODE)
    req.transition(RequestStatus.RUNNING)
    req.transition(status)
    return req


def test_completed_prefill_is_leased_until_decode_has_read() -> None:
    with nixl_agents() as agents:
        lease = LeaseConnector(agents.prefill, "10.0.0.1", 8000, BLOCK_SIZE)
        delay, params = lease.request_finished(_finished("p1", 50), [7, 3, 9, 4])
        assert delay and params is not None and params.do_remote_prefill
        assert params.remote_block_ids == [7, 3, 9]  # the 3 full prompt blocks; the partial 4th stays here
        assert (params.remote_host, params.remote_port, params.remote_engine_id) == (
            "10.0.0.1",
            8000,
            agents.prefill.engine_id,
        )
        assert not lease.get_finished()
        handle = agents.decode.read_blocks(agents.prefill.engine_id, [7, 3, 9], [0, 1, 2], b"p1")
        agents.decode.wait(handle)
        deadline = time.monotonic() + 5
        while not (done := lease.get_finished()):
            assert time.monotonic() < deadline
        assert done.sent == {"p1"} and lease.stats().blocks["sent", "nixl"] == 3


def test_decode_declining_a_lease_frees_it_without_counting_it_sent() -> None:
    with nixl_agents() as agents:
        lease = LeaseConnector(agents.prefill, "h", 1, BLOCK_SIZE)
        assert lease.request_finished(_finished("p2", 40), [1, 2, 3])[0]
        agents.decode.send_notification(agents.prefill.engine_id, ABORT_PREFIX + b"p2")
        deadline = time.monotonic() + 5
        while not (done := lease.get_finished()):
            assert time.monotonic() < deadline
        assert done.sent == {"p2"} and not lease.stats().blocks


def test_unread_lease_expires_and_is_counted() -> None:
    with nixl_agents() as agents:
        lease = LeaseConnector(agents.prefill, "h", 1, BLOCK_SIZE, lease_s=0.05)
        assert lease.request_finished(_finished("p3", 40), [1, 2, 3])[0]
        time.sleep(0.06)
        assert lease.get_finished().sent == {"p3"} and lease.stats().failures["lease_unread"] == 1


def test_nothing_is_held_without_nixl_short_prompts_or_unfinished_requests() -> None:
    no_nixl = LeaseConnector(None, "h", 1, BLOCK_SIZE)
    delay, params = no_nixl.request_finished(_finished("p4", 40), [1, 2, 3])
    assert (
        not delay and params is not None and params.remote_engine_id == "h:1"
    )  # decode falls back to the kvstore
    with nixl_agents() as agents:
        lease = LeaseConnector(agents.prefill, "h", 1, BLOCK_SIZE)
        delay, params = lease.request_finished(_finished("p5", 10), [1])  # no full block
        assert not delay and params is not None and params.remote_block_ids == []
        assert lease.request_finished(_finished("p6", 40, RequestStatus.FINISHED_ABORTED), [1, 2]) == (
            False,
            None,
        )
        plain = request("p7", 40)
        plain.transition(RequestStatus.RUNNING)
        plain.transition(RequestStatus.FINISHED_STOPPED)
        assert lease.request_finished(plain, [1, 2]) == (False, None)
        assert lease.get_num_new_matched_tokens(plain, 0) == (0, False)  # prefill never loads


def test_engine_shutdown_releases_its_nixl_agent(llama_dir) -> None:
    """A prefill engine's agent (registration, descriptors, peers) is released when the engine shuts down."""
    from services.engine.core.config import EngineConfig
    from services.engine.engine_core import EngineCore
    from services.prefill.role import PrefillRole, PrefillSettings

    role = PrefillRole(PrefillSettings())
    core = EngineCore(
        EngineConfig(model=str(llama_dir), num_kv_blocks=16, max_model_len=128), role.connectors
    )
    assert role.transfer is not None and not role.transfer.closed
    core.shutdown()
    assert role.transfer.closed
