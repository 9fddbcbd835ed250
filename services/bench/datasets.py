"""Synthetic benchmark prompts (random and shared-prefix), deterministic for a given seed.

Prompts are token ids of exact length (sent as token-id prompts to ``/v1/completions``) plus a
text rendering for ``/v1/chat/completions``. With a tokenizer, ids are drawn from its non-special
vocabulary and the text is their decoding; without one, ids are drawn from ``[0, vocab_size)`` and
the text is a sequence of common words (one per id, so roughly the same length).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Used only to render id prompts as text for the chat endpoint when no tokenizer is given.
_WORD_TEXT = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were all her she there would their we him been has when who will no more if out "
    "so up said what its about than into them can only other time new some could these two may "
    "first then do any like my now over such our man me even most made after also did many before "
    "must through back years where much your way well down should because each just those people"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: exact token ids, their text rendering, and the output length to ask for;
    ``group`` names the shared prefix (its first ``prefix_len`` ids) or the agentic session it belongs to."""

    prompt_ids: tuple[int, ...]
    prompt_text: str
    output_len: int
    group: str | None = None
    prefix_len: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class TokenSpace:
    """Where random prompt ids come from and how they are rendered as text."""

    ids: Sequence[int]
    decode: Callable[[list[int]], str]


def plain_token_space(vocab_size: int) -> TokenSpace:
    """Ids in ``[0, vocab_size)``, rendered as words (no tokenizer needed)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return TokenSpace(range(vocab_size), lambda ids: " ".join(_WORDS[i % len(_WORDS)] for i in ids))


def tokenizer_token_space(path: str | Path) -> TokenSpace:
    """Non-special ids of a HF ``tokenizer.json`` (a file or a model folder holding one)."""
    from tokenizers import Tokenizer

    path = Path(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    ids = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    if not ids:
        raise ValueError(f"tokenizer {path} has no non-special tokens")
    return TokenSpace(ids, lambda ids_: tokenizer.decode(ids_, skip_special_tokens=True))


def _draw(rng: random.Random, space: TokenSpace, n: int) -> tuple[int, ...]:
    return tuple(space.ids[rng.randrange(len(space.ids))] for _ in range(n))


def synthetic_dataset(
    space: TokenSpace,
    num_prompts: int,
    input_len: int,
    output_len: int,
    prefix_len: int = 0,
    num_prefixes: int = 1,
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_prompts`` prompts of exactly ``prefix_len + input_len`` tokens.

    Each prompt is one of ``num_prefixes`` shared prefixes (assigned round-robin, then the order is
    shuffled) followed by ``input_len`` random tokens of its own.
    """
    if min(num_prompts, output_len, num_prefixes) < 1:
        raise ValueError("num_prompts, output_len and num_prefixes must be >= 1")
    if min(input_len, prefix_len) < 0 or input_len + prefix_len < 1:
        raise ValueError("input_len and prefix_len must be >= 0 and the prompt at least one token")
    rng = random.Random(seed)
    prefixes = [_draw(rng, space, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + _draw(rng, space, input_len)
        group = f"prefix-{seed}-{i % num_prefixes}" if prefix_len else None
        requests.append(BenchRequest(ids, space.decode(list(ids)), output_len, group, prefix_len))
    rng.shuffle(requests)
    return requests


def random_dataset(
    space: TokenSpace, num_prompts: int, input_len: int, output_len: int, prefix_len: int = 0, seed: int = 0
) -> list[BenchRequest]:
    """vLLM's ``random`` dataset: random prompts, optionally behind one common ``prefix_len`` prefix."""
    return synthetic_dataset(space, num_prompts, input_len, output_len, prefix_len, 1, seed)


def shared_prefix_dataset(
    space: TokenSpace,
    num_prompts: int,
    input_len: int,
    output_len: int,
    prefix_len: int,
    num_prefixes: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts in ``num_prefixes`` groups sharing a ``prefix_len``-token prefix (prefix-cache load)."""
    return synthetic_dataset(space, num_prompts, input_len, output_len, prefix_len, num_prefixes, seed)
