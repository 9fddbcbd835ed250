"""The one NIXL agent factory (torch-free; nixl imported on first use) for engines and the kvstore.

Two work-arounds live here and nowhere else: nixl 1.5.1's Python ``nixl_agent`` hard-codes the
progress thread's ``pthrDelay`` to 0, so an idle agent spins a whole core (the agent is built from
the C++ bindings' ``nixlAgentConfig`` instead); and UCX over TCP stalls ~20 ms per small message
on Nagle's algorithm unless ``UCX_TCP_NODELAY=y`` is set before the backend starts.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.common.kv.kv_transfer import KVTransferError


class NixlAgentConfig(BaseModel):
    """Agent settings. ``progress_delay_us`` > 0 is what keeps an idle agent off the CPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    progress_delay_us: int = Field(
        1000,
        gt=0,
        description="Sleep of the agent's progress thread between polls (C++ nixlAgentConfig.pthrDelay).",
    )
    backends: tuple[str, ...] = ("UCX",)
    tcp_nodelay: bool = Field(
        True, description="Set UCX_TCP_NODELAY=y (UCX over TCP stalls ~20 ms on Nagle)."
    )


def nixl_bindings() -> ModuleType:
    """The nixl C++ bindings, imported on first use (everything runs without nixl installed)."""
    try:
        importlib.import_module("nixl")
        return importlib.import_module("nixl._bindings")
    except ImportError as exc:
        raise KVTransferError(
            f"NIXL is not available ({exc}); install kvferry[engine] (nixl==1.5.1)"
        ) from exc


def nixl_available() -> bool:
    """True when nixl imports (KV can move over NIXL; otherwise fall back to the kvstore)."""
    try:
        nixl_bindings()
    except KVTransferError:
        return False
    return True


def make_agent(name: str, config: NixlAgentConfig | None = None) -> Any:
    """A nixl agent named ``name`` whose progress thread sleeps ``progress_delay_us`` between polls,
    with ``config.backends`` created; KVTransferError when nixl or a backend is not available."""
    config = config or NixlAgentConfig()
    if config.tcp_nodelay:
        os.environ.setdefault("UCX_TCP_NODELAY", "y")  # read by UCX when the backend starts
    nb = nixl_bindings()
    agent_config = nb.nixlAgentConfig(True, False, 0, nb.NIXL_THREAD_SYNC_RW)
    agent_config.pthrDelay = config.progress_delay_us
    agent = nb.nixlAgent(name, agent_config)
    available = agent.getAvailPlugins()
    for backend in config.backends:
        if backend not in available:
            raise KVTransferError(f"NIXL backend {backend!r} is not available (have {sorted(available)})")
        agent.createBackend(backend, {})
    return agent
