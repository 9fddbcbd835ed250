"""The autoscaling policy of an InferencePool: per-role replica bounds, targets and the P:D ratio band."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pool_operator.crd_model import CelRule, CrdModel


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


class AutoscalingSpec(CrdModel):
    """Per-role autoscaling policy; a role without an entry keeps its declared replicas."""

    prefill: PrefillAutoscaling | None = None
    decode: DecodeAutoscaling | None = None
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600)
    prefill_decode_ratio: RatioBand | None = None
