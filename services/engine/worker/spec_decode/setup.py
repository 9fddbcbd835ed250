"""Builds the runner's SpecDecoder from `--speculative-config`: the proposer, and a draft model's KV cache."""

from __future__ import annotations

import torch

from services.engine.core.spec_config import SpeculativeConfig
from services.engine.worker.attention import ComputeBackend
from services.engine.worker.loader.model_loader import load_eagle_head, load_model, load_model_config
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.interface import CausalLM
from services.engine.worker.quantization.quant_config import resolve_quant_config
from services.engine.worker.spec_decode.draft_batch import DraftCache
from services.engine.worker.spec_decode.draft_proposer import DraftModelProposer
from services.engine.worker.spec_decode.eagle_proposer import EagleProposer
from services.engine.worker.spec_decode.ngram_proposer import NgramProposer
from services.engine.worker.spec_decode.spec_decoder import Proposer, SpecDecoder


def draft_model_config(spec: SpeculativeConfig | None, target: ModelConfig) -> ModelConfig | None:
    """The draft checkpoint's config (None for ngram); a draft must share the target's vocabulary, an
    EAGLE head also its hidden size (it reads the target's hidden states)."""
    if spec is None or spec.method == "ngram":
        return None
    assert spec.model is not None
    cfg = load_model_config(spec.model)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size {cfg.vocab_size} differs from the "
            f"target's {target.vocab_size} (a draft must use the target's tokenizer)"
        )
    if spec.method == "eagle" and cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"speculative_config.model: the EAGLE head's hidden_size {cfg.hidden_size} differs from the "
            f"target's {target.hidden_size}"
        )
    if target.kv_window is not None:  # the draft's lazy catch-up would read and write freed blocks
        raise ValueError(
            f"speculative_config.method={spec.method!r}: the target frees KV blocks before its sliding "
            f"window ({target.kv_window}), which a draft's KV cannot follow yet; use method 'ngram'"
        )
    return cfg


def build_spec_decoder(
    spec: SpeculativeConfig,
    target: CausalLM,
    draft_cfg: ModelConfig | None,
    kv_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    backend: ComputeBackend,
    max_model_len: int,
) -> SpecDecoder:
    """``kv_shape``: the draft's KV cache shape (the target's block count and size, the draft's layers);
    ``target``: the served model (an EAGLE head uses its embedding and LM head)."""
    proposer: Proposer
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return SpecDecoder(
            spec, NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max), max_model_len
        )
    assert spec.model is not None and draft_cfg is not None
    kv = torch.zeros(kv_shape, dtype=dtype, device=device)
    cache = DraftCache(kv, k, kv_shape[3], backend, device, max_model_len)
    if spec.method == "eagle":
        proposer = EagleProposer(
            load_eagle_head(spec.model, draft_cfg, dtype, device, max_model_len), target, cache
        )
    else:
        quant = resolve_quant_config(spec.quantization, spec.model)
        kernels = "triton" if backend.name == "triton" else "cpu"
        model = load_model(spec.model, draft_cfg, dtype, device, max_model_len, quant, kernels)
        proposer = DraftModelProposer(model, cache)
    return SpecDecoder(spec, proposer, max_model_len)
