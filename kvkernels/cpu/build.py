"""Build (or find) the C++ CPU kernel extension for this machine's ISA: `python -m kvkernels.cpu.build`."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "argmax.cpp",
    "bindings.cpp",
    "bitmask.cpp",
    "quant_linear.cpp",
    "quant_gemv.cpp",
    "gemv_bf16.cpp",
    "attention.cpp",
    "attention_decode.cpp",
    "attention_plan.cpp",
    "decode_amx.cpp",
    "decode_bf16.cpp",
    "decode_generic.cpp",
    "attention_prefill.cpp",
    "cache.cpp",
    "norm.cpp",
    "pointwise.cpp",
    "lora.cpp",
)
# CPU flags that change what -march=native emits or which at::vec implementation we pick.
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512cd",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx512vbmi",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
)
BASE_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
# KVFERRY_CPU_CAPABILITY=AVX2|DEFAULT builds a lesser ISA than the CPU's, for portable binaries or to
# test those code paths; each pins a baseline -march instead of -march=native.
FORCED_MARCH = {"AVX512": "native", "AVX2": "x86-64-v3", "DEFAULT": "x86-64-v2"}


@dataclass(frozen=True)
class BuildSpec:
    """What to compile, for which ISA, and where the binary lives."""

    capability: str  # at::vec implementation: AVX512, AVX2 or DEFAULT
    march: str  # what the compiler resolves -march=native to
    flags: tuple[str, ...]  # the ISA_FLAGS this CPU has
    cflags: tuple[str, ...]
    name: str  # extension module name (unique per sources + ISA + torch)
    directory: Path


def kvferry_home() -> Path:
    """$KVFERRY_HOME, default ~/.cache/kvferry."""
    return Path(os.environ.get("KVFERRY_HOME") or Path.home() / ".cache" / "kvferry")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def vec_capability(flags: set[str]) -> str:
    """The at::vec::Vectorized implementation this CPU can run (torch's own AVX512 needs F/BW/VL/DQ)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "DEFAULT"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "AVX512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "AVX2"
    return "DEFAULT"


def compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension will use ($CXX, else c++), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def ensure_ninja_on_path() -> bool:
    """torch's JIT build runs `ninja` from PATH: also accept the venv's (PyPI `ninja` wheel) when the venv
    is not activated, by putting its bin folder on PATH. True when ninja can be run."""
    if shutil.which("ninja"):
        return True
    for folder in (Path(sys.executable).parent, Path(sys.prefix) / "bin"):
        if (folder / "ninja").is_file():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return True
    return False


def native_march(cxx: str) -> str:
    """The -march the compiler picks for this CPU (e.g. sapphirerapids, znver4), or 'native'."""
    try:
        out = subprocess.run(
            [cxx, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "native"
    match = re.search(r"^\s*-march=\s*(\S+)", out, re.MULTILINE)
    return match.group(1) if match else "native"


def _source_digest() -> hashlib._Hash:
    digest = hashlib.sha256()
    for src in sorted(CSRC.glob("*")):
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    return digest


def build_spec() -> BuildSpec:
    """Flags, module name and build directory; the name hashes sources, flags, ISA, compiler and torch."""
    import torch

    cxx = compiler() or "c++"
    flags = cpu_flags()
    capability = vec_capability(flags)
    forced = os.environ.get("KVFERRY_CPU_CAPABILITY", "").upper()
    if forced:
        if forced not in FORCED_MARCH:
            raise ValueError(f"KVFERRY_CPU_CAPABILITY={forced!r}: use one of {sorted(FORCED_MARCH)}")
        capability = forced
    march_flag = FORCED_MARCH[capability] if forced else "native"
    march = native_march(cxx) if march_flag == "native" else march_flag
    have = tuple(f for f in ISA_FLAGS if f in flags)
    cflags = (
        *BASE_CFLAGS,
        f"-march={march_flag}",
        f"-DCPU_CAPABILITY={capability}",
        f"-DCPU_CAPABILITY_{capability}",
    )
    digest = _source_digest()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest.update("\0".join((*cflags, march, *have, version, torch.__version__)).encode())
    src_hash = digest.hexdigest()[:12]
    isa = (
        f"{capability.lower()}-{re.sub(r'[^A-Za-z0-9_.-]', '_', march)}-"
        + hashlib.sha256(" ".join(have).encode()).hexdigest()[:6]
    )
    torch_tag = re.sub(r"[^A-Za-z0-9_.]", "_", torch.__version__)
    directory = kvferry_home() / "torch_extensions" / f"kvferry_cpu-{isa}-{src_hash}-torch{torch_tag}"
    return BuildSpec(capability, march, have, cflags, f"kvferry_cpu_{src_hash}", directory)


@dataclass(frozen=True)
class LoadResult:
    """The loaded module, or why there is none; `cached` when no compiler ran."""

    module: ModuleType | None
    reason: str | None
    spec: BuildSpec | None
    cached: bool


def _prune_old_builds(spec: BuildSpec, keep: int = 3) -> None:
    """Delete all but the newest `keep` builds of other sources for this ISA and torch (edits pile up)."""
    isa, _, rest = spec.directory.name.rpartition("-torch")
    prefix = isa.rsplit("-", 1)[0]
    siblings = [p for p in spec.directory.parent.glob(f"{prefix}-*-torch{rest}") if p != spec.directory]
    for old in sorted(siblings, key=lambda p: p.stat().st_mtime, reverse=True)[keep - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _built_binary(spec: BuildSpec) -> Path | None:
    path = spec.directory / f"{spec.name}.so"
    return path if path.is_file() else None


def _import_binary(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an importable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def load_extension() -> LoadResult:
    """Compile on first use (a cache hit when this ISA/source/torch build exists); never raises."""
    prebuilt = os.environ.get("KVFERRY_CPU_KERNELS")
    if prebuilt:  # an image's kernels, one per ISA: no compiler runs, whatever the outcome
        from kvkernels.cpu.prebuilt import load_prebuilt

        return load_prebuilt(Path(prebuilt))
    try:
        import torch  # noqa: F401 - the extension links against the loaded libtorch
        from torch.utils import cpp_extension
    except Exception as exc:  # noqa: BLE001 - any import failure means "no extension"
        return LoadResult(None, f"torch is not importable: {exc}", None, False)
    try:
        spec = build_spec()
    except Exception as exc:  # noqa: BLE001
        return LoadResult(None, f"could not inspect the build machine: {exc}", None, False)
    binary = _built_binary(spec)
    if binary is not None:  # same sources, flags, ISA and torch: import it without ninja or a compiler
        try:
            return LoadResult(_import_binary(spec.name, binary), None, spec, True)
        except Exception:  # noqa: BLE001 - a stale or broken file: let the JIT build replace it
            pass
    if compiler() is None:
        return LoadResult(None, "no C++ compiler (c++/g++) on PATH", spec, False)
    if not ensure_ninja_on_path() or not cpp_extension.is_ninja_available():
        return LoadResult(
            None, "ninja is not installed (torch's JIT build needs it: pip install ninja)", spec, False
        )
    try:
        spec.directory.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=spec.name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(spec.cflags),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(spec.directory),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - compiler errors arrive as RuntimeError/OSError/...
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error:" in ln][:3] or lines[-3:]
        return LoadResult(None, "build failed: " + " | ".join(errors)[:800], spec, False)
    if module.fp32_lanes != (16 if spec.capability == "AVX512" else 8):
        return LoadResult(None, f"built {module.capability} but expected {spec.capability}", spec, False)
    _prune_old_builds(spec)
    return LoadResult(module, None, spec, False)


def main(argv: list[str] | None = None) -> int:
    """Build or find the extension and print one line; exit 0 even when it cannot be built.

    ``--prebuild DIR VARIANT...``: compile portable ISA variants (kvkernels/cpu/variants.py) into DIR for an
    image instead; a failed build exits non-zero there."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--prebuild"]:
        work = Path(args[3]) if args[2:3] == ["--work"] and len(args) > 3 else None
        names = args[4:] if work is not None else args[2:]
        if not names:
            print(
                "usage: python -m kvkernels.cpu.build --prebuild DIR [--work DIR] VARIANT...", file=sys.stderr
            )
            return 2
        from kvkernels.cpu.prebuilt import prebuild

        try:
            lines = prebuild(Path(args[1]), names, work)
        except ValueError as exc:
            print(f"kvferry cpu kernels: {exc}", file=sys.stderr)
            return 2
        print("\n".join(f"kvferry cpu kernels: prebuilt {line}" for line in lines))
        return 0
    result = load_extension()
    if result.module is None:
        print(f"kvferry cpu kernels: not built ({result.reason}); the engine uses plain torch")
        return 0
    spec = result.spec
    if spec is None:  # a module always comes with the spec it was built from
        raise RuntimeError("kvferry cpu kernels: loaded without a build spec")
    what = "found cached" if result.cached else "built"
    print(
        f"kvferry cpu kernels: {what} {spec.name} ({spec.capability}, -march={spec.march}) in {spec.directory}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
