"""The autoscaling policy of an InferencePool: per-role replica bounds, targets and the P:D ratio band."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pool_operator.crd_model import DNS_SUBDOMAIN, CelRule, CrdModel


class PrefillTarget(CrdModel):
    """Per-replica target of the prefill role."""

    metric: Literal["WaitingRequests", "PromptTokensPerSecond"]
    average_value: float = Field(gt=0)


class DecodeTarget(CrdModel):
    """Per-replica target of the decode role (the engines, when Aggregated)."""

    CEL_RULES = (
        CelRule(
            "self.metric != 'KVCacheUsage' || self.averageValue <= 1.0",
            "a KVCacheUsage target is a ratio in (0, 1]",
            lambda s: s.metric != "KVCacheUsage" or s.average_value <= 1.0,
        ),
    )

    metric: Literal["KVCacheUsage", "ITLP90Seconds"]
    average_value: float = Field(gt=0)


class _Bounds(CrdModel):
    CEL_RULES = (
        CelRule(
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must be <= maxReplicas",
            lambda s: s.min_replicas <= s.max_replicas,
        ),
    )

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(ge=1)


class PrefillAutoscaling(_Bounds):
    """Bounds and target of the prefill role."""

    CEL_RULES = _Bounds.CEL_RULES
    target: PrefillTarget


class DecodeAutoscaling(_Bounds):
    """Bounds and target of the decode role."""

    CEL_RULES = _Bounds.CEL_RULES
    target: DecodeTarget


class RatioBand(CrdModel):
    """Allowed prefill:decode replica ratio."""

    CEL_RULES = (
        CelRule("self.min <= self.max", "prefillDecodeRatio.min must be <= max", lambda s: s.min <= s.max),
    )

    min: float = Field(gt=0)
    max: float = Field(gt=0)


class RoleBounds(_Bounds):
    """Replica bounds of one role under the SLO policy (at least one: the policy sizes from live metrics)."""

    CEL_RULES = _Bounds.CEL_RULES
    min_replicas: int = Field(1, ge=1)


class TimingConfigMap(CrdModel):
    """A ConfigMap key holding a `kvferry sim calibrate` timing model (JSON) of this pool's engines."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = Field("timing.json", pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)


class SloAutoscaling(CrdModel):
    """Prefill and decode scaled together from TTFT and ITL targets (queueing model, forecast, P:D band)."""

    ttft_seconds: float = Field(gt=0, description="time-to-first-token target")
    itl_seconds: float = Field(gt=0, description="inter-token latency target")
    prefill: RoleBounds
    decode: RoleBounds
    forecast_seconds: int = Field(
        120, ge=0, le=3600, description="plan capacity for the arrival rate forecast this far ahead"
    )
    max_step_replicas: int = Field(4, ge=1, le=100, description="most replicas one role moves per decision")
    timing_config_map: TimingConfigMap | None = Field(
        None, description="the engines' calibrated timing model (default: the committed SmolLM2 CPU model)"
    )


class AutoscalingSpec(CrdModel):
    """Per-role autoscaling policy, or the SLO policy of both roles; a role without one keeps its replicas."""

    CEL_RULES = (
        CelRule(
            "!has(self.slo) || (!has(self.prefill) && !has(self.decode))",
            "autoscaling.slo replaces autoscaling.prefill and autoscaling.decode: set one or the other",
            lambda s: s.slo is None or (s.prefill is None and s.decode is None),
        ),
    )

    prefill: PrefillAutoscaling | None = None
    decode: DecodeAutoscaling | None = None
    slo: SloAutoscaling | None = None
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600)
    prefill_decode_ratio: RatioBand | None = None

    def bounds(self, role: str) -> _Bounds | None:
        """The replica bounds of ``role`` ("prefill" or "decode"), whichever policy owns it; None if none."""
        if self.slo is not None:
            return self.slo.prefill if role == "prefill" else self.slo.decode
        return self.prefill if role == "prefill" else self.decode
