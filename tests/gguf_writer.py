"""Write a tiny HF Llama checkpoint as a quantized GGUF (llama.cpp's layout), for loader tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# quant type per tensor kind: covers Q8_0, Q4_0, Q4_1, F16 and F32
QUANTS = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q4_1",
    "attn_output": "Q4_1",
    "ffn_gate": "F16",
    "ffn_up": "F16",
    "ffn_down": "Q8_0",
    "output": "Q8_0",
}
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> tuple[str, str]:
    if hf.startswith("model.layers."):
        _, _, i, *rest = hf.split(".")
        kind = _NAMES[".".join(rest[:-1])]
        return f"blk.{i}.{kind}.{rest[-1]}", kind
    kind = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        hf.rsplit(".", 1)[0]
    ]
    return f"{kind}.{hf.rsplit('.', 1)[1]}", kind


def quantize_roundtrip(name: str, w: np.ndarray, types: dict[str, str] | None = None) -> np.ndarray:
    """What a loader must get back for an HF tensor after GGUF quantization."""
    from gguf import GGMLQuantizationType, quants

    kind = _gguf_name(name)[1]
    qtype = (types or QUANTS).get(kind, "F32") if w.ndim == 2 else "F32"
    if qtype == "F32":
        return w.astype(np.float32)
    t = getattr(GGMLQuantizationType, qtype)
    return quants.dequantize(quants.quantize(w.astype(np.float32), t), t).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, quants: dict[str, str] | None = None) -> Path:
    """Convert ``hf_dir`` (a tiny Llama) to ``out`` with mixed quantization and tokenizer metadata."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _add_tokenizer(w, hf_dir)
    for name, arr in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        gname, kind = _gguf_name(name)
        if kind == "attn_q":
            arr = _permute(arr, cfg["num_attention_heads"])
        elif kind == "attn_k":
            arr = _permute(arr, cfg["num_key_value_heads"])
        qtype = (quants or QUANTS).get(kind, "F32") if arr.ndim == 2 else "F32"
        t = getattr(gguf.GGMLQuantizationType, qtype)
        data = arr.astype(np.float32) if qtype == "F32" else gguf.quants.quantize(arr.astype(np.float32), t)
        w.add_tensor(gname, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, hf_dir: Path) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])
