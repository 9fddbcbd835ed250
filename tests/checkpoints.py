"""Builders for tiny random-weight HF checkpoints and a byte-level BPE tokenizer, all offline and seeded."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "paris",
    "is",
    "the",
    "capital",
    "of",
    "france",
    "and",
    "kvferry",
    "moves",
    "blocks",
    "of",
    "cache",
    "between",
    "prefill",
    "and",
    "decode",
    "engines",
    "über",
    "naïve",
    "café",
    "東京",
    "🚀",
    "numbers",
    "0123456789",
    "code",
    "def",
    "return",
    "class",
    "import",
    "print",
    "hello",
    "world",
]


def _corpus(n: int = 3000) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(n)]


def build_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on a fixed corpus; write tokenizer files; return the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
            }
        )
    )
    return tok.get_vocab_size()


def build_checkpoint(
    out: Path,
    kind: str,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab_size: int | None = None,
) -> Path:
    """Write a random-weight checkpoint (tiny by default): kind is 'llama', 'qwen2', 'mistral', or one of
    ``FAMILY_KINDS`` (Qwen3, Phi-3 and the MoE families: 8 experts, top-2)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    vocab = max(build_tokenizer(out), vocab_size or 0)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        cfg = LlamaConfig(
            num_key_value_heads=2,
            rope_theta=10000.0,
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaForCausalLM
    elif kind == "qwen2":
        cfg = Qwen2Config(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            **common,
        )
        cls = Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
        cls = MistralForCausalLM
    else:
        cfg, cls = _family_config(kind, common)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # biases start at 0 and norms at 1: make them matter
            if name.endswith("sinks"):  # gpt-oss: sinks the size of the attention scores
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek: a router bias that changes the choice
                b.normal_(0.0, 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


FAMILY_KINDS = (
    "qwen3", "phi3", "qwen2_sw", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3", "gpt_oss", "deepseek_v3"
)  # fmt: skip


def _family_config(kind: str, common: dict) -> tuple[object, type]:
    """Configs of the families beyond Llama / Qwen2 / Mistral (MoE ones with 8 experts, top-2)."""
    import transformers as tf

    hidden = common["hidden_size"]
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=hidden)
    if kind == "qwen3":
        return tf.Qwen3Config(num_key_value_heads=2, head_dim=32, **common), tf.Qwen3ForCausalLM
    if kind == "phi3":  # every layer windowed (40 tokens, not a block multiple): blocks before it are freed
        return tf.Phi3Config(num_key_value_heads=2, sliding_window=40, **common), tf.Phi3ForCausalLM
    if kind == "qwen2_sw":  # layer 0 full, layer 1 windowed (max_window_layers): no block is freed
        cfg = tf.Qwen2Config(
            num_key_value_heads=2, use_sliding_window=True, sliding_window=24, max_window_layers=1, **common
        )
        return cfg, tf.Qwen2ForCausalLM
    if kind == "mixtral":
        cfg = tf.MixtralConfig(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, **common)
        return cfg, tf.MixtralForCausalLM
    if kind == "qwen2_moe":  # a shared expert; layer 1 stays dense
        cfg = tf.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=8,
            shared_expert_intermediate_size=3 * hidden,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **moe,
            **common,
        )
        return cfg, tf.Qwen2MoeForCausalLM
    if kind == "gemma3":  # a sliding layer (24 tokens) and a global one, each with its rotary base
        cfg = tf.Gemma3TextConfig(
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            **common,
        )  # fmt: skip
        return cfg, tf.Gemma3ForCausalLM
    if kind == "gpt_oss":  # sliding (24) / full layers, sinks, biases, YaRN, 8 experts top-2, clamped SwiGLU
        cfg = tf.GptOssConfig(
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=24,
            swiglu_limit=1.5,  # low enough that the clamps cut activations of this tiny model
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
            },
            **common,
        )  # fmt: skip
        return cfg, tf.GptOssForCausalLM
    if kind == "deepseek_v3":  # MLA (q LoRA, YaRN with both mscales), a dense layer, 2 MoE layers of 8
        cfg = tf.DeepseekV3Config(  # experts in 4 groups (2 kept), top-2, a shared expert
            **{**common, "num_hidden_layers": 3}, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                "mscale_all_dim": 0.5, "original_max_position_embeddings": 256,
            },
        )  # fmt: skip
        return cfg, tf.DeepseekV3ForCausalLM
    if kind == "deepseek_v3_plain":  # a plain q_proj, rotary pairs not interleaved, no YaRN, 2 dense layers
        cfg = tf.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3}, moe_intermediate_size=32, n_routed_experts=4,
            n_shared_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=2,
            norm_topk_prob=False, routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=24, rope_interleave=False,
        )  # fmt: skip
        return cfg, tf.DeepseekV3ForCausalLM
    if kind == "deepseek_v2":  # V2: softmax routing limited to the 2 best of 4 groups, q LoRA, 1 dense layer
        cfg = tf.DeepseekV2Config(
            **{**common, "num_hidden_layers": 3}, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            topk_method="group_limited_greedy", routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        )  # fmt: skip
        return cfg, tf.DeepseekV2ForCausalLM
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=True, **moe, **common
        )
        return cfg, tf.Qwen3MoeForCausalLM
    raise ValueError(kind)


def hf_greedy(model, prompt: list[int], n: int = 12) -> list[int]:  # noqa: ANN001 - any HF causal LM
    """HF transformers' greedy continuation of token ids (EOS ignored): the reference the engine must equal."""
    import torch

    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids)
        )
    return out[0, len(prompt) :].tolist()


def truncated_checkpoint(src: Path, out: Path, num_layers: int) -> Path:
    """A copy of the HF checkpoint ``src`` keeping its first ``num_layers`` decoder layers (embeddings,
    final norm and head kept): a draft model that shares the target's tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(str(out))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def build_eagle_head(target: Path, out: Path, seed: int = 0) -> Path:
    """A random EAGLE-1 head for the Llama-family checkpoint ``target``: its config with one layer, and
    ``fc.weight`` / ``fc.bias`` / ``layers.0.*`` tensors (HF Llama layer names), as EAGLE checkpoints hold."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if (out / "config.json").exists():
        return out
    cfg = AutoConfig.from_pretrained(str(target))
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    cfg.num_hidden_layers = 1
    torch.manual_seed(seed)
    layer = _decoder_layer_class(cfg)(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    tensors = {f"layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()}
    h = cfg.hidden_size
    tensors["fc.weight"] = torch.randn(h, 2 * h) * 0.1
    tensors["fc.bias"] = torch.randn(h) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def eagle_reference_drafts(target: Path, head: Path, token_ids: list[int], num: int) -> list[int]:
    """EAGLE-1's greedy drafts after ``token_ids`` (the last one just sampled) computed from scratch with HF transformers' modules:
    features = the target's normed last hidden states, head input p = fc([embed(x[p+1]), feature[p]]),
    one decoder layer without its input norm, the target's LM head; drafts feed back the head's features."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    cfg = AutoConfig.from_pretrained(str(head))
    cfg._attn_implementation = "eager"
    weights = load_file(str(head / "model.safetensors"))
    layer = _decoder_layer_class(cfg)(cfg, 0).eval()
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")}
    )
    layer.input_layernorm = torch.nn.Identity()
    rotary = hf.model.rotary_emb
    with torch.no_grad():
        # features of every token but the last (the last was just sampled: the target has not run it)
        feats = hf.model(torch.tensor([token_ids[:-1]])).last_hidden_state[0]
        tokens, drafts = list(token_ids), []
        for _ in range(num):
            t = len(feats)  # head positions 0 .. t-1 read (token p + 1, feature p)
            nxt = torch.tensor([tokens[1 : t + 1]])
            x = torch.cat([hf.model.embed_tokens(nxt)[0], feats], dim=-1) @ weights["fc.weight"].T
            x = x + weights["fc.bias"]
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            out = layer(
                x[None], attention_mask=mask, position_ids=pos, position_embeddings=rotary(x[None], pos)
            )
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1]
            drafts.append(int(hf.lm_head(last).argmax()))
            tokens.append(drafts[-1])
            feats = torch.cat([feats, last[None]])
    return drafts


def _decoder_layer_class(cfg: object) -> type:
    """HF's decoder layer class of a Llama-family config (Qwen2's has q/k/v biases)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return Qwen2DecoderLayer if getattr(cfg, "model_type", "") == "qwen2" else LlamaDecoderLayer


def build_llava(out: Path, seed: int = 0) -> Path:
    """A tiny random LLaVA (CLIP tower: 32 px images, 8 px patches -> 16 image tokens; feature layer -2 of
    3; a 2-layer Llama LM) with its CLIP image processor config; the image token is ``<image>``, the
    tokenizer's last id."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()  # the last id is "<image>", what the chat template is given per image
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    text = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=vocab - 1, vision_feature_layer=-2
    )
    torch.manual_seed(seed)
    model = HFLlava(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        str(out)
    )
    return out


def token_bytes(tokenizer: object, ids: list[int]) -> bytes:
    """The bytes of byte-level BPE token ids (a partial UTF-8 character stays bytes, as the grammar and the
    logprobs ``bytes`` field see it); ``tokenizer`` is a services.common Tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]  # the byte-level alphabet: shifted past 255
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    pieces = [tokenizer.id_to_token(t) or "" for t in ids]  # type: ignore[attr-defined]
    return b"".join(bytes(byte_of[c] for c in p) for p in pieces)
