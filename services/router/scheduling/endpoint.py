"""What the router knows about one engine endpoint: role, health, load, cache settings and context length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from services.common.pool.load_report import CacheConfig
from services.common.pool.roles import RoleName

__all__ = ["CacheConfig", "Endpoint", "EndpointLoad", "Role", "normalize_url"]

Role: TypeAlias = RoleName  # one spelling of the engine roles: services.common.pool.roles


def normalize_url(url: str) -> str:
    """The one spelling of an endpoint address used as a key (no trailing slash)."""
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """Load figures from the engine's /metrics."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An immutable snapshot of one engine endpoint; the poller publishes fresh ones."""

    url: str
    role: Role = "both"
    healthy: bool = True
    draining: bool = False
    load: EndpointLoad = field(default_factory=EndpointLoad)
    cache_config: CacheConfig | None = None
    max_model_len: int | None = None  # from the engine's /v1/models card; None until it answered
    lora_adapters: frozenset[str] = frozenset()  # LoRA adapters the engine serves (cards with a parent)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
