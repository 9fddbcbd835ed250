"""What an InferencePool means for a simulation: engines per role, the router's flags, the autoscaler."""

from __future__ import annotations

from collections.abc import Callable

from pool_operator.command_lines import STRATEGY_FLAG, CommandLines
from pool_operator.models import InferencePool
from pool_operator.quantity import parse_quantity
from services.router.admission.tenants import Band, Quota, Tenant
from services.router.scheduling import SchedulingConfig, ScorerWeights
from services.sim.fleet import Fleet
from services.sim.sim_autoscaler import SimAutoscaler
from services.sim.simulation import SimSettings
from services.sim.timing_model import TimingModel, TimingModelError


def _start_replicas(declared: int, bounds: tuple[int, int] | None) -> int:
    """The replicas a role starts with (within the autoscaling bounds when it is autoscaled), at least 1."""
    if bounds is not None:
        declared = min(max(declared, bounds[0]), bounds[1])
    return max(declared, 1)


def kvstore_blocks(pool: InferencePool, timing: TimingModel) -> int:
    """The pool's kvstore in blocks of ``timing`` (0 without one): its replicas' capacity together (the
    simulation does not model which replica an engine's connection lands on)."""
    store = pool.spec.kvstore
    if not store.enabled:
        return 0
    if timing.kv_bytes_per_block is None:
        raise TimingModelError(
            f"pool {pool.metadata.name} has a kvstore: the timing model needs kv_bytes_per_block to size it"
        )
    return int(parse_quantity(store.capacity) * store.replicas // timing.kv_bytes_per_block)


def pool_tenants(pool: InferencePool) -> tuple[Tenant, ...]:
    """spec.router.tenants as the router resolves them (in the simulation a tenant's key id is its name)."""
    return tuple(
        Tenant(
            name=t.name,
            key_id=t.name,
            band=Band[t.band],
            quota=Quota.model_validate(t.quota.model_dump()) if t.quota else Quota(),
        )
        for t in pool.spec.router.tenants
    )


def pool_settings(pool: InferencePool, base: SimSettings, timing: TimingModel) -> SimSettings:
    """``base`` with the pool's mode, replicas per role, strategy, weights, P/D threshold and kvstore
    (sized in ``timing``'s blocks: the timing model under the pool's limits, ``pool_timing``)."""
    spec, auto = pool.spec, pool.spec.autoscaling
    decode, prefill = (auto.bounds("decode"), auto.bounds("prefill")) if auto else (None, None)
    decode_bounds = (decode.min_replicas, decode.max_replicas) if decode else None
    prefill_bounds = (prefill.min_replicas, prefill.max_replicas) if prefill else None
    w = spec.router.weights
    return base.model_copy(
        update={
            "name": pool.metadata.name,
            "model_name": spec.model.name,
            "mode": spec.mode,
            "engines": _start_replicas(spec.decode.replicas, decode_bounds),
            "prefill": _start_replicas(spec.prefill.replicas, prefill_bounds) if spec.prefill else 0,
            "prefix_caching": spec.engine.prefix_caching,
            "kvstore_blocks": kvstore_blocks(pool, timing),
            "tenants": pool_tenants(pool),
            "flow_control": bool(CommandLines(pool).admission_args()),
            "scheduling": SchedulingConfig(
                strategy=STRATEGY_FLAG[spec.router.strategy],
                weights=ScorerWeights(prefix=w.prefix, queue=w.queue, kv=w.kv),
                pd_threshold=spec.router.pd_threshold,
            ),
        }
    )


def pool_timing(pool: InferencePool, timing: TimingModel) -> TimingModel:
    """The timing model under the pool's engine limits (block size, batch, sequences, context); a block's
    bytes scale with its size."""
    e = pool.spec.engine
    per_block = timing.kv_bytes_per_block
    return timing.model_copy(
        update={
            "block_size": e.block_size,
            "kv_bytes_per_block": per_block * e.block_size // timing.block_size if per_block else None,
            "max_num_seqs": e.max_num_seqs,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "max_model_len": e.max_model_len,
        }
    )


def pool_autoscaler(pool: InferencePool, timing: TimingModel) -> Callable[[Fleet], SimAutoscaler] | None:
    """The operator's policy (per role, or SLO over ``timing``) over the fleet, when the pool autoscales."""
    if pool.spec.autoscaling is None:
        return None
    return lambda fleet: SimAutoscaler(pool, fleet, timing)
