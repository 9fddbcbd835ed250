"""Load a model from an HF folder (safetensors, sharded or not) or a .gguf file."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn
from tqdm import tqdm

from services.engine.platforms.detect import cpu_has_native_bf16
from services.engine.worker.linear import pack_linears
from services.engine.worker.loader.safetensors_slices import SafetensorsSlices
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models import get_model_class, is_encoder_architecture
from services.engine.worker.models.capabilities import ModelCapabilities, TPPlan
from services.engine.worker.models.eagle import EagleHead
from services.engine.worker.models.interface import CausalLM, EmbeddingModel
from services.engine.worker.parallel.pp_stage import PPStage
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.parallel.tp_shard import TPShard
from services.engine.worker.quantization.quant_config import QuantConfig, detect
from services.engine.worker.quantization.quant_plan import QuantPlan, SliceReading, dense_stream

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' means the checkpoint's dtype on GPU; on CPU bfloat16 where the CPU computes it natively
    (AVX512-BF16 or AMX), else float32 (emulated bf16 and fp16 matmuls are slow there)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _DTYPES.get(cfg.torch_dtype or "", torch.bfloat16)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {folder} has no *.safetensors weights")
    return files


def iter_safetensors(
    folder: Path, wanted: Callable[[str], bool] | None = None, shard: TPShard | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files (``wanted``: only those it accepts are read;
    ``shard``: only a tensor-parallel rank's slice of each is read, by plain reads: SafetensorsSlices)."""
    from safetensors import safe_open

    for path in _safetensors_files(folder):
        if shard is not None:
            with SafetensorsSlices(path) as sliced:
                for name in sliced.keys():  # noqa: SIM118 - as safe_open's
                    if wanted is None or wanted(name):
                        yield name, shard(name, sliced.get_slice(name))
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if wanted is None or wanted(name):
                    yield name, f.get_tensor(name)


def load_model_config(path: str | Path) -> ModelConfig:
    p = Path(path)
    if p.suffix == ".gguf":
        from services.engine.worker.loader.gguf import GGUFCheckpoint

        return ModelConfig.from_hf_dict(GGUFCheckpoint(p).hf_config())
    return ModelConfig.from_folder(p)


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quant: QuantConfig | None = None,
    kernels: str = "cpu",
    tp: TPGroup | None = None,
    pp: PPStage | None = None,
    dummy: bool = False,
) -> CausalLM:
    """Instantiate the registered class for ``cfg.architecture`` and fill it with the checkpoint
    (``tp``: only this tensor-parallel rank's slices, read tensor by tensor; ``pp``: only this pipeline
    stage's layers, the others' tensors are not read)."""
    if is_encoder_architecture(cfg.architecture):
        raise ValueError(
            f"{cfg.architecture} is an encoder (embedding-only) model: load it with load_embedding_model"
        )
    return cast(
        CausalLM,
        _build_and_load(
            path,
            cfg,
            dtype,
            device,
            max_positions,
            quant or QuantConfig(),
            kernels,
            tp=tp,
            pp=pp,
            dummy=dummy,
        ),
    )


def load_embedding_model(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quant: QuantConfig | None = None,
    kernels: str = "cpu",
    tp: TPGroup | None = None,
    dummy: bool = False,
) -> EmbeddingModel:
    """Like ``load_model`` for a model that serves embeddings: an encoder, or a decoder to pool (``tp``:
    a decoder's tensor-parallel shard)."""
    return cast(
        EmbeddingModel,
        _build_and_load(
            path, cfg, dtype, device, max_positions, quant or QuantConfig(), kernels, tp=tp, dummy=dummy
        ),
    )


def load_eagle_head(
    path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> EagleHead:
    """An EAGLE draft head (its checkpoint's ``architectures`` names the target family, not the head)."""
    if cfg.architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        raise ValueError(
            f"speculative_config.model: EAGLE heads are for Llama-family models, not {cfg.architecture}"
        )
    return cast(
        EagleHead, _build_and_load(path, cfg, dtype, device, max_positions, QuantConfig(), "cpu", EagleHead)
    )


def _build_and_load(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quant: QuantConfig,
    kernels: str,
    cls: type[nn.Module] | None = None,
    tp: TPGroup | None = None,
    pp: PPStage | None = None,
    dummy: bool = False,
) -> nn.Module:
    """``kernels``: which quantized layers to build, "cpu" (torch's packed CPU ops) or "triton";
    ``dummy``: random weights, no checkpoint tensor is read."""
    if dummy and quant.quantized:
        raise ValueError("load_format='dummy' builds float weights: it cannot be combined with quantization")
    cls = cls or get_model_class(cfg.architecture)
    shards = {name: group for name, group in (("tp", tp), ("pp", pp)) if group is not None}
    with torch.device("meta"):
        model = cls(cfg, max_positions, dtype, **shards)
    p = Path(path)
    shard = TPShard(cfg, tp, _tp_plan(cls)) if tp is not None else None
    slices = (  # a float checkpoint quantized at load: the rank may read its slices only
        SliceReading(_tp_plan(cls).row, tp.all_reduce_max)
        if tp is not None and not dummy and p.suffix != ".gguf" and detect(p).method == "none"
        else None
    )
    # before any float weight exists
    plan = QuantPlan(model, quant, dtype, kernels, shard, slices) if quant.quantized else None
    model = model.to_empty(device=device).to(dtype)
    build_rope_cache = getattr(model, "build_rope_cache", None)
    if build_rope_cache is not None:  # rotary models: the table is not a checkpoint tensor
        model.cos_sin_cache = build_rope_cache(dtype).to(device)
    wanted = pp.reads if pp is not None else None
    total = sum(1 for _ in model.parameters())
    if dummy:
        random_weights(model)
    else:
        if plan is None:
            tensors = dense_checkpoint_tensors(p, wanted, shard)
        elif plan.reads_slices:
            tensors = plan.filter(iter_safetensors(p, wanted, shard))
        else:
            tensors = plan.filter(checkpoint_tensors(p, wanted))
        bar = tqdm(tensors, desc=f"loading {p.name}", unit="tensor", leave=False, disable=None, total=None)
        cast(EmbeddingModel, model).load_weights(bar)
    quantized = plan.finish(model) if plan else "none"
    model.to(device).eval()
    linears = pack_linears(model, dtype, device)
    log.info(
        "loaded %s (%d parameter tensors, %s, quantized layers: %s) on %s; float matmuls: %s",
        p.name,
        total,
        dtype,
        quantized,
        device,
        linears,
    )
    return model


def _tp_plan(cls: type[nn.Module]) -> TPPlan:
    plan = ModelCapabilities.of(cls).tp_plan
    if plan is None:
        raise ValueError(f"tensor parallelism: the model class {cls.__name__} declares no tp_plan")
    return plan


def random_weights(model: nn.Module) -> None:
    """load_format='dummy': every parameter random on its own device (std 0.02; norm weights 1, biases 0)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():  # packed codes (gpt-oss's MXFP4 experts): zeros
                param.zero_()
            elif name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02)


def checkpoint_tensors(
    path: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors under HF names: floats, or GroupQuantWeight for packed / block layers
    (``wanted``: only the names it accepts; a plain safetensors folder does not even read the others)."""
    if path.suffix == ".gguf":
        from services.engine.worker.loader.gguf import GGUFCheckpoint

        stream: Iterator[tuple[str, object]] = GGUFCheckpoint(path).tensors(keep_quantized=True)
    else:
        source = detect(path)
        if source.method in ("gptq", "awq"):
            from services.engine.worker.quantization.gptq_awq import iter_packed

            stream = iter_packed(iter_safetensors(path), source)
        elif source.method == "fp8":
            from services.engine.worker.quantization.fp8 import iter_fp8

            stream = iter_fp8(iter_safetensors(path))
        else:
            return iter(iter_safetensors(path, wanted))
    return stream if wanted is None else ((n, t) for n, t in stream if wanted(n))


def dense_checkpoint_tensors(
    path: Path, wanted: Callable[[str], bool] | None = None, shard: TPShard | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as floats (``shard``: a tensor-parallel rank's slices; a plain safetensors
    folder reads only those bytes, other formats are dequantized whole, then sliced)."""
    if shard is not None and path.suffix != ".gguf" and detect(path).method == "none":
        return iter_safetensors(path, wanted, shard)
    stream = dense_stream(checkpoint_tensors(path, wanted))
    return stream if shard is None else ((n, shard(n, t)) for n, t in stream)


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights (quantized layers count their packed bytes)."""
    total = 0
    for mod in model.modules():
        counter = getattr(mod, "weight_bytes", None)
        if counter is not None:
            total += counter()
            continue
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            total += t.numel() * t.element_size()
    return total
