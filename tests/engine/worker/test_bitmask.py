"""The grammar bitmask on the logits: the C++ kernel equals the torch version, masks exactly the 0 bits."""

from __future__ import annotations

import pytest
import torch

from services.engine.worker.structured.bitmask import apply_token_bitmask, apply_token_bitmask_torch


@pytest.mark.parametrize("vocab", [32, 100, 49152, 49155])
def test_kernel_equals_torch_and_the_bits(vocab: int) -> None:
    import kvkernels.cpu

    if not kvkernels.cpu.available():
        pytest.skip(f"the C++ CPU kernels cannot be built here: {kvkernels.cpu.unavailable_reason()}")
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything allowed
    bitmask[2, : words // 2] = 0
    logits = torch.randn(9, vocab, generator=gen)
    rows, mask_rows = torch.tensor([8, 0, 3, 5, 1]), torch.tensor([2, 0, 1, 4, 5])
    fast, slow = logits.clone(), logits.clone()
    apply_token_bitmask(fast, bitmask, rows, mask_rows)
    apply_token_bitmask_torch(slow, bitmask, rows, mask_rows)
    assert torch.equal(fast, slow)
    untouched = [i for i in range(9) if i not in rows.tolist()]
    assert torch.equal(fast[untouched], logits[untouched])
    for r, m in zip(rows.tolist(), mask_rows.tolist(), strict=True):
        bits = [(int(bitmask[m, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        allowed = torch.tensor(bits, dtype=torch.bool)
        assert torch.equal(fast[r][allowed], logits[r][allowed])
        assert bool(torch.isneginf(fast[r][~allowed]).all())


def test_narrow_bitmask_forbids_the_padding() -> None:
    logits = torch.zeros(1, 40)
    apply_token_bitmask(
        logits, torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([0]), torch.tensor([0])
    )
    assert bool((logits[0, :32] == 0).all()) and bool(torch.isneginf(logits[0, 32:]).all())
