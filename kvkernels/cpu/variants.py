"""CpuVariant: the portable ISA builds of the C++ kernels an image ships, and which one a CPU can run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# /proc/cpuinfo flags of the x86-64 micro-architecture levels (psABI; "abm" is LZCNT there).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class CpuVariant:
    """One prebuilt ISA: its at::vec capability, compiler flags and the CPU flags it needs."""

    name: str
    capability: str  # AVX512, AVX2 or DEFAULT (torch's at::vec implementation)
    march: tuple[str, ...]  # -march and -m flags instead of -march=native
    requires: frozenset[str]

    def runs_on(self, flags: set[str]) -> bool:
        return self.requires <= flags


# Best first: the AMX decode kernel, then the AVX512-BF16 kernels (Zen 4, Cooper Lake), plain AVX-512,
# AVX2 and the x86-64-v2 baseline every x86-64 server since 2009 runs.
VARIANTS = (
    CpuVariant(
        "x86-64-v4-amx",
        "AVX512",
        ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
        _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    ),
    CpuVariant("x86-64-v4-bf16", "AVX512", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
    CpuVariant("x86-64-v4", "AVX512", ("-march=x86-64-v4",), _V4),
    CpuVariant("x86-64-v3", "AVX2", ("-march=x86-64-v3",), _V3),
    CpuVariant("x86-64-v2", "DEFAULT", ("-march=x86-64-v2",), _V2),
)


def by_name(names: Iterable[str]) -> list[CpuVariant]:
    """The variants named (in VARIANTS order); an unknown name raises ValueError naming the choices."""
    wanted = set(names)
    unknown = wanted - {v.name for v in VARIANTS}
    if unknown:
        choices = ", ".join(v.name for v in VARIANTS)
        raise ValueError(f"unknown CPU kernel variant(s) {', '.join(sorted(unknown))}; choose from {choices}")
    return [v for v in VARIANTS if v.name in wanted]


def best(flags: set[str], available: Iterable[str]) -> CpuVariant | None:
    """The fastest of the ``available`` variants this CPU's ``flags`` run, or None."""
    have = set(available)
    return next((v for v in VARIANTS if v.name in have and v.runs_on(flags)), None)
