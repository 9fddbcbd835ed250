"""Embedding pooling: a checkpoint's pooling config, and pooling of a flattened batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from services.engine.worker.models import is_encoder_architecture

PoolingMode = Literal["mean", "cls", "last"]
Task = Literal["generate", "embed"]

# sentence-transformers Pooling modes -> ours (max, weightedmean, mean_sqrt_len_tokens are not served)
_ST_MODES: dict[str, PoolingMode] = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_ST_MODULES = {"Transformer", "Pooling", "Normalize"}  # the sentence-transformers modules we reproduce


class PoolingConfig(BaseModel):
    """How per-token hidden states become one embedding per sequence."""

    model_config = ConfigDict(frozen=True)

    mode: PoolingMode
    normalize: bool = True


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _st_modules(model_dir: Path) -> list[dict[str, Any]] | None:
    """The sentence-transformers modules.json entries, or None for a plain HF folder."""
    modules = _read_json(model_dir / "modules.json")
    if modules is None:
        return None
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ValueError(
                f"{model_dir}: sentence-transformers module {m.get('type')!r} is not supported "
                f"(supported: {', '.join(sorted(_ST_MODULES))})"
            )
        m["kind"] = kind
    return list(modules)


def _st_pooling_mode(pool_cfg: dict[str, Any], where: Path) -> PoolingMode:
    """Our mode from a sentence-transformers Pooling config (v3+ ``pooling_mode`` or legacy bool keys)."""
    mode = pool_cfg.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _ST_LEGACY_KEYS.items() if pool_cfg.get(key)]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(
            f"{where}: pooling mode {mode!r} is not supported (supported: {', '.join(_ST_MODES)})"
        )
    return _ST_MODES[mode]


def default_pooling(architecture: str) -> PoolingConfig:
    """Without a sentence-transformers config: CLS for encoders (as vLLM), last token for decoders."""
    return PoolingConfig(mode="cls" if is_encoder_architecture(architecture) else "last", normalize=True)


def pooling_config_for(model_dir: str | Path, architecture: str) -> PoolingConfig:
    """The pooling a checkpoint folder declares (sentence-transformers modules), else the default."""
    folder = Path(model_dir)
    modules = _st_modules(folder) if folder.is_dir() else None
    if modules is None:
        return default_pooling(architecture)
    pooling = next((m for m in modules if m["kind"] == "Pooling"), None)
    if pooling is None:
        mode = default_pooling(architecture).mode
    else:
        cfg_path = folder / pooling.get("path", "") / "config.json"
        pool_cfg = _read_json(cfg_path)
        if pool_cfg is None:
            raise ValueError(f"{folder}: the Pooling module has no {cfg_path}")
        mode = _st_pooling_mode(pool_cfg, cfg_path)
    return PoolingConfig(mode=mode, normalize=any(m["kind"] == "Normalize" for m in modules))


def detect_task(model_dir: str | Path, architecture: str) -> Task:
    """'embed' for encoders and sentence-transformers folders, else 'generate'."""
    folder = Path(model_dir)
    if is_encoder_architecture(architecture) or (folder.is_dir() and (folder / "modules.json").is_file()):
        return "embed"
    return "generate"


def supported_dimensions(model_dir: str | Path) -> set[int] | None:
    """Matryoshka output sizes the model declares (config.json or config_sentence_transformers.json
    ``matryoshka_dimensions``; ``is_matryoshka: true`` allows every size up to hidden_size); None if none."""
    folder = Path(model_dir)
    hf = _read_json(folder / "config.json") or {}
    st = _read_json(folder / "config_sentence_transformers.json") or {}
    for cfg in (hf, st):
        dims = cfg.get("matryoshka_dimensions")
        if dims:
            return {int(d) for d in dims}
    if hf.get("is_matryoshka") or st.get("is_matryoshka"):
        return set(range(1, int(hf["hidden_size"]) + 1))
    return None


def sentence_max_seq_length(model_dir: str | Path) -> int | None:
    """sentence-transformers' ``max_seq_length`` (inputs it truncates to), or None."""
    cfg = _read_json(Path(model_dir) / "sentence_bert_config.json") or {}
    value = cfg.get("max_seq_length")
    return None if value is None else int(value)


def pool(
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    config: PoolingConfig,
    dimensions: int | None = None,
) -> torch.Tensor:
    """fp32 embeddings [B, d] of the sequences [start_b, start_{b+1}) of hidden [T, H] (whole sequences,
    no padding); ``dimensions`` truncates (Matryoshka) before the optional L2 normalization."""
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    if config.mode == "cls":
        out = hidden.index_select(0, starts).float()
    elif config.mode == "last":
        out = hidden.index_select(0, ends - 1).float()
    else:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        seq = torch.bucketize(rows, ends, right=True)  # rows past the last sequence land in row B
        sums = hidden.new_zeros((starts.shape[0] + 1, hidden.shape[1]), dtype=torch.float32)
        sums.index_add_(0, seq, hidden.float())
        out = sums[:-1] / (ends - starts).clamp(min=1).unsqueeze(1).float()
    if dimensions is not None:
        if not 0 < dimensions <= out.shape[1]:
            raise ValueError(f"dimensions must be in 1..{out.shape[1]}, got {dimensions}")
        out = out[:, :dimensions]
    return F.normalize(out, p=2.0, dim=-1) if config.normalize else out
