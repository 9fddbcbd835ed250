"""What an InferencePool means for a simulation: engines per role, the router's flags, the autoscaler."""

from __future__ import annotations

from collections.abc import Callable

from pool_operator.command_lines import STRATEGY_FLAG
from pool_operator.models import InferencePool
from services.router.scheduling import SchedulingConfig, ScorerWeights
from services.sim.fleet import Fleet
from services.sim.sim_autoscaler import SimAutoscaler
from services.sim.simulation import SimSettings
from services.sim.timing_model import TimingModel


def _start_replicas(declared: int, bounds: tuple[int, int] | None) -> int:
    """The replicas a role starts with (within the autoscaling bounds when it is autoscaled), at least 1."""
    if bounds is not None:
        declared = min(max(declared, bounds[0]), bounds[1])
    return max(declared, 1)


def pool_settings(pool: InferencePool, base: SimSettings) -> SimSettings:
    """``base`` with the pool's mode, replicas per role, strategy, weights and P/D threshold."""
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
            "scheduling": SchedulingConfig(
                strategy=STRATEGY_FLAG[spec.router.strategy],
                weights=ScorerWeights(prefix=w.prefix, queue=w.queue, kv=w.kv),
                pd_threshold=spec.router.pd_threshold,
            ),
        }
    )


def pool_timing(pool: InferencePool, timing: TimingModel) -> TimingModel:
    """The timing model under the pool's engine limits (block size, batch, sequences, context)."""
    e = pool.spec.engine
    return timing.model_copy(
        update={
            "block_size": e.block_size,
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
