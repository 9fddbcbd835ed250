"""The kvferry Grafana dashboards (one source) and ``python -m pool_operator.dashboards`` that writes them.

The chart installs ``charts/kvferry/dashboards/*.json`` as ConfigMaps for the Grafana sidecar; a test
fails when those files drift from this module (``--check``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pool_operator.grafana_dashboard import POOL_SELECTOR, RATE, GrafanaDashboard, Panel, Query
from pool_operator.pool_rules import ENGINE_ROLES_RE, PoolRules

OUT_DIR = Path(__file__).resolve().parents[2] / "charts" / "kvferry" / "dashboards"


def sel(*extra: str) -> str:
    """The dashboard's pool (``$namespace``/``$pool``) plus ``extra`` matchers."""
    return "{" + ",".join([POOL_SELECTOR, *extra]) + "}"


def rate(metric: str, by: str, *extra: str) -> str:
    return f"sum by ({by}) (rate({metric}{sel(*extra)}[{RATE}]))"


def ratio(
    num: str, den: str, by: str, num_extra: tuple[str, ...] = (), den_extra: tuple[str, ...] = ()
) -> str:
    return f"{rate(num, by, *num_extra)} / {rate(den, by, *den_extra)}"


def quantiles(histogram: str, by: str, legend: str, *extra: str) -> tuple[Query, ...]:
    """p50 and p99 of a histogram (``histogram`` without ``_bucket``), per ``by``."""
    bucket = f"sum by ({by}, le) (rate({histogram}_bucket{sel(*extra)}[{RATE}]))"
    return tuple(
        Query(f"histogram_quantile({q}, {bucket})", f"{legend} p{round(q * 100)}") for q in (0.5, 0.99)
    )


ENGINES = f'role=~"{ENGINE_ROLES_RE}"'
DECODE_SIDE = 'role!="prefill"'


def pool_overview() -> GrafanaDashboard:
    d = GrafanaDashboard("kvferry-pool", "kvferry / Pool overview", "Traffic, engines and load of one pool.")
    return d.add(
        Panel(
            "Requests / s",
            (Query(rate("kvferry_router_requests_total", "pool"), "requests"),),
            "reqps",
            "stat",
            6,
        ),
        Panel("Engines up", (Query(f"sum by (role) (up{sel(ENGINES)})", "{{role}}"),), "short", "stat", 6),
        Panel(
            "Max KV cache usage",
            (Query(f"max by (role) (kvferry_kv_cache_usage_ratio{sel()})", "{{role}}"),),
            "percentunit",
            "stat",
            6,
        ),
        Panel(
            "Router self-check",
            (Query(f"min by (pool) (kvferry_router_self_check_ok{sel()})", "ok"),),
            "bool_on_off",
            "stat",
            6,
        ),
        Panel(
            "Requests / s by route",
            (Query(rate("kvferry_router_requests_total", "decision"), "{{decision}}"),),
            "reqps",
        ),
        Panel(
            "Finished requests / s by reason",
            (
                Query(
                    rate("kvferry_request_success_total", "finish_reason", DECODE_SIDE), "{{finish_reason}}"
                ),
            ),
            "reqps",
        ),
        Panel(
            "Running and waiting requests",
            (
                Query(f"sum by (role) (kvferry_num_requests_running{sel()})", "running {{role}}"),
                Query(f"sum by (role) (kvferry_num_requests_waiting{sel()})", "waiting {{role}}"),
            ),
        ),
        Panel(
            "Tokens / s",
            (
                Query(rate("kvferry_prompt_tokens_total", "role"), "prompt {{role}}"),
                Query(rate("kvferry_generation_tokens_total", "role"), "generated {{role}}"),
            ),
            "short",
        ),
    )


def latency() -> GrafanaDashboard:
    d = GrafanaDashboard(
        "kvferry-latency", "kvferry / Latency by role", "TTFT, ITL, end-to-end and queue time."
    )
    return d.add(
        Panel(
            "Time to first token", quantiles("kvferry_time_to_first_token_seconds", "role", "{{role}}"), "s"
        ),
        Panel(
            "Inter-token latency", quantiles("kvferry_inter_token_latency_seconds", "role", "{{role}}"), "s"
        ),
        Panel(
            "End-to-end latency", quantiles("kvferry_e2e_request_latency_seconds", "role", "{{role}}"), "s"
        ),
        Panel("Queue time", quantiles("kvferry_request_queue_time_seconds", "role", "{{role}}"), "s"),
        Panel(
            "Router overhead (arrival to dispatch)",
            quantiles("kvferry_router_overhead_seconds", "pool", "router"),
            "s",
            width=24,
        ),
    )


def kv_cache() -> GrafanaDashboard:
    d = GrafanaDashboard(
        "kvferry-kv-cache",
        "kvferry / KV cache and prefix hits",
        "KV block usage, prefix reuse and the kvstore tier.",
    )
    kvstore_gets = "kvferry_kvstore_gets_total"
    return d.add(
        Panel(
            "KV cache usage per engine",
            (Query(f"kvferry_kv_cache_usage_ratio{sel()}", "{{role}} {{pod}}"),),
            "percentunit",
        ),
        Panel(
            "Engine prefix-cache hit rate (tokens)",
            (
                Query(
                    ratio("kvferry_prefix_cache_hits_total", "kvferry_prefix_cache_queries_total", "role"),
                    "{{role}}",
                ),
            ),
            "percentunit",
        ),
        Panel(
            "Router prefix hit rate (index blocks)",
            (
                Query(
                    ratio(
                        "kvferry_router_prefix_hit_blocks_total", "kvferry_router_prompt_blocks_total", "pool"
                    ),
                    "router",
                ),
            ),
            "percentunit",
        ),
        Panel(
            "Preemptions / s", (Query(rate("kvferry_num_preemptions_total", "role"), "{{role}}"),), "short"
        ),
        Panel(
            "kvstore occupancy",
            (
                Query(
                    f"sum(kvferry_kvstore_bytes_used{sel()}) / sum(kvferry_kvstore_capacity_bytes{sel()})",
                    "used",
                ),
            ),
            "percentunit",
        ),
        Panel(
            "kvstore lookups / s by result",
            (
                Query(rate(kvstore_gets, "result"), "{{result}}"),
                Query(rate("kvferry_kvstore_evictions_total", "pool"), "evictions"),
            ),
            "short",
        ),
    )


def transfers() -> GrafanaDashboard:
    d = GrafanaDashboard(
        "kvferry-transfers",
        "kvferry / P/D transfers",
        "KV blocks ferried prefill -> decode and to the kvstore, and fallbacks.",
    )
    return d.add(
        Panel(
            "KV blocks moved / s",
            (
                Query(
                    rate("kvferry_kv_transfer_blocks_total", "direction, path"), "{{direction}} via {{path}}"
                ),
            ),
            "short",
        ),
        Panel(
            "Transfer failures / s by reason",
            (Query(rate("kvferry_kv_transfer_failures_total", "reason"), "{{reason}}"),),
            "short",
        ),
        Panel(
            "Fallbacks per finished request",
            (Query(PoolRules("$namespace", "$pool").fallback_ratio(), "fallback ratio"),),
            "percentunit",
            description="KV transfers that failed and were recomputed or re-fetched, per request decode finished.",
        ),
        Panel(
            "P/D routes / s",
            (
                Query(
                    rate(
                        "kvferry_router_requests_total", "decision", 'decision=~"disaggregated|decode_only"'
                    ),
                    "{{decision}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "kvstore RPC time",
            quantiles("kvferry_kvstore_rpc_duration_seconds", "method", "{{method}}"),
            "s",
            width=24,
        ),
        Panel(
            "KV tier hits (prompt tokens / s)",
            (Query(rate("kvferry_kv_tier_hit_tokens_total", "tier"), "{{tier}}"),),
            "short",
            description="Prompt tokens loaded from a KV tier (host memory, disk, kvstore) instead of recomputed.",
        ),
        Panel(
            "KV tier load time",
            quantiles("kvferry_kv_tier_load_seconds", "tier", "{{tier}}"),
            "s",
            description="A load from a tier, lookup to usable blocks (one reading any block from disk is disk).",
        ),
        Panel(
            "KV tier blocks held",
            (Query(f"sum by (tier) (kvferry_kv_tier_blocks{sel()})", "{{tier}}"),),
            "short",
            description="Blocks the engines' own tiers hold (host memory, disk), summed over the pool.",
        ),
        Panel(
            "KV bytes moved / s",
            (
                Query(
                    rate("kvferry_kv_transfer_bytes_total", "direction, path"), "{{direction}} via {{path}}"
                ),
            ),
            "Bps",
        ),
    )


def router() -> GrafanaDashboard:
    d = GrafanaDashboard(
        "kvferry-router", "kvferry / Router", "Routing decisions, overhead, index and fallbacks."
    )
    return d.add(
        Panel(
            "Redis reachable",
            (Query(f"min by (pool) (kvferry_router_redis_up{sel()})", "redis"),),
            "bool_on_off",
            "stat",
            8,
        ),
        Panel(
            "Healthy engines",
            (Query(f"min by (pool) (kvferry_router_healthy_endpoints{sel()})", "engines"),),
            "short",
            "stat",
            8,
        ),
        Panel(
            "Self-check",
            (Query(f"min by (pool) (kvferry_router_self_check_ok{sel()})", "ok"),),
            "bool_on_off",
            "stat",
            8,
        ),
        Panel(
            "Requests / s by route",
            (Query(rate("kvferry_router_requests_total", "decision"), "{{decision}}"),),
            "reqps",
        ),
        Panel("Routing overhead", quantiles("kvferry_router_overhead_seconds", "pool", "overhead"), "s"),
        Panel("Prefix-index lookup", quantiles("kvferry_router_index_lookup_seconds", "pool", "lookup"), "s"),
        Panel(
            "Fallbacks, retries, stream errors / s",
            (
                Query(rate("kvferry_router_fallbacks_total", "kind"), "fallback {{kind}}"),
                Query(rate("kvferry_router_retries_total", "pool"), "retries"),
                Query(rate("kvferry_router_stream_errors_total", "pool"), "stream errors"),
            ),
            "short",
        ),
    )


def all_dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON of every kvferry dashboard."""
    return {
        f"{d.uid}.json": d.to_json() for d in (pool_overview(), latency(), kv_cache(), transfers(), router())
    }


def dump(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pool_operator.dashboards", description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder of the JSON files")
    parser.add_argument("--check", action="store_true", help="fail when the files differ from this module")
    args = parser.parse_args(argv)
    wanted = {name: dump(d) for name, d in all_dashboards().items()}
    present = {p.name for p in args.out.glob("*.json")} if args.out.is_dir() else set()
    if args.check:
        stale = sorted(
            n for n in wanted if not (args.out / n).is_file() or (args.out / n).read_text() != wanted[n]
        )
        stale += sorted(present - set(wanted))
        if stale:
            print(
                f"dashboards out of date: {', '.join(stale)}; run python -m pool_operator.dashboards",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in present - set(wanted):
        (args.out / name).unlink()
    for name, text in wanted.items():
        (args.out / name).write_text(text)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
