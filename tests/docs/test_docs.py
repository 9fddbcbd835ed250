"""The documentation: generated pages match their sources, the site builds strictly, nothing points outside."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.docsgen.benchmark_pages import BENCHMARKS, RESULTS, VS_VLLM_PREFIX
from scripts.docsgen.pages import DOCS, generated_pages

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces so that this file does not match its own check.
OUTSIDE_REFERENCES = ("../" + "shared", "shared/" + "NOTES.md", "shared/" + "DESIGN.md")


def test_generated_pages_are_current():
    stale = [
        relative
        for relative, text in generated_pages().items()
        if not (DOCS / relative).is_file() or (DOCS / relative).read_text(encoding="utf-8") != text
    ]
    assert not stale, f"regenerate with `make docs`: {stale} differ from what their sources give"


def test_cli_reference_does_not_depend_on_the_environment(monkeypatch):
    from scripts.docsgen.cli_reference import CliReference

    plain = CliReference().render()
    monkeypatch.setenv("KVFERRY_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVFERRY_MODEL_ID", "some-pool-model")
    assert CliReference().render() == plain


def test_every_benchmark_result_is_described():
    unknown = [
        p.name
        for p in RESULTS.glob("*.json")
        if p.stem not in BENCHMARKS and not p.stem.startswith(VS_VLLM_PREFIX)
    ]
    assert not unknown, f"describe these in BENCHMARKS (scripts/docsgen/benchmark_pages.py): {unknown}"


def test_generated_references_cover_the_code():
    pages = generated_pages()
    for flag in ("--kv-lease", "--pd-threshold", "--capacity-gb", "--prometheus-targets", "--epp-port"):
        assert f"`{flag}" in pages["reference/cli.md"], flag
    for field in ("spec.engine.quantization", "spec.autoscaling.decode.target.metric", "status.phase"):
        assert f"`{field}`" in pages["reference/crd.md"], field
    for metric in (
        "kvferry_kv_transfer_failures_total",
        "kvferry_router_requests_total",
        "kvferry_kvstore_gets_total",
    ):
        assert f"`{metric}`" in pages["reference/metrics.md"], metric
    assert "`reason`: `adapter_mismatch`" in pages["reference/metrics.md"]


def test_site_builds_with_strict(tmp_path):
    mkdocs = pytest.importorskip("mkdocs")
    assert mkdocs is not None
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "crd.html").is_file()


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines; move detail into docs/"


def test_no_tracked_file_points_outside_the_repository():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    offenders = []
    for name in filter(None, files.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_bytes()[:2_000_000].decode("utf-8", errors="ignore")
        offenders += [f"{name}: {ref}" for ref in OUTSIDE_REFERENCES if ref in text]
    assert not offenders, offenders
