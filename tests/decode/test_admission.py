"""Decode admission: kv_transfer_params checked per role, prefill's handshake over real HTTP, restarts counted."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

pytest.importorskip("nixl")

from services.cli import main  # noqa: E402
from services.common.kv.kv_transfer import KVTransferParams  # noqa: E402
from services.common.openai.errors import OpenAIError  # noqa: E402
from services.engine.entrypoints.handshake import handshake_router  # noqa: E402
from services.engine.entrypoints.pull_admission import PullAdmission  # noqa: E402
from services.engine.kv_transfer.nixl_transfer import NixlTransfer  # noqa: E402
from services.engine.kv_transfer.pull_connector import PullConnector  # noqa: E402
from services.prefill.role import PrefillRole, PrefillSettings  # noqa: E402
from tests.engine.kv_transfer.nixl_peer import compat, make_cache  # noqa: E402
from tests.kv_agents import BLOCK_SIZE, HASHER, nixl_agents  # noqa: E402


@contextmanager
def serving_handshake(transfer: NixlTransfer | None) -> Iterator[str]:
    """``GET /kv/handshake`` of ``transfer`` on a real socket; yields ``host:port``."""
    app = FastAPI()
    app.include_router(handshake_router(transfer))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield address
    server.should_exit = True
    thread.join(10)
    sock.close()


def _raw(engine_id: str, address: str) -> dict:
    host, port = address.rsplit(":", 1)
    params = KVTransferParams.for_remote_decode(
        engine_id=engine_id,
        host=host,
        port=int(port),
        request_id="p-9",
        block_ids=[1, 2],
        block_hashes=HASHER.hash_tokens(list(range(1, 40)))[:2],
        block_size=BLOCK_SIZE,
    )
    return params.model_dump(mode="json")


def test_first_request_loads_prefills_agent_over_http() -> None:
    with nixl_agents() as agents:
        fresh = NixlTransfer(make_cache(seed=1, num_blocks=4), compat())  # decode side, no peers yet
        pull = PullConnector(fresh, BLOCK_SIZE)
        with serving_handshake(agents.prefill) as address:
            params = asyncio.run(PullAdmission(fresh, pull).admit(_raw(agents.prefill.engine_id, address), 1))
        assert params is not None and params.do_remote_prefill and fresh.has_peer(agents.prefill.engine_id)
        assert not pull.stats().failures
        fresh.close()


def test_restarted_prefill_is_counted_and_served_locally() -> None:
    """The handshake names another engine than the params: the blocks died with the old process."""
    with nixl_agents() as agents:
        fresh = NixlTransfer(make_cache(seed=1, num_blocks=4), compat())
        pull = PullConnector(fresh, BLOCK_SIZE)
        with serving_handshake(agents.decode) as address:  # "restarted": a new agent at the old address
            params = asyncio.run(PullAdmission(fresh, pull).admit(_raw(agents.prefill.engine_id, address), 1))
        assert params is not None and not params.do_remote_prefill and params.remote_block_ids == []
        assert dict(pull.stats().failures) == {"peer_restarted": 1}
        fresh.close()


def test_prefill_without_nixl_answers_a_clear_404() -> None:
    with serving_handshake(None) as address:
        reply = httpx.get(f"http://{address}/kv/handshake")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "kv_transfer_unavailable"


@pytest.mark.parametrize(
    ("raw", "n", "param"),
    [
        ({"do_remote_decode": True}, 1, "kv_transfer_params"),  # decode engines do not lease
        ({"do_remote_prefill": "sure"}, 1, "kv_transfer_params"),
        ({"do_remote_prefill": False}, 2, "n"),
    ],
)
def test_decode_refuses_what_it_does_not_serve(raw: dict, n: int, param: str) -> None:
    admission = PullAdmission(None, PullConnector(None, BLOCK_SIZE))
    with pytest.raises(OpenAIError) as err:
        asyncio.run(admission.admit(raw, n))
    assert err.value.status == 400 and err.value.info.param == param


def test_prefill_refuses_do_remote_prefill() -> None:
    role = PrefillRole(PrefillSettings())
    with pytest.raises(OpenAIError, match="prefill engine") as err:
        asyncio.run(role.admit({"do_remote_prefill": True, "remote_block_ids": []}, 1))
    assert err.value.status == 400
    assert asyncio.run(role.admit({"do_remote_decode": True}, 1)).do_remote_decode


def test_kv_lease_on_an_embedding_engine_is_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--role", "both", "--task", "embed", "--kv-lease", "5"]) == 2
    assert "--kv-lease: an embedding engine (--task embed) leases no KV" in capsys.readouterr().err


@pytest.mark.parametrize(("kv_adapter", "request_adapter"), [("sql", None), (None, "sql"), ("sql", "chat")])
def test_decode_refuses_kv_of_another_adapter(kv_adapter: str | None, request_adapter: str | None) -> None:
    """KV computed under one LoRA adapter (or the base model) is never decoded under another: 409, counted."""
    raw = _raw("prefill-1", "127.0.0.1:9") | {"lora_name": kv_adapter}
    pull = PullConnector(None, BLOCK_SIZE)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(PullAdmission(None, pull).admit(raw, 1, request_adapter))
    assert err.value.status == 409 and err.value.info.code == "kv_incompatible"
    assert dict(pull.stats().failures) == {"adapter_mismatch": 1}
    same = asyncio.run(PullAdmission(None, pull).admit(raw, 1, kv_adapter))
    assert same is not None and same.lora_name == kv_adapter and same.do_remote_prefill
