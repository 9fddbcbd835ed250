"""The GPU check's Python environment: what it needs beyond the GPU image's torch and triton, carried as
cp312 manylinux wheels in .whl/ (`make gpu-wheels` downloads them here) and installed there only when an
import fails. `python -m benchmarks.gpu_check_env download` fills .whl/ with this venv's versions.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

# what the engine, the server and the openai client import that a CUDA image with torch, triton,
# transformers, tokenizers, safetensors, numpy, pillow, jinja2, httpx and prometheus-client may lack
MODULES = ("pydantic", "fastapi", "uvicorn", "openai", "xgrammar", "gguf", "redis")
WHEELS = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
    "fastapi", "starlette", "annotated-doc", "opentelemetry-api", "uvicorn", "h11", "click",
    "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio", "anyio", "idna",
    "xgrammar", "apache-tvm-ffi", "gguf", "redis",
)  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")  # fmt: skip
SITE = "build/gpu-site"


def missing_modules() -> list[str]:
    out = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an import that fails in any way is a missing package here
            out.append(name)
    return out


def ensure_packages(root: Path) -> list[str]:
    """Install .whl/*.whl into build/gpu-site (first on sys.path) when an import fails; the names installed."""
    missing = missing_modules()
    wheels = sorted((root / ".whl").glob("*.whl"))
    if not missing or not wheels:
        if missing:
            print(f"[gpu-check] missing {missing} and no wheels in .whl/ (run `make gpu-wheels`)", flush=True)
        return []
    site = root / SITE
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]  # fmt: skip
    subprocess.run(cmd, check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    importlib.invalidate_caches()
    return [w.name for w in wheels]


def subprocess_env() -> dict[str, str]:
    """The environment for the parts' subprocesses: the repository (and any installed wheels) importable."""
    root = Path(__file__).resolve().parents[1]
    paths = [os.environ.get("PYTHONPATH", ""), str(root), str(root / "operator")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


def download(root: Path) -> None:
    """Fill .whl/ with cp312 manylinux wheels of WHEELS at this venv's versions (pure wheels where none)."""
    dest = root / ".whl"
    dest.mkdir(exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *plats, "-d", str(dest), *pins]  # fmt: skip
    subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}")


if __name__ == "__main__":
    if sys.argv[1:] == ["download"]:
        download(Path(__file__).resolve().parents[1])
    else:
        sys.exit("usage: python -m benchmarks.gpu_check_env download")
