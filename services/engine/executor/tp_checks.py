"""What tensor and pipeline parallelism support yet: everything else is refused at start-up, naming it."""

from __future__ import annotations

import inspect

import torch

from services.engine.core.config import EngineConfig
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models import get_model_class
from services.engine.worker.parallel.pp_stage import layer_split
from services.engine.worker.parallel.tp_group import check_divisible
from services.engine.worker.quantization.quant_config import QuantConfig


def check_tensor_parallel(config: EngineConfig, cfg: ModelConfig, quant: QuantConfig, generate: bool) -> None:
    """ValueError naming the first setting that tensor_parallel_size / pipeline_parallel_size > 1
    cannot serve (yet)."""
    tp, pp, spec = config.tensor_parallel_size, config.pipeline_parallel_size, config.speculative_config
    refused = {
        "task": not generate,  # encoders / embeddings
        "quantization": quant.quantized,
        "enable_lora": config.enable_lora,
        # EAGLE's head reads the target's embedding and LM head, vocab-parallel shards under TP; n-gram and
        # draft-model speculation run on rank 0 (the draft unsharded) and every rank verifies alike
        "speculative_config method eagle": spec is not None and spec.method == "eagle" and tp > 1,
        "speculative_config": spec is not None and pp > 1,
        "kvstore_url": config.kvstore_url is not None,
        "device xpu": config.device.startswith("xpu"),
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(unsupported(config, name))
    if tp > 1:
        check_divisible(cfg, tp)
    if pp > 1:
        layer_split(cfg.num_hidden_layers, pp)
    params = inspect.signature(get_model_class(cfg.architecture).__init__).parameters
    for name, size, arg in (("tensor_parallel_size", tp, "tp"), ("pipeline_parallel_size", pp, "pp")):
        if size > 1 and arg not in params:
            raise ValueError(f"{name}={size}: the model class of {cfg.architecture} takes no `{arg}` shard")
    if config.device.startswith("cuda") and torch.cuda.device_count() < tp * pp:
        raise ValueError(
            f"{setting(config)} needs {tp * pp} CUDA devices; {torch.cuda.device_count()} are visible"
        )


def setting(config: EngineConfig) -> str:
    """The parallel sizes in force, as the user named them."""
    parts = [
        f"{name}={size}"
        for name, size in (
            ("tensor_parallel_size", config.tensor_parallel_size),
            ("pipeline_parallel_size", config.pipeline_parallel_size),
        )
        if size > 1
    ]
    return " with ".join(parts) or "tensor_parallel_size=1"


def unsupported(config: EngineConfig, what: str) -> str:
    kinds = " and ".join(
        kind
        for kind, size in (
            ("tensor parallelism", config.tensor_parallel_size),
            ("pipeline parallelism", config.pipeline_parallel_size),
        )
        if size > 1
    )
    return (
        f"{setting(config)}: {what} is not supported with {kinds} yet (it serves generation of float "
        "checkpoints, aggregated)"
    )
