"""The SLO policy of a pool: its spec.autoscaling.slo as an SloPolicy, and its timing model's source."""

from __future__ import annotations

from pydantic import ValidationError

from pool_operator.kubeclient import KubeApiError, KubeClient
from pool_operator.models import InferencePool
from pool_operator.queueing_model import QueueingModel
from pool_operator.slo_policy import RoleLimits, SloPolicy
from services.sim.timing_model import TimingModel, TimingModelError


def slo_policy(pool: InferencePool, timing: TimingModel) -> SloPolicy | None:
    """The pool's SLO policy over ``timing`` (None unless it declares spec.autoscaling.slo)."""
    auto = pool.spec.autoscaling
    if auto is None or auto.slo is None:
        return None
    slo, band = auto.slo, auto.prefill_decode_ratio
    return SloPolicy(
        model=QueueingModel(timing, slo.ttft_seconds, slo.itl_seconds),
        prefill=RoleLimits(slo.prefill.min_replicas, slo.prefill.max_replicas),
        decode=RoleLimits(slo.decode.min_replicas, slo.decode.max_replicas),
        forecast_seconds=slo.forecast_seconds,
        max_step=slo.max_step_replicas,
        stabilization_seconds=auto.scale_down_stabilization_seconds,
        ratio=(band.min, band.max) if band is not None else None,
    )


async def load_timing(client: KubeClient, pool: InferencePool) -> TimingModel:
    """The timing model spec.autoscaling.slo.timingConfigMap names (the committed default without one).

    TimingModelError names the ConfigMap and the bad field when it is missing or invalid."""
    auto = pool.spec.autoscaling
    ref = auto.slo.timing_config_map if auto is not None and auto.slo is not None else None
    if ref is None:
        return TimingModel.load()
    where = f"ConfigMap {pool.metadata.namespace}/{ref.name} key {ref.key}"
    try:
        config_map = await client.get("ConfigMap", pool.metadata.namespace, ref.name)
    except KubeApiError as error:
        if error.status == 404:
            raise TimingModelError(f"{where}: not found") from None
        raise
    text = (config_map.get("data") or {}).get(ref.key)
    if text is None:
        raise TimingModelError(f"{where}: no such key")
    try:
        return TimingModel.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}" for e in exc.errors()
        )
        raise TimingModelError(f"{where}: invalid timing model: {problems}") from None
