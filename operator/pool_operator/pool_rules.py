"""PoolRules: the one source of a pool's Prometheus recording rules and alerts (PrometheusRule and promtool).

Every series is selected by the pool's ``namespace`` and ``pool`` labels (the scrape monitor's
relabelings put ``pool`` and ``role`` on every target), so the rules of two pools never collide.
Metric names are the engines' (``services.common.pool.load_report``), the router's and the kvstore's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.pool import load_report as lr

ENGINE_ROLES_RE = "prefill|decode|engine"  # the kvferry.dev/role values of engine pods
KV_USAGE_ALERT = 0.9
KV_USAGE_FOR = "5m"
FALLBACK_RATIO_ALERT = 0.05
WINDOW = "5m"

Rule = dict[str, Any]


def quantile_record(metric: str, q: float) -> str:
    """The recorded name of a per-role quantile of histogram ``metric``."""
    return f"namespace_pool_role:{metric}:p{round(q * 100)}_rate{WINDOW}"


@dataclass(frozen=True)
class PoolRules:
    """Recording rules and alerts of the pool ``pool`` in ``namespace``."""

    namespace: str
    pool: str

    def sel(self, *extra: str) -> str:
        """A label matcher set: this pool's series, plus ``extra`` matchers."""
        return "{" + ",".join([f'namespace="{self.namespace}"', f'pool="{self.pool}"', *extra]) + "}"

    def _ratio(
        self, num: str, den: str, by: str, num_extra: tuple[str, ...] = (), den_extra: tuple[str, ...] = ()
    ) -> str:
        return (
            f"sum by ({by}) (rate({num}{self.sel(*num_extra)}[{WINDOW}])) / "
            f"sum by ({by}) (rate({den}{self.sel(*den_extra)}[{WINDOW}]))"
        )

    def fallback_ratio(self) -> str:
        """KV transfers that fell back (recompute or kvstore) per request finished by decode-side engines."""
        not_prefill = ('role!="prefill"',)
        return self._ratio(
            lr.counter_sample(lr.KV_TRANSFER_FAILURES),
            lr.counter_sample(lr.REQUEST_SUCCESS),
            "namespace, pool",
            not_prefill,
            not_prefill,
        )

    def recording(self) -> list[Rule]:
        """Hit rates, TTFT / ITL p50 and p99 per role, KV usage, transfer failure rate and ratio."""
        role = "namespace, pool, role"
        rules = [
            {
                "record": f"namespace_pool_role:kvferry_prefix_cache_hit_ratio:rate{WINDOW}",
                "expr": self._ratio(
                    lr.counter_sample(lr.PREFIX_CACHE_HITS), lr.counter_sample(lr.PREFIX_CACHE_QUERIES), role
                ),
            },
            {
                "record": f"namespace_pool:kvferry_router_prefix_hit_ratio:rate{WINDOW}",
                "expr": self._ratio(
                    "kvferry_router_prefix_hit_blocks_total",
                    "kvferry_router_prompt_blocks_total",
                    "namespace, pool",
                ),
            },
        ]
        for metric in (lr.TIME_TO_FIRST_TOKEN_SECONDS, lr.INTER_TOKEN_LATENCY_SECONDS):
            for q in (0.5, 0.99):
                rules.append(
                    {
                        "record": quantile_record(metric, q),
                        "expr": f"histogram_quantile({q}, sum by ({role}, le) "
                        f"(rate({lr.bucket_sample(metric)}{self.sel()}[{WINDOW}])))",
                    }
                )
        for agg in ("avg", "max"):
            rules.append(
                {
                    "record": f"namespace_pool_role:{lr.KV_CACHE_USAGE_RATIO}:{agg}",
                    "expr": f"{agg} by ({role}) ({lr.KV_CACHE_USAGE_RATIO}{self.sel()})",
                }
            )
        failures = lr.counter_sample(lr.KV_TRANSFER_FAILURES)
        rules += [
            {
                "record": f"namespace_pool_reason:{lr.KV_TRANSFER_FAILURES}:rate{WINDOW}",
                "expr": f"sum by (namespace, pool, reason) (rate({failures}{self.sel()}[{WINDOW}]))",
            },
            {
                "record": f"namespace_pool:kvferry_kv_transfer_fallback_ratio:rate{WINDOW}",
                "expr": self.fallback_ratio(),
            },
        ]
        return rules

    def _alert(self, name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> Rule:
        return {
            "alert": name,
            "expr": expr,
            "for": for_,
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description},
        }

    def alerts(self) -> list[Rule]:
        """Engine down, KV usage high, transfer fallbacks rising, router self-check failing, Redis unreachable,
        an engine routed by load only because the index mispredicts its cache."""
        where = "pool {{ $labels.namespace }}/{{ $labels.pool }}"
        return [
            self._alert(
                "KvferryEngineDown",
                "up" + self.sel(f'role=~"{ENGINE_ROLES_RE}"') + " == 0",
                "2m",
                "critical",
                "A kvferry engine is not answering /metrics",
                f"{{{{ $labels.role }}}} engine {{{{ $labels.pod }}}} of {where} has been down for 2 minutes.",
            ),
            self._alert(
                "KvferryKVCacheNearlyFull",
                f"{lr.KV_CACHE_USAGE_RATIO}{self.sel()} > {KV_USAGE_ALERT}",
                KV_USAGE_FOR,
                "warning",
                "A kvferry engine's KV cache is over 90% full",
                f"{{{{ $labels.role }}}} engine {{{{ $labels.pod }}}} of {where} has used "
                f"{{{{ $value | humanizePercentage }}}} of its KV blocks for {KV_USAGE_FOR}: "
                "requests queue and get preempted; add replicas.",
            ),
            self._alert(
                "KvferryKVTransferFallbacksRising",
                f"({self.fallback_ratio()}) > {FALLBACK_RATIO_ALERT}",
                "10m",
                "warning",
                "kvferry KV transfers keep falling back to recompute",
                f"{{{{ $value | humanizePercentage }}}} of the requests of {where} recomputed or re-fetched "
                "their prompt because a KV transfer failed (kvferry_kv_transfer_failures_total by reason says why).",
            ),
            self._alert(
                "KvferryRouterSelfCheckFailing",
                f"kvferry_router_self_check_ok{self.sel()} == 0",
                "5m",
                "critical",
                "A kvferry router's self-check is failing",
                f"Router {{{{ $labels.pod }}}} of {where}: engines disagree on model, block size or hash "
                "version, or the prefix index does not see their blocks; its /health and log say which.",
            ),
            self._alert(
                "KvferryRedisUnreachable",
                f"kvferry_router_redis_up{self.sel()} == 0",
                "2m",
                "warning",
                "A kvferry router cannot reach the prefix index (Redis)",
                f"Router {{{{ $labels.pod }}}} of {where} has not reached Redis for 2 minutes: requests are "
                "routed by load only, without prefix reuse.",
            ),
            self._alert(
                "KvferryRoutingInaccurate",
                f"max by (namespace, pool, pod, endpoint) (kvferry_router_prefix_load_only{self.sel()}) == 1",
                "5m",
                "warning",
                "The prefix index mispredicts an engine's cache",
                f"Router {{{{ $labels.pod }}}} of {where} has routed engine {{{{ $labels.endpoint }}}} by load "
                "only for 5 minutes: the cached tokens the index predicts for it disagree with what it reports "
                "(an index that missed a cache reset or restart). kvferry_router_prefix_prediction_accuracy "
                "shows how far.",
            ),
        ]

    def groups(self) -> list[dict[str, Any]]:
        """The rule groups, as in a Prometheus rule file and a PrometheusRule's spec."""
        return [
            {"name": f"kvferry-{self.pool}.recording", "rules": self.recording()},
            {"name": f"kvferry-{self.pool}.alerts", "rules": self.alerts()},
        ]

    def rule_file(self) -> dict[str, Any]:
        """A Prometheus rule file (for ``promtool`` and a plain Prometheus)."""
        return {"groups": self.groups()}
