"""PNG of a benchmark run's latency distributions (TTFT, ITL, E2E), drawn with matplotlib's Agg."""

from __future__ import annotations

from pathlib import Path

from services.bench.client import LoadRun


def plot_latencies(run: LoadRun, path: str | Path, title: str = "kvferry bench serve") -> Path:
    """Write histograms of TTFT, ITL and end-to-end latency (ms) of the successful requests."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    ok = [r for r in run.results if r.success]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in ok if r.output_len > 0],
        "ITL (ms)": [gap * 1000 for r in ok for gap in r.itl],
        "E2E latency (ms)": [r.latency * 1000 for r in ok],
    }
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4))
    for ax, (label, values) in zip(axes, series.items(), strict=True):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        ax.set_title(f"{label.split(' (')[0]} (n={len(values)})")
    fig.suptitle(f"{title}: {len(ok)} ok, {len(run.results) - len(ok)} failed")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
