"""apply_token_bitmask: forbid (set -inf) every token whose bit is 0 in its row's packed int32 bitmask."""

from __future__ import annotations

import torch


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, mask_rows: torch.Tensor
) -> None:
    """``logits[rows[i]]`` keeps only the tokens allowed by ``bitmask[mask_rows[i]]`` (bit t%32 of word t//32).

    One batched unpack and one masked fill for every constrained row of the step (no Python loop over
    rows or the vocabulary); tokens past the bitmask's width (padding of the vocabulary) are forbidden.
    """
    if rows.numel() == 0:
        return
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.is_contiguous()
        and _cpu_kernels()
    ):
        import kvkernels.cpu as cpu_ops

        cpu_ops.apply_token_bitmask(logits, bitmask, rows, mask_rows)
        return
    apply_token_bitmask_torch(logits, bitmask, rows, mask_rows)


def _cpu_kernels() -> bool:
    import kvkernels.cpu as cpu_ops

    return cpu_ops.available()


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, mask_rows: torch.Tensor
) -> None:
    """The same in plain torch (other devices and dtypes, and the reference the C++ kernel is tested against)."""
    vocab = logits.shape[1]
    words = bitmask.index_select(0, mask_rows)  # [R, W] int32
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(words.shape[0], -1).bool()
    width = min(vocab, allowed.shape[1])
    sub = logits.index_select(0, rows)
    sub[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    if width < vocab:
        sub[:, width:] = float("-inf")
    logits.index_copy_(0, rows, sub)
