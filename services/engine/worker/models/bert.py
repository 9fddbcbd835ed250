"""BertModel: the BERT encoder (post-LN, GELU, bidirectional attention within each sequence, no KV cache)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# HF per-layer module -> (our module, q/k/v shard of the fused qkv_proj)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "attention.self.query": ("qkv_proj", 0),
    "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("intermediate", None),
    "output.dense": ("output", None),
    "output.LayerNorm": ("out_norm", None),
}
_IGNORED_PREFIXES = ("pooler.", "cls.")  # the NSP pooler and the MLM head are not the encoder


@dataclass(frozen=True)
class SequenceLayout:
    """Where each sequence's tokens sit in a padded [B, L] view of the flattened [T] batch (built without
    a device sync, once per step for all layers)."""

    gather: torch.Tensor  # [B, L] int64: token row of each padded slot (0 where padding)
    unpad: torch.Tensor  # [T] int64: padded slot (b * L + j) of each token row
    mask: torch.Tensor | None  # [B, 1, 1, L] bool key mask; None when every sequence has length L

    @classmethod
    def from_lengths(cls, lens: list[int], device: torch.device) -> SequenceLayout:
        width, total = max(lens), sum(lens)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(width, device=device)
        valid = cols[None, :] < lens_t[:, None]
        gather = torch.where(valid, starts[:, None] + cols[None, :], 0)
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t, output_size=total)
        unpad = seq * width + torch.arange(total, device=device) - starts[seq]
        mask = None if min(lens) == width else valid[:, None, None, :]
        return cls(gather, unpad, mask)


class BertLayer(nn.Module):
    """Self-attention + output LayerNorm, then the GELU MLP + output LayerNorm (HF BertLayer, post-LN)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.d = cfg.num_attention_heads, cfg.head_dim
        inner = self.h * self.d
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * inner)
        self.attn_out = nn.Linear(inner, cfg.hidden_size)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.out_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.scale = self.d**-0.5

    def attention(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, 3, self.h, self.d)[layout.gather]  # [B, L, 3, H, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(-1, self.h, self.d)[layout.unpad]  # [T, H, D]
        return self.attn_out(out.reshape(t, self.h * self.d))

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        h = self.attn_norm(x + self.attention(x, layout))
        return self.out_norm(h + self.output(self.act(self.intermediate(h))))


class BertModel(nn.Module):
    """The BERT encoder; ``forward`` returns the last hidden states [T, hidden] (what poolers read)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.position_embedding_type != "absolute":
            raise ValueError(
                f"{cfg.architecture}: position_embedding_type {cfg.position_embedding_type!r} "
                "is not supported (only 'absolute')"
            )
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"{cfg.architecture}: hidden_act {cfg.hidden_act!r} is not supported "
                f"(supported: {', '.join(sorted(_ACTIVATIONS))})"
            )
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(
                f"{cfg.architecture}: max_model_len {max_positions} exceeds the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        self.cfg = cfg
        self.max_positions = max_positions
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = (
            nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size else None
        )
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
    ) -> torch.Tensor:
        """Each scheduled sequence must be whole in this step (no KV cache: ``kv_cache`` is ignored)."""
        if meta.q_lens_host != meta.seq_lens_host:
            raise ValueError(
                f"{self.cfg.architecture} is an encoder: every sequence must be computed whole in one "
                "step (turn chunked prefill and prefix caching off for it)"
            )
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:  # every token is segment 0
            x = x + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x + self.position_embeddings(positions))
        layout = SequenceLayout.from_lengths(meta.q_lens_host, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (``bert.`` prefix allowed; pooler/MLM head ignored); every one must come."""
        params = dict(self.named_parameters())
        expected = _hf_names(self.cfg)
        loaded: set[str] = set()
        for name, tensor in weights:
            hf = _normalize_name(name)
            if hf is None:
                continue
            if hf not in expected:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
            target, shard = expected[hf]
            _copy_shard(params[target], tensor, shard, hf)
            loaded.add(hf)
        missing = [n for n in expected if n not in loaded]
        if missing:
            raise ValueError(
                f"{self.cfg.architecture} checkpoint is missing tensors for: {', '.join(missing[:8])}"
                + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            )


def _normalize_name(name: str) -> str | None:
    """The HF BertModel name of a checkpoint tensor, or None for tensors the encoder does not use."""
    name = name.removeprefix("bert.")
    if name.startswith(_IGNORED_PREFIXES) or name.endswith("position_ids"):
        return None
    if name.endswith(".gamma"):  # TF-era LayerNorm names
        return name.removesuffix(".gamma") + ".weight"
    if name.endswith(".beta"):
        return name.removesuffix(".beta") + ".bias"
    return name


def _hf_names(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """Every HF tensor name the encoder needs -> (our parameter, qkv shard)."""
    embeds = ["word_embeddings", "position_embeddings"] + (
        ["token_type_embeddings"] if cfg.type_vocab_size else []
    )
    names: dict[str, tuple[str, int | None]] = {
        f"embeddings.{e}.weight": (f"{e}.weight", None) for e in embeds
    }
    for kind in ("weight", "bias"):
        names[f"embeddings.LayerNorm.{kind}"] = (f"embed_norm.{kind}", None)
    for i in range(cfg.num_hidden_layers):
        for hf, (ours, shard) in _LAYER_MAP.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{kind}"] = (f"layers.{i}.{ours}.{kind}", shard)
    return names


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, name: str) -> None:
    dst = param.data
    if shard is not None:
        rows = dst.shape[0] // 3
        dst = dst[shard * rows : (shard + 1) * rows]
    if dst.shape != tensor.shape:
        raise ValueError(
            f"weight shape mismatch for {name}: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
        )
    dst.copy_(tensor.to(dst.dtype))
