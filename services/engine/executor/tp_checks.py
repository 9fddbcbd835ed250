"""What tensor parallelism supports yet: everything else is refused at start-up, naming the setting."""

from __future__ import annotations

import inspect

import torch

from services.engine.core.config import EngineConfig
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models import get_model_class
from services.engine.worker.parallel.tp_group import check_divisible


def check_tensor_parallel(config: EngineConfig, cfg: ModelConfig, quantized: bool, generate: bool) -> None:
    """ValueError naming the first setting that tensor_parallel_size > 1 cannot serve (yet)."""
    size = config.tensor_parallel_size
    refused = {
        "task": not generate,  # encoders / embeddings
        "quantization": quantized,
        "enable_lora": config.enable_lora,
        "speculative_config": config.speculative_config is not None,
        "kvstore_url": config.kvstore_url is not None,
        "device xpu": config.device.startswith("xpu"),
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(unsupported(size, name))
    check_divisible(cfg, size)
    cls = get_model_class(cfg.architecture)
    if "tp" not in inspect.signature(cls.__init__).parameters:
        raise ValueError(
            f"tensor_parallel_size={size}: the model class of {cfg.architecture} takes no `tp` shard"
        )
    if config.device.startswith("cuda") and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} CUDA devices; {torch.cuda.device_count()} are visible"
        )


def unsupported(size: int, what: str) -> str:
    return (
        f"tensor_parallel_size={size}: {what} is not supported with tensor parallelism yet (it serves "
        "generation of float checkpoints, aggregated)"
    )
