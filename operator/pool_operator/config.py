"""OperatorConfig: the operator process's own settings (flags and KVFERRY_OPERATOR_* variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pool_operator.images import REGISTRY, ImageSet

ENV_PREFIX = "KVFERRY_OPERATOR_"
FIELD_MANAGER = "kvferry-operator"
AUTOSCALER_FIELD_MANAGER = "kvferry-autoscaler"


class OperatorConfig(BaseModel):
    """How the operator runs: which namespaces, how often it reconciles status and autoscales."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: tuple[str, ...] = Field((), description="watched namespaces; empty: the whole cluster")
    status_interval: float = Field(10.0, gt=0, description="seconds between status refreshes")
    autoscale_interval: float = Field(15.0, gt=0, description="seconds between autoscaling decisions")
    drain_seconds: float = Field(30.0, ge=0, description="how long a draining pod is kept before removal")
    scrape_timeout: float = Field(2.0, gt=0)
    retry_delay: float = Field(
        15.0, gt=0, description="seconds before a failed apply is retried (e.g. a CRD not installed yet)"
    )
    metrics_port: int = Field(8080, ge=0, le=65535, description="0 disables the /metrics listener")
    liveness_port: int = Field(0, ge=0, le=65535, description="0 disables the /healthz listener")
    operator_namespace: str = Field(
        "kvferry-system",
        min_length=1,
        description="the operator's own namespace (the engines trust its pods there)",
    )
    allow_host_path_models: bool = Field(
        False,
        description="serve pools whose spec.model.source.hostPath mounts a node folder (off: such pools are "
        "refused, since a pool author could otherwise mount any folder of any node)",
    )
    standalone: bool = True
    image_registry: str = REGISTRY
    image_version: str = ""

    @property
    def images(self) -> ImageSet:
        return ImageSet(self.image_registry, self.image_version)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> OperatorConfig:
        """Read KVFERRY_OPERATOR_<FIELD> variables, then apply explicit overrides (CLI flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = tuple(p for p in raw.split(",") if p) if name == "namespaces" else raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            details = "; ".join(
                f"{ENV_PREFIX}{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in error.errors()
            )
            raise ValueError(f"invalid operator settings: {details}") from None
