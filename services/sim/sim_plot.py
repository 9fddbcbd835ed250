"""Plots of simulation reports: engines over time and TTFT percentiles (matplotlib, the bench extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.sim.sim_report import SimReport


def plot_reports(reports: Sequence[SimReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (engines, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for r in reports:
        times = [t for t, _ in r.engines_over_time] + [r.virtual_s]
        counts = [sum(c.values()) for _, c in r.engines_over_time]
        engines.step(times, counts + counts[-1:], where="post", label=r.name)
        qs = sorted(r.ttft_s)
        ttft.plot(qs, [r.ttft_s[q] for q in qs], marker="o", label=r.name)
    engines.set(xlabel="virtual time (s)", ylabel="engines", title="engines over time")
    ttft.set(xlabel="percentile", ylabel="TTFT (s)", title="time to first token")
    engines.legend()
    ttft.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
