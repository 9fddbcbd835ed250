"""EngineSpec: the settings every engine of an InferencePool shares (flags of `kvferry serve`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pool_operator.crd_model import CelRule, CrdModel, FreeForm, Quantity


class SpeculativeSpec(CrdModel):
    """Speculative decoding on decode (and aggregated) engines: the engine's --speculative-config."""

    CEL_RULES = (
        CelRule(
            "self.method == 'ngram' || has(self.model)",
            "methods draft_model and eagle need model (the draft checkpoint or EAGLE head)",
            lambda s: s.method == "ngram" or s.model is not None,
        ),
        CelRule(
            "self.method != 'ngram' || !has(self.model)",
            "method ngram takes no model",
            lambda s: s.method != "ngram" or s.model is None,
        ),
    )

    method: Literal["ngram", "draft_model", "eagle"] = Field(
        description="ngram: prompt lookup (no model); draft_model: a smaller checkpoint with the same "
        "tokenizer; eagle: an EAGLE head for the served model"
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="drafts verified per step")
    model: str | None = Field(
        None, description="the draft checkpoint or EAGLE head: a path inside the model source, or absolute"
    )
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest suffix looked up")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest suffix looked up")


class KVOffloadSpec(CrdModel):
    """Each engine's own KV tiers behind its primary pool: host memory, and local disk behind that."""

    CEL_RULES = (
        CelRule(
            "!has(self.disk) || has(self.hostMemory)",
            "kvOffload.disk holds what the host tier evicts: set kvOffload.hostMemory too",
            lambda s: s.disk is None or s.host_memory is not None,
        ),
        CelRule(
            "!has(self.policy) || has(self.hostMemory)",
            "kvOffload.policy is the host tier's eviction policy: set kvOffload.hostMemory too",
            lambda s: s.policy is None or s.host_memory is not None,
        ),
    )

    host_memory: Quantity | None = Field(
        None,
        description="host memory for the engine's second KV tier (--kv-offload-cpu-bytes; count it in the "
        "role's memory requests)",
    )
    disk: Quantity | None = Field(
        None,
        description="local disk (an emptyDir of this size) for a third tier (--kv-offload-disk-bytes)",
    )
    policy: Literal["LRU", "ARC"] | None = Field(
        None,
        description="which block the host tier evicts (--kv-offload-policy; default LRU): ARC keeps prefixes "
        "used again over a scan of one-off prompts",
    )


class EnvVar(CrdModel):
    """A container environment variable (value or valueFrom, as in core/v1)."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: FreeForm | None = None


class EngineSpec(CrdModel):
    """Settings every engine of the pool shares."""

    CEL_RULES = (
        CelRule(
            "self.maxNumBatchedTokens >= self.maxNumSeqs",
            "maxNumBatchedTokens must be >= maxNumSeqs",
            lambda s: s.max_num_batched_tokens >= s.max_num_seqs,
        ),
        CelRule(
            "self.blockSize == oldSelf.blockSize",
            "blockSize is immutable: cached KV blocks and their hashes depend on it",
        ),
        CelRule(
            "self.pipelineParallelSize == 1 || !has(self.speculative)",
            "pipelineParallelSize > 1 does not run speculative decoding yet",
            lambda s: s.pipeline_parallel_size == 1 or s.speculative is None,
        ),
        CelRule(
            "!has(self.kvOffload) || (self.tensorParallelSize == 1 && self.pipelineParallelSize == 1)",
            "kvOffload does not run with tensor or pipeline parallelism yet (the tier copies one rank's blocks)",
            lambda s: s.kv_offload is None or s.ranks == 1,
        ),
        CelRule(
            "!self.enableAutoToolChoice || has(self.toolCallParser)",
            "enableAutoToolChoice needs toolCallParser",
            lambda s: not s.enable_auto_tool_choice or s.tool_call_parser is not None,
        ),
    )

    image: str | None = Field(None, description="default: the operator's own engine image")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: Literal["auto", "none", "int8", "int4", "gguf", "gptq", "awq", "fp8"] = Field(
        "auto",
        description="weights in memory: auto = the checkpoint's (GGUF blocks, GPTQ, AWQ, FP8); none = "
        "dequantized to dtype; int8 / int4 = quantized at load; fp8 = quantized at load (GPU engines)",
    )
    block_size: int = Field(16, ge=1, le=256)
    max_model_len: int = Field(4096, ge=16)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where engines run (--device): cuda needs nvidia.com/gpu in the roles' resources, as do "
        "tensor/pipeline parallel, gpuMemoryUtilization and fp8 engines unless device is cpu",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="GPU engines: the fraction of device memory for weights and KV cache (engine default 0.9)",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=16,
        description="tensor-parallel ranks per engine (one process each; the pod's nvidia.com/gpu, when "
        "its resources name GPUs, is set to tensorParallelSize x pipelineParallelSize)",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        le=16,
        description="pipeline stages per engine: the decoder layers split into this many contiguous runs, "
        "each on its own ranks (no more stages than the model has layers)",
    )
    prefix_caching: bool = True
    drain_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description="on scale-down or rollout: how long an engine finishes its requests (--drain-timeout); a "
        "decode hands the streams the router can move to another decode with their KV at once, then waits up "
        "to this long again for that KV to be read; the pod's terminationGracePeriodSeconds is 2x this + 60",
    )
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: completions and chat; embed: /v1/embeddings (an embedding model)"
    )
    enable_auto_tool_choice: bool = Field(
        False, description="let the model decide to call tools (needs toolCallParser)"
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None, description="how tool calls are read from the model's text (engines and routers)"
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="<think> text goes to reasoning_content (engines and routers)"
    )
    speculative: SpeculativeSpec | None = Field(
        None, description="speculative decoding (decode and aggregated engines; prefill engines do not draft)"
    )
    kv_offload: KVOffloadSpec | None = Field(
        None, description="each engine's host-memory (and local-disk) KV tiers: evicted prefixes come back"
    )
    extra_args: list[str] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)

    @property
    def ranks(self) -> int:
        """Processes (and GPUs, on GPU pods) per engine: tensor-parallel ranks x pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
