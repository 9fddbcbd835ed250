"""Benchmark datasets: deterministic by seed, exact prompt lengths, shared prefixes, tokenizer ids."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from services.bench.datasets import (
    plain_token_space,
    random_dataset,
    shared_prefix_dataset,
    synthetic_dataset,
    tokenizer_token_space,
)


def test_random_dataset_is_deterministic_by_seed() -> None:
    space = plain_token_space(100)
    first = random_dataset(space, 20, 12, 5, seed=7)
    assert first == random_dataset(space, 20, 12, 5, seed=7)
    assert first != random_dataset(space, 20, 12, 5, seed=8)


@pytest.mark.parametrize(("input_len", "prefix_len"), [(1, 0), (17, 0), (10, 6), (0, 4)])
def test_prompts_have_exact_lengths(input_len: int, prefix_len: int) -> None:
    requests = random_dataset(plain_token_space(50), 30, input_len, 9, prefix_len, seed=1)
    assert len(requests) == 30
    assert {r.prompt_len for r in requests} == {input_len + prefix_len}
    assert {r.output_len for r in requests} == {9}
    assert all(0 <= t < 50 for r in requests for t in r.prompt_ids)
    assert all(len(r.prompt_text.split()) == r.prompt_len for r in requests)


def test_shared_prefix_groups() -> None:
    requests = shared_prefix_dataset(plain_token_space(1000), 12, 5, 3, prefix_len=8, num_prefixes=3, seed=2)
    prefixes = Counter(r.prompt_ids[:8] for r in requests)
    assert len(prefixes) == 3
    assert set(prefixes.values()) == {4}
    assert len({r.prompt_ids[8:] for r in requests}) == 12


def test_random_dataset_with_prefix_shares_one_prefix() -> None:
    requests = random_dataset(plain_token_space(1000), 5, 3, 2, prefix_len=6, seed=0)
    assert len({r.prompt_ids[:6] for r in requests}) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_prompts": 0},
        {"output_len": 0},
        {"num_prefixes": 0},
        {"input_len": 0, "prefix_len": 0},
        {"input_len": -1},
    ],
)
def test_invalid_sizes_raise(kwargs: dict) -> None:
    args = {"num_prompts": 2, "input_len": 3, "output_len": 2, "prefix_len": 0, "num_prefixes": 1}
    with pytest.raises(ValueError):
        synthetic_dataset(plain_token_space(10), **(args | kwargs))


def test_tokenizer_space_skips_special_tokens(tmp_path: Path) -> None:
    vocab = {"<s>": 0, "alpha": 1, "beta": 2, "gamma": 3, "[UNK]": 4}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["<s>", "[UNK]"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    space = tokenizer_token_space(tmp_path)  # a folder holding tokenizer.json
    assert sorted(space.ids) == [1, 2, 3]
    requests = random_dataset(space, 4, 6, 2, seed=3)
    for request in requests:
        assert set(request.prompt_ids) <= {1, 2, 3}
        assert tokenizer.encode(request.prompt_text).ids == list(request.prompt_ids)
