"""What tensor and pipeline parallelism support yet: everything else is refused at start-up, naming it."""

from __future__ import annotations

import torch

from services.engine.core.config import EngineConfig
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models import get_model_class, is_encoder_architecture
from services.engine.worker.models.capabilities import ModelCapabilities
from services.engine.worker.parallel.pp_stage import layer_split
from services.engine.worker.parallel.tp_group import check_divisible
from services.engine.worker.quantization.quant_config import QuantConfig


def check_tensor_parallel(config: EngineConfig, cfg: ModelConfig, quant: QuantConfig, generate: bool) -> None:
    """ValueError naming the first setting that tensor_parallel_size / pipeline_parallel_size > 1
    cannot serve (yet)."""
    tp, pp, spec = config.tensor_parallel_size, config.pipeline_parallel_size, config.speculative_config
    refused = {  # setting -> (refused, the limit that refuses it)
        "task embed with an encoder model": (
            not generate and is_encoder_architecture(cfg.architecture),
            "encoder classes are not sharded",
        ),
        "quantization with act-order (desc_act) weights": (
            quant.desc_act and tp > 1,
            "their codes are stored in a permuted column order, so no rank's input columns are contiguous",
        ),
        "enable_lora": (config.enable_lora and pp > 1, "adapter slots wrap every layer, a stage holds some"),
        "speculative_config": (spec is not None and pp > 1, "drafts are verified on the last stage only"),
        "kvstore_url": (config.kvstore_url is not None and pp > 1, "a stage holds some layers of a block"),
        "kv_offload_cpu_bytes": (
            config.kv_offload_cpu_bytes > 0,
            "the host tier copies one rank's whole KV blocks",
        ),
        "device xpu": (config.device.startswith("xpu"), "no collective backend for XPU here"),
    }
    for name, (bad, reason) in refused.items():
        if bad:
            raise ValueError(f"{unsupported(config, name)}: {reason}")
    if tp > 1:
        check_divisible(cfg, tp)
    if pp > 1:
        layer_split(cfg.num_hidden_layers, pp)
    caps = ModelCapabilities.of(get_model_class(cfg.architecture))
    for name, size, declared in (
        ("tensor_parallel_size", tp, caps.tp_plan is not None),
        ("pipeline_parallel_size", pp, caps.pipeline),
    ):
        if size > 1 and not declared:
            what = "no tp_plan" if name.startswith("tensor") else "no `pp` stage argument"
            raise ValueError(f"{name}={size}: the model class of {cfg.architecture} declares {what}")
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
    return f"{setting(config)}: {what} is not supported with {kinds} yet"
