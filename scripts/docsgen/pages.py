"""GeneratedPages: every generated page of the site, by its path under docs/."""

from __future__ import annotations

from pathlib import Path

from scripts.docsgen.benchmark_pages import BenchmarkPages
from scripts.docsgen.cli_reference import CliReference
from scripts.docsgen.crd_reference import CrdReference
from scripts.docsgen.metrics_reference import MetricsReference

DOCS = Path(__file__).resolve().parents[2] / "docs"


def generated_pages() -> dict[str, str]:
    """Relative path under docs/ -> page text."""
    benchmarks = BenchmarkPages()
    return {
        "reference/cli.md": CliReference().render(),
        "reference/crd.md": CrdReference().render(),
        "reference/metrics.md": MetricsReference().render(),
        "benchmarks/vs-vllm.md": benchmarks.vs_vllm(),
        "benchmarks/results.md": benchmarks.results_page(),
    }


def write_pages(docs: Path = DOCS) -> list[Path]:
    """Write every generated page under ``docs``; return the paths written."""
    written = []
    for relative, text in generated_pages().items():
        path = docs / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
