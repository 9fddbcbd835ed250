"""Prebuilt CPU kernel variants: which ISA build a CPU gets, and a missing or foreign build never compiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvkernels.cpu import variants
from kvkernels.cpu.build import load_extension, main
from kvkernels.cpu.prebuilt import load_prebuilt, variant_spec

V3 = {
    "cx16",
    "lahf_lm",
    "popcnt",
    "sse4_1",
    "sse4_2",
    "ssse3",
    "avx",
    "avx2",
    "bmi1",
    "bmi2",
    "f16c",
    "fma",
    "abm",
    "movbe",
    "xsave",
}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ALL = [v.name for v in variants.VARIANTS]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "x86-64-v4-amx"),  # Sapphire Rapids
        (V4 | {"avx512_bf16"}, "x86-64-v4-bf16"),  # Zen 4
        (V4, "x86-64-v4"),  # Skylake-SP
        (V3, "x86-64-v3"),
        (V3 - {"avx2"}, "x86-64-v2"),
    ],
)
def test_best_variant_is_the_fastest_the_cpu_runs(flags: set[str], expected: str) -> None:
    best = variants.best(flags, ALL)
    assert best is not None and best.name == expected


def test_only_built_variants_are_chosen_and_none_when_nothing_fits() -> None:
    assert variants.best(V4 | {"avx512_bf16"}, ["x86-64-v3", "x86-64-v2"]).name == "x86-64-v3"
    assert variants.best({"sse2"}, ALL) is None


def test_unknown_variant_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown CPU kernel variant"):
        variants.by_name(["x86-64-v9"])
    assert main(["--prebuild", "/tmp/unused", "x86-64-v9"]) == 2
    assert "choose from x86-64-v4-amx" in capsys.readouterr().err


def test_an_image_without_a_fitting_build_falls_back_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "x86-64-v3").mkdir()
    (tmp_path / "x86-64-v2").mkdir()
    (tmp_path / "x86-64-v2" / "kvferry_cpu_000000000000.so").write_bytes(b"other sources")
    monkeypatch.setattr("kvkernels.cpu.prebuilt.cpu_flags", lambda: V3)
    result = load_prebuilt(tmp_path)
    assert result.module is None and "missing" in result.reason
    assert result.spec is not None and result.spec.directory == tmp_path / "x86-64-v3"
    monkeypatch.setattr("kvkernels.cpu.prebuilt.cpu_flags", lambda: {"sse2"})
    assert "no prebuilt variant for this CPU" in load_prebuilt(tmp_path).reason
    monkeypatch.setenv("KVFERRY_CPU_KERNELS", str(tmp_path))
    load_extension.cache_clear()
    try:
        assert load_extension().module is None  # the JIT build is not tried
    finally:
        load_extension.cache_clear()


def test_variant_builds_are_named_by_sources_flags_and_torch() -> None:
    v4, v3 = variants.by_name(["x86-64-v3", "x86-64-v4"])  # VARIANTS order: best first
    a, b = variant_spec(v3, Path("/k")), variant_spec(v4, Path("/k"))
    assert a.name != b.name and a.directory == Path("/k/x86-64-v3")
    assert "-march=x86-64-v3" in a.cflags and "-DCPU_CAPABILITY=AVX2" in a.cflags
    assert variant_spec(v3, Path("/other")).name == a.name  # the place does not change the binary
