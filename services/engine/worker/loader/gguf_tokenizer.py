"""Rebuild a `tokenizers` tokenizer.json from GGUF tokenizer metadata (byte-level BPE)."""

from __future__ import annotations

from typing import Any

_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "qwen2", "llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def build_tokenizer_json(
    model: str,
    pre: str,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    add_bos: bool,
    bos_id: int | None,
) -> str:
    """A tokenizer.json string for a GGUF 'gpt2'-model (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE

    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2 byte-level BPE)")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(token_types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()
