"""GGUF checkpoints: dequantize a single .gguf into an HF-style config, tensors and tokenizer."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def gguf_reader(path: Path) -> Any:
    """The file's GGUFReader, parsed once per version of the file: an engine start reads its config,
    its tensor types (--quantization auto) and its tensors, and parsing SmolLM2's costs ~1.8 s."""
    st = path.stat()
    return _parsed(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, mtime_ns: int, size: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


class GGUFCheckpoint:
    """A .gguf file read as an HF checkpoint: ``hf_config()``, ``tensors()``, ``tokenizer_files()``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"model: GGUF file {self.path} does not exist")
        self.reader = gguf_reader(self.path)
        self.arch = self._field("general.architecture")
        if self.arch not in _SUPPORTED_ARCHS:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {sorted(_SUPPORTED_ARCHS)}"
            )

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def hf_config(self) -> dict[str, Any]:
        a = self.arch
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        names = {t.name for t in self.reader.tensors}
        cfg = {
            "architectures": [_SUPPORTED_ARCHS[a]],
            "model_type": a,
            "vocab_size": len(self.reader.fields["tokenizer.ggml.tokens"].data),
            "hidden_size": hidden,
            "intermediate_size": self._field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._field(f"{a}.attention.head_count_kv", heads),
            "head_dim": self._field(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": self._field(f"{a}.context_length", 2048),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        factor = self._field(f"{a}.rope.scaling.factor")
        if factor and self._field(f"{a}.rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        return cfg

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """Tensors under HF names (q/k un-permuted from llama.cpp's rotary layout).

        ``keep_quantized``: quantized matrices come as GroupQuantWeight codes, not floats.
        """
        from gguf.quants import dequantize

        from services.engine.worker.quantization.gguf_blocks import FLOAT_TYPES, gguf_weight

        cfg = self.hf_config()
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            shape = [int(x) for x in reversed(t.shape)]
            n_head = heads.get(name.split(".")[-2]) if self.arch == "llama" else None
            kind = t.tensor_type.name
            if keep_quantized and kind not in FLOAT_TYPES and len(shape) == 2:
                gw = gguf_weight(kind, t.data, shape[0], shape[1])
                if n_head is not None:
                    gw = gw.select_rows(torch.from_numpy(_unpermute(np.arange(shape[0]), n_head)))
                yield name, gw
                continue
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if n_head is not None:
                arr = _unpermute(arr, n_head)
            yield (
                name,
                torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy()),
            )

    def tokenizer_files(self) -> dict[str, Any]:
        """tokenizer.json, tokenizer_config.json and generation_config.json contents."""
        from services.engine.worker.loader.gguf_tokenizer import build_tokenizer_json

        tokens = self._field("tokenizer.ggml.tokens")
        bos, eos = self._field("tokenizer.ggml.bos_token_id"), self._field("tokenizer.ggml.eos_token_id")
        tok_json = build_tokenizer_json(
            model=self._field("tokenizer.ggml.model"),
            pre=self._field("tokenizer.ggml.pre", "default"),
            tokens=tokens,
            token_types=self._field("tokenizer.ggml.token_type"),
            merges=self._field("tokenizer.ggml.merges", []),
            add_bos=bool(self._field("tokenizer.ggml.add_bos_token", False)),
            bos_id=bos,
        )
        tok_config = {
            "chat_template": self._field("tokenizer.chat_template"),
            "bos_token": tokens[bos] if bos is not None else None,
            "eos_token": tokens[eos] if eos is not None else None,
            "add_bos_token": bool(self._field("tokenizer.ggml.add_bos_token", False)),
        }
        return {
            "tokenizer.json": tok_json,
            "tokenizer_config.json": tok_config,
            "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos},
        }

    def write_hf_folder(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        """Convert into an HF checkpoint folder (config, safetensors, tokenizer files)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.to(dtype).contiguous() for name, t in self.tensors()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.hf_config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, content in self.tokenizer_files().items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2)
            (out / name).write_text(text)
        return out


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        base = _LAYER_NAMES.get(parts[2])
        return None if base is None else f"model.layers.{parts[1]}.{base}.{parts[-1]}"
    base = _TOP_NAMES.get(parts[0])
    return None if base is None else f"{base}.{parts[-1]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation (interleaved rotary pairs -> HF rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
