"""Tokenizer.max_text_tokens: a text refused unread must really have more tokens than the limit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.common.openai.errors import OpenAIError
from services.common.openai.tokenizer import Tokenizer


def test_the_character_bound_never_refuses_a_text_that_fits(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    longest = max(len(t) for t in tok.backend.get_vocab(with_added_tokens=True))
    rng = random.Random(0)
    words = [tok.decode([i]) for i in range(tok.vocab_size)] + ["<|im_start|>", " ", "東京", "🚀"]
    for _ in range(50):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 400)))
        assert len(tok.encode(text)) * longest >= len(text)  # each token spells at most `longest` chars
    tok.max_text_tokens = 10
    assert tok.max_text_chars() == 4 * longest * 10
    assert tok.encode("hello world")  # short texts are tokenized as before
    with pytest.raises(OpenAIError, match="refused without tokenizing"):
        tok.encode("x" * (tok.max_text_chars() + 1))
