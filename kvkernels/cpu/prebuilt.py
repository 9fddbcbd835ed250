"""Prebuilt kernels: compile every ISA variant at image build time; at start-up load the best this CPU runs.

`python -m kvkernels.cpu.build --prebuild DIR VARIANT...` writes DIR/<variant>/<module>.so; an engine with
KVFERRY_CPU_KERNELS=DIR imports the fastest variant its CPU supports and never runs a compiler. The
module name hashes the sources, the variant's flags and torch's version, so a binary built from other
sources is never loaded.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from kvkernels.cpu import variants
from kvkernels.cpu.build import (
    BASE_CFLAGS,
    CSRC,
    SOURCES,
    BuildSpec,
    LoadResult,
    _import_binary,
    _source_digest,
    cpu_flags,
)
from kvkernels.cpu.variants import CpuVariant

ENV = "KVFERRY_CPU_KERNELS"


def variant_spec(variant: CpuVariant, root: Path) -> BuildSpec:
    """Where and how ``variant`` is built under ``root`` (no compiler or CPU inspection involved)."""
    import torch

    cflags = (
        *BASE_CFLAGS,
        *variant.march,
        f"-DCPU_CAPABILITY={variant.capability}",
        f"-DCPU_CAPABILITY_{variant.capability}",
    )
    digest = _source_digest()
    digest.update("\0".join((*cflags, torch.__version__)).encode())
    name = f"kvferry_cpu_{digest.hexdigest()[:12]}"
    march = re.sub(r"^-march=", "", variant.march[0])
    flags = tuple(sorted(variant.requires))
    return BuildSpec(variant.capability, march, flags, cflags, name, root / variant.name)


def load_prebuilt(root: Path) -> LoadResult:
    """The best variant under ``root`` this CPU runs, imported; else a LoadResult saying why not."""
    present = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    variant = variants.best(cpu_flags(), present)
    if variant is None:
        why = f"{ENV}={root}: no prebuilt variant for this CPU (present: {', '.join(present) or 'none'})"
        return LoadResult(None, why, None, False)
    try:
        spec = variant_spec(variant, root)
    except Exception as exc:  # noqa: BLE001 - torch missing or broken: no kernels, never a crash
        return LoadResult(None, f"torch is not importable: {exc}", None, False)
    binary = spec.directory / f"{spec.name}.so"
    if not binary.is_file():
        why = f"{ENV}={root}: {binary.name} missing in {spec.directory} (built from other sources?)"
        return LoadResult(None, why, spec, False)
    try:
        module = _import_binary(spec.name, binary)
    except Exception as exc:  # noqa: BLE001 - a broken file reads as "not available", never a crash
        return LoadResult(None, f"{ENV}: cannot import {binary}: {exc}", spec, False)
    return LoadResult(module, None, spec, True)


def prebuild(root: Path, names: list[str], work: Path | None = None) -> list[str]:
    """Compile the named variants into ``root``; one line per variant (a failed build raises).

    ``work``: where ninja builds (kept between image builds, so only changed sources recompile); the
    binary is copied to ``root``. Variants this CPU runs are imported and checked; the others are only
    compiled (importing an AVX-512 binary on an AVX2 build machine could fault in its initializers)."""
    from kvkernels.cpu.build import ensure_ninja_on_path

    ensure_ninja_on_path()
    lines = []
    flags = cpu_flags()
    for variant in variants.by_name(names):
        spec = variant_spec(variant, root)
        build_dir = (work or root) / variant.name
        _compile(spec, build_dir)
        binary = spec.directory / f"{spec.name}.so"
        spec.directory.mkdir(parents=True, exist_ok=True)
        if build_dir != spec.directory:
            shutil.copy2(build_dir / binary.name, binary)
        else:
            for leftover in build_dir.iterdir():
                if leftover.is_file() and leftover.suffix != ".so":
                    leftover.unlink()
        checked = "not run on this CPU"
        if variant.runs_on(flags):
            lanes = _import_binary(spec.name, binary).fp32_lanes
            if lanes != (16 if variant.capability == "AVX512" else 8):
                raise RuntimeError(f"{variant.name}: built {lanes} fp32 lanes for {variant.capability}")
            checked = "imported"
        lines.append(f"{variant.name}: {binary} ({os.path.getsize(binary) // 1024} KiB, {checked})")
    return lines


def _compile(spec: BuildSpec, build_dir: Path) -> None:
    """ninja-build ``spec`` in ``build_dir`` without importing it (torch's JIT build minus the load)."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension._write_ninja_file_and_build_library(
        name=spec.name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(spec.cflags),
        extra_cuda_cflags=None,
        extra_sycl_cflags=None,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
    )
