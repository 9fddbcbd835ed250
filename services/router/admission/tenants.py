"""Tenants: who a client is (by API key), its priority band and its quota; read from a file or the pool's spec.

The file (``kvferry router --tenants-file``, and what the operator renders from ``spec.router.tenants``) is
YAML or JSON::

    tenants:
      - name: search
        apiKeyEnv: SEARCH_KEY        # or apiKey: the key itself (local use)
        band: critical               # critical | standard | sheddable
        quota: {tokensPerMinute: 200000, requestsPerMinute: 600, maxConcurrent: 16}
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.openai.errors import config_problem
from services.common.openai.http_middleware import tenant_of


class Band(enum.IntEnum):
    """Priority bands, most important first: a lower value is served first."""

    critical = 0
    standard = 1
    sheddable = 2

    @classmethod
    def parse(cls, text: str) -> Band | None:
        """The band a name gives (None: no such band)."""
        return cls.__members__.get(text.strip().lower())


BAND_NAMES = tuple(Band.__members__)


class Quota(BaseModel):
    """Per-key limits, each optional (None: unlimited); counted over a minute, shared by every replica."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    tokens_per_minute: int | None = Field(None, gt=0, alias="tokensPerMinute")
    requests_per_minute: int | None = Field(None, gt=0, alias="requestsPerMinute")
    max_concurrent: int | None = Field(None, gt=0, alias="maxConcurrent")


class TenantSpec(BaseModel):
    """One tenant as written in the file: its key (or the variable holding it), band and quota."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
    api_key: str | None = Field(None, min_length=8, alias="apiKey")
    api_key_env: str | None = Field(None, min_length=1, alias="apiKeyEnv")
    band: Band = Band.standard
    quota: Quota = Quota()

    @model_validator(mode="before")
    @classmethod
    def _band_by_name(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("band"), str):
            band = Band.parse(data["band"])
            if band is None:
                raise ValueError(f"band: {data['band']!r} is not one of {', '.join(BAND_NAMES)}")
            data = {**data, "band": band}
        return data

    @model_validator(mode="after")
    def _one_key(self) -> TenantSpec:
        if (self.api_key is None) == (self.api_key_env is None):
            raise ValueError("give exactly one of apiKey and apiKeyEnv")
        return self


class TenantsFile(BaseModel):
    """The whole file: tenant names and keys are unique."""

    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        names = [t.name for t in self.tenants]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"tenants: the name {dup!r} is used twice")
        return self


class Tenant(BaseModel):
    """A resolved tenant: the key's id (``tenant_of``; the key itself is not kept), band and quota."""

    model_config = ConfigDict(frozen=True)

    name: str
    key_id: str
    band: Band
    quota: Quota


def resolve(specs: TenantsFile, env: Mapping[str, str]) -> tuple[list[Tenant], list[str]]:
    """The tenants and their keys (for the router's auth); ValueError naming the tenant whose key is missing."""
    tenants, keys = [], []
    for i, spec in enumerate(specs.tenants):
        key = spec.api_key
        if spec.api_key_env is not None:
            key = env.get(spec.api_key_env, "").strip()
            if not key:
                raise ValueError(
                    f"tenants.[{i}].apiKeyEnv: ${spec.api_key_env} is not set (tenant {spec.name})"
                )
        assert key is not None
        if key in keys:
            raise ValueError(f"tenants.[{i}]: tenant {spec.name} has the same API key as another tenant")
        keys.append(key)
        tenants.append(
            Tenant(name=spec.name, key_id=tenant_of(key.encode()), band=spec.band, quota=spec.quota)
        )
    return tenants, keys


def load_tenants(path: Path, env: Mapping[str, str] | None = None) -> tuple[list[Tenant], list[str]]:
    """Read and check a tenants file; ValueError with the field named (``--tenants-file: tenants.[0].band: ...``)."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"--tenants-file: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--tenants-file: {path} is not YAML/JSON: {exc}") from None
    try:
        specs = TenantsFile.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise ValueError(f"--tenants-file {path}: {config_problem(exc)}") from None
    try:
        return resolve(specs, os.environ if env is None else env)
    except ValueError as exc:
        raise ValueError(f"--tenants-file {path}: {exc}") from None
