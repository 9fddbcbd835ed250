"""EngineConfig: every engine setting, validated once (CLI flags and the offline LLM map onto it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from services.engine.core.spec_config import Quantization, SpeculativeConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """Settings of one engine instance."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    served_model_name: str | None = None
    dtype: Dtype = "auto"
    quantization: Quantization = "auto"  # auto: what the checkpoint holds (GGUF blocks, GPTQ, AWQ)
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    # vision-language models: image / video feature tokens the encoder computes in one step (None: the
    # larger of max_num_batched_tokens and the largest single image or video)
    max_num_encoder_input_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    device: str = "auto"
    # GPUs: the fraction of the device's memory this engine may fill (weights, activations, KV cache);
    # sizes the KV cache from what is free after loading. CPU engines size it with kv_cache_memory_gb.
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1, le=64)  # ranks, one process each (gloo on CPU, NCCL)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)  # stages of layers, ranks = tensor x pipeline
    seed: int = 0
    # "dummy": random weights (std 0.02, norms 1) instead of the checkpoint's tensors: only config.json and
    # the tokenizer are read (benchmarks and the GPU check of a model shape without its weights, as vLLM's)
    load_format: Literal["auto", "dummy"] = "auto"
    # CUDA: decode steps replay captured CUDA graphs unless this is set (always eager on other devices)
    enforce_eager: bool = False
    attention_backend: Literal["cpu", "torch", "triton"] | None = None
    task: Literal["auto", "generate", "embed"] = (
        "auto"  # auto: embed for encoder / sentence-transformers models
    )
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1)  # adapters one step can run (device slots)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1)  # loaded adapters kept on CPU (default: max_loras)
    lora_modules: dict[str, str] = Field(default_factory=dict)  # adapter name -> PEFT folder, at start
    speculative_config: SpeculativeConfig | None = None  # draft tokens verified in one target pass
    kvstore_url: str | None = None  # grpc://host:port of the shared kvstore tier
    kv_offload_cpu_bytes: int = Field(0, ge=0)  # this engine's host-memory KV tier (0: none)
    kv_offload_disk_path: str | None = None  # a local-disk tier behind the host tier: its folder
    kv_offload_disk_bytes: int = Field(0, ge=0)  # ... and its budget
    kv_offload_policy: Literal["lru", "arc"] = "lru"  # which block the host tier evicts (eviction_policy.py)
    use_nixl: bool = True  # False: KV moves between engines through the kvstore only
    # The pool's side-channel token (--pool-secret-file): required on this engine's /kv/ routes, sent to
    # prefill's and to the kvstore. None: side channels are open, as without the flag.
    pool_secret: SecretStr | None = None

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        p = Path(v)
        if not p.exists():
            raise ValueError(f"model path {v!r} does not exist (an HF checkpoint folder or a .gguf file)")
        if p.is_file() and p.suffix != ".gguf":
            raise ValueError(f"model file {v!r} is not a .gguf file")
        return v

    @model_validator(mode="after")
    def _disk_tier_behind_host_tier(self) -> EngineConfig:
        disk = (self.kv_offload_disk_path is not None, self.kv_offload_disk_bytes > 0)
        if any(disk) and not all(disk):
            raise ValueError("kv_offload_disk_path and kv_offload_disk_bytes: set both for a disk KV tier")
        if all(disk) and not self.kv_offload_cpu_bytes:
            raise ValueError(
                "kv_offload_disk_path: the disk tier holds what the host tier evicts; set kv_offload_cpu_bytes"
            )
        if self.kv_offload_policy != "lru" and not self.kv_offload_cpu_bytes:
            raise ValueError("kv_offload_policy: the host tier's eviction policy; set kv_offload_cpu_bytes")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name.removesuffix(".gguf")
