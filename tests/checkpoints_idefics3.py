"""A tiny random-weight Idefics3 / SmolVLM checkpoint with its HF processor files, built offline and seeded."""

from __future__ import annotations

import json
from pathlib import Path

from tests.checkpoints import build_tokenizer

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", "<video>"]
ROW_COL_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
VIDEO_SAMPLING = {"fps": 2, "max_frames": 6, "video_size": {"longest_edge": 32}}


TINY = {
    "vision": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "image_size": 32, "patch_size": 4,
    },
    "text": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "longest_edge": 96,
}  # fmt: skip


def build_idefics3(out: Path, kind: str = "idefics3", seed: int = 0, shape: dict | None = None) -> Path:
    """SigLIP tower on 32 px tiles of 4 px patches (64 patches; pixel shuffle 2 -> 16 tokens per tile), images
    resized to a 96 px longest edge (up to 3x3 tiles + the global image), a 2-layer Llama LM (``shape``: other
    sizes, as ``TINY``). kind: 'idefics3' or 'smolvlm' (the latter with SmolVLM's video settings: 2 fps, at
    most 6 frames)."""
    import torch
    from tokenizers import AddedToken, Tokenizer

    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS + ROW_COL_TOKENS]
    )
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    shape = shape or TINY
    model, cfg = _model(kind, vocab, tok.token_to_id("<image>"), shape)
    torch.manual_seed(seed)
    model = model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    _processor(out, kind, shape)
    return out


def _model(kind: str, vocab: int, image_token: int, shape: dict) -> tuple[type, object]:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        LlamaConfig,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    vision = shape["vision"]
    text = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **shape["text"],
    )  # fmt: skip
    if kind == "smolvlm":
        return SmolVLMForConditionalGeneration, SmolVLMConfig(
            vision_config=vision, text_config=text.to_dict(), image_token_id=image_token, scale_factor=2
        )
    return Idefics3ForConditionalGeneration, Idefics3Config(
        vision_config=vision, text_config=text.to_dict(), image_token_id=image_token, scale_factor=2
    )


def _processor(out: Path, kind: str, shape: dict) -> None:
    """HF's own processor files (the reference our preprocessing reads), saved through HF's classes."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tile, patch = shape["vision"]["image_size"], shape["vision"]["patch_size"]
    images = {"size": {"longest_edge": shape["longest_edge"]}, "max_image_size": {"longest_edge": tile}}
    Idefics3ImageProcessorPil(**images).save_pretrained(str(out))
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["image_processor_type"] = (
        "SmolVLMImageProcessor" if kind == "smolvlm" else "Idefics3ImageProcessor"
    )
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    processor = {
        "image_seq_len": (tile // patch) ** 2 // 4,  # scale factor 2
        "processor_class": "SmolVLMProcessor" if kind == "smolvlm" else "Idefics3Processor",
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    if kind == "smolvlm":
        video = {**config, "video_processor_type": "SmolVLMVideoProcessor", "video_sampling": VIDEO_SAMPLING}
        video.pop("image_processor_type")
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert tok.convert_tokens_to_ids("<image>") is not None
