"""AdmissionSettings: the router's admission flags (tenants, saturation limits, queue size and TTLs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.router.admission.saturation import SaturationLimits
from services.router.admission.tenants import BAND_NAMES, Band, Tenant

DEFAULT_TTL_S = {Band.critical: 30.0, Band.standard: 15.0, Band.sheddable: 5.0}


class AdmissionSettings(BaseModel):
    """``flow_control``: requests wait in the router's queue while every engine is saturated (or none is in
    rotation); off, only tenants' quotas apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flow_control: bool = False
    tenants: tuple[Tenant, ...] = ()
    max_waiting: int | None = Field(8, gt=0)
    max_kv_usage: float | None = Field(0.95, gt=0, le=1)
    max_inflight_per_engine: int | None = Field(None, gt=0)
    sheddable_share: float = Field(1.0, gt=0, le=1)
    max_queue: int = Field(1024, gt=0)
    queue_ttl_s: dict[Band, float] = Field(default_factory=lambda: dict(DEFAULT_TTL_S))
    out_tokens_estimate: int = Field(256, gt=0, description="Charged for a request without max_tokens.")

    @field_validator("queue_ttl_s")
    @classmethod
    def _ttls(cls, value: dict[Band, float]) -> dict[Band, float]:
        bad = [b.name for b, s in value.items() if s <= 0]
        if bad:
            raise ValueError(f"--queue-ttl: {bad[0]} must be > 0 seconds")
        return {**DEFAULT_TTL_S, **value}

    @property
    def limits(self) -> SaturationLimits:
        return SaturationLimits(
            self.max_waiting, self.max_kv_usage, self.max_inflight_per_engine, self.sheddable_share
        )


def parse_ttls(text: str) -> dict[Band, float]:
    """``critical=30,sheddable=2`` -> TTL per band (the others keep their defaults)."""
    out: dict[Band, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        band = Band.parse(name)
        if not sep or band is None:
            raise argparse.ArgumentTypeError(
                f"expected BAND=SECONDS with BAND one of {', '.join(BAND_NAMES)}: {part!r}"
            )
        try:
            out[band] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: not a number: {value!r}") from None
    return out


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--tenants-file",
        type=Path,
        default=None,
        help="tenants (YAML/JSON: name, apiKey or apiKeyEnv, band, quota); their keys are client keys",
    )
    add(
        "--flow-control",
        action="store_true",
        help="hold requests in the router's fair queue while every engine is saturated or none is ready "
        "(on whenever --tenants-file is given)",
    )
    add(
        "--saturation-waiting", type=int, default=8, metavar="N", help="an engine with N waiting is saturated"
    )
    add(
        "--saturation-kv-usage",
        type=float,
        default=0.95,
        metavar="F",
        help="an engine at this KV usage is saturated",
    )
    add(
        "--max-inflight-per-engine",
        type=int,
        default=None,
        metavar="N",
        help="the pool is full at N of this router's requests in flight per engine in rotation (default: no limit)",
    )
    add(
        "--sheddable-share",
        type=float,
        default=1.0,
        metavar="F",
        help="sheddable requests fill at most this share of --max-inflight-per-engine; the rest is kept for "
        "critical and standard ones (default 1: nothing kept)",
    )
    add("--max-queue", type=int, default=1024, metavar="N", help="requests the admission queue holds at most")
    add(
        "--queue-ttl",
        type=parse_ttls,
        default={},
        metavar="BAND=S,...",
        help="longest wait per band before a 429 (default critical=30,standard=15,sheddable=5)",
    )


def admission_settings(args: argparse.Namespace, tenants: list[Tenant]) -> AdmissionSettings:
    return AdmissionSettings(
        flow_control=args.flow_control or bool(tenants),
        tenants=tuple(tenants),
        max_waiting=args.saturation_waiting,
        max_kv_usage=args.saturation_kv_usage,
        max_inflight_per_engine=args.max_inflight_per_engine,
        sheddable_share=args.sheddable_share,
        max_queue=args.max_queue,
        queue_ttl_s=args.queue_ttl,
    )
