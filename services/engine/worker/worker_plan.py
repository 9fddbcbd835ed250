"""WorkerPlan: the engine's settings resolved once (task, length, dtype, weights, compute backend, draft),
which every rank builds its Worker from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.media.mm_placeholders import media_placeholders
from services.engine.core.config import EngineConfig
from services.engine.core.encoder_cache_manager import EncoderCacheManager
from services.engine.worker.attention import select_backend
from services.engine.worker.loader.model_loader import load_model_config, resolve_dtype
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models import is_encoder_architecture
from services.engine.worker.multimodal.encoder_cache import DEFAULT_BUDGET_BYTES as ENCODER_CACHE_BYTES
from services.engine.worker.pooling import detect_task, sentence_max_seq_length
from services.engine.worker.quantization.quant_config import QuantConfig, resolve_quant_config
from services.engine.worker.spec_decode.setup import draft_model_config


def resolve_task(task: str, model: str, architecture: str) -> str:
    """'auto' -> what the checkpoint is for ('embed' for encoders and sentence-transformers folders)."""
    detected = detect_task(model, architecture)
    if task == "auto":
        return detected
    if task == "generate" and is_encoder_architecture(architecture):
        raise ValueError(f"task: {architecture} is an encoder (embeddings only); use task='embed'")
    return task


@dataclass(frozen=True)
class WorkerPlan:
    """The engine's resolved settings that every rank builds from (picklable: sent to spawned ranks)."""

    config: EngineConfig
    model_config: ModelConfig
    task: str  # "generate" | "embed"
    encoder: bool  # an encoder model: no KV cache, no logits
    max_model_len: int
    dtype: torch.dtype
    quant: QuantConfig
    backend: str  # the compute backend's name ("cpu", "torch", "triton")
    draft_config: ModelConfig | None

    @property
    def kernels(self) -> str:
        """Which quantized layers to build: "triton" with the Triton backend, else the CPU ones."""
        return "triton" if self.backend == "triton" else "cpu"

    @classmethod
    def resolve(cls, config: EngineConfig, device: torch.device, ops_backend: str) -> WorkerPlan:
        """Every 'auto' made concrete for ``device`` (ValueError naming a setting the model cannot take)."""
        cfg = load_model_config(config.model)
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        max_len = config.max_model_len or cfg.max_position_embeddings
        task = resolve_task(config.task, config.model, cfg.architecture)
        encoder = is_encoder_architecture(cfg.architecture)
        if encoder and not config.max_model_len:
            max_len = min(max_len, sentence_max_seq_length(config.model) or max_len)
        quant = resolve_quant_config(config.quantization, config.model)
        return cls(
            config=config,
            model_config=cfg,
            task=task,
            encoder=encoder,
            max_model_len=max_len,
            dtype=resolve_dtype(config.dtype, cfg, device),
            quant=quant,
            backend=_backend(config, device, ops_backend, quant),
            draft_config=_draft_config(config, cfg, task, encoder, max_len),
        )

    def encoder_budget(self, batched: int) -> tuple[int, EncoderCacheManager | None]:
        """Vision models: the encoder's feature tokens per step (vLLM's default: the step's token budget, at
        least the largest image or video) and the scheduler's view of the encoder cache (its byte budget in
        feature tokens); ValueError naming the setting when it cannot hold one image."""
        configured = self.config.max_num_encoder_input_tokens
        placeholders = media_placeholders(self.config.model) if self.model_config.vision else None
        if placeholders is None:
            return configured or batched, None
        largest = placeholders.max_item_embeds
        if configured is not None and configured < largest:
            raise ValueError(
                f"max_num_encoder_input_tokens={configured}: below the {largest} features of this model's "
                "largest image or video (the encoder must be able to run one in a step)"
            )
        budget = configured or max(batched, largest)
        per_token = self.model_config.hidden_size * self.dtype.itemsize
        return budget, EncoderCacheManager(max(ENCODER_CACHE_BYTES // per_token, budget))


def _backend(config: EngineConfig, device: torch.device, ops_backend: str, quant: QuantConfig) -> str:
    """The attention / ops backend's name, checked against the quantized kernels (ValueError where none)."""
    backend = select_backend(device, config.attention_backend or ops_backend)
    triton = backend.name == "triton"
    if quant.method == "fp8" and quant.at_load and not triton:
        raise ValueError("quantization fp8 at load is for GPUs (the Triton kernels); on CPU use int8")
    if quant.quantized and device.type != "cpu" and not triton:
        raise ValueError(f"quantization {quant.describe()} on {device.type} needs --attention-backend triton")
    return backend.name


def _draft_config(
    config: EngineConfig, cfg: ModelConfig, task: str, encoder: bool, max_len: int
) -> ModelConfig | None:
    """The draft model's config with --speculative-config's draft_model (checked against the target)."""
    spec = config.speculative_config
    if spec is not None and (task == "embed" or encoder):
        raise ValueError("speculative_config: speculative decoding is for generation models")
    draft = draft_model_config(spec, cfg)
    if draft is not None and draft.max_position_embeddings < max_len:
        raise ValueError(
            f"speculative_config.model: the draft's max_position_embeddings "
            f"{draft.max_position_embeddings} is below max_model_len={max_len}"
        )
    return draft
