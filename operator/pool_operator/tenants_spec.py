"""spec.router.tenants: who the pool's clients are (an API key in a Secret each), their priority band and
quota; rendered into the routers' tenants file (``kvferry router --tenants-file``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from pool_operator.crd_model import CrdModel, SecretKeyRef

TENANTS_MOUNT = "/etc/kvferry/tenants"
TENANTS_FILE = "tenants.json"  # the key in the tenants ConfigMap, and the file name in the mount
TENANTS_CONFIG_SUFFIX = "router-tenants"  # the ConfigMap <pool>-router-tenants
TENANTS_HASH_ANNOTATION = "kvferry.dev/tenants-hash"  # on the routers' pods: a tenants change rolls them


class TenantQuota(CrdModel):
    """Per-key limits, each optional; counted in the pool's Redis, shared by every router replica."""

    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + generated tokens per minute")
    requests_per_minute: int | None = Field(None, ge=1, description="requests per minute")
    max_concurrent: int | None = Field(None, ge=1, description="requests in flight at once")


class TenantSpec(CrdModel):
    """One tenant: its key, band (a client may lower it with x-kvferry-band, never raise it) and quota."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$", max_length=63)
    api_key_secret_ref: SecretKeyRef = Field(description="the Secret key holding this tenant's API key")
    band: Literal["critical", "standard", "sheddable"] = Field(
        "standard", description="priority band in the routers' flow-control queue"
    )
    quota: TenantQuota | None = None


def key_env(index: int) -> str:
    """The router's environment variable holding tenant ``index``'s key (from its Secret)."""
    return f"KVFERRY_TENANT_KEY_{index}"


def tenants_file(tenants: Sequence[TenantSpec]) -> str:
    """The routers' tenants file: each key by its variable (never the key itself)."""
    out: list[dict[str, Any]] = []
    for i, tenant in enumerate(tenants):
        entry: dict[str, Any] = {"name": tenant.name, "apiKeyEnv": key_env(i), "band": tenant.band}
        if tenant.quota is not None:
            entry["quota"] = tenant.quota.model_dump(by_alias=True, exclude_none=True)
        out.append(entry)
    return json.dumps({"tenants": out}, sort_keys=True)


def key_env_vars(tenants: Sequence[TenantSpec]) -> list[dict[str, Any]]:
    return [
        {
            "name": key_env(i),
            "valueFrom": {
                "secretKeyRef": {"name": t.api_key_secret_ref.name, "key": t.api_key_secret_ref.key}
            },
        }
        for i, t in enumerate(tenants)
    ]
