"""make_agent: the one NIXL agent factory (UCX_TCP_NODELAY set, missing backends refused)."""

from __future__ import annotations

import os

import pytest

from services.common.kv.kv_transfer import KVTransferError
from services.common.kv.nixl_agent import NixlAgentConfig, make_agent, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")


def test_agent_with_ucx_sets_tcp_nodelay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TCP_NODELAY", raising=False)
    agent = make_agent("test-agent", NixlAgentConfig(progress_delay_us=500))
    assert agent.getLocalMD()
    assert os.environ["UCX_TCP_NODELAY"] == "y"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(KVTransferError, match="NIXL backend 'NOPE' is not available"):
        make_agent("test-agent-2", NixlAgentConfig(backends=("NOPE",), tcp_nodelay=False))
