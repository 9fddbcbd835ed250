"""Sampler: penalties, logit bias, greedy/temperature/top-k/top-p/min-p sampling with per-request seeds,
logprobs; one batch on the logits' device (no per-row loop over tensors)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

import kvkernels.cpu as cpu_kernels
from services.engine.core.outputs import Logprobs
from services.engine.core.sampling_params import SamplingParams
from services.engine.worker.device_copy import to_device
from services.engine.worker.sampling_batch import SamplingBatch
from services.engine.worker.seeded_noise import seeded_exponential
from services.engine.worker.structured.bitmask import apply_token_bitmask


@dataclass
class SamplingRow:
    """What the sampler needs about one request in the batch."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: tuple[int, ...]  # eos + stop_token_ids, masked while min_tokens is not reached
    drafts: list[int] = field(default_factory=list)  # speculative decoding: drafts before this position

    @property
    def num_output(self) -> int:
        """Output tokens before the sampled position (drafts it follows included)."""
        return len(self.output_ids) + len(self.drafts)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes or reports the logits: the argmax of the raw row."""
        p = self.params
        masked = bool(self.stop_ids) and self.num_output < p.min_tokens
        return p.greedy and p.logprobs is None and not p.shapes_logits and not masked


@dataclass(frozen=True)
class TokenMask:
    """Grammar bitmask rows for some rows of the step's logits (see structured/bitmask.py); host tensors,
    moved to the logits' device by the sampler."""

    logit_rows: torch.Tensor
    mask_rows: torch.Tensor
    bitmask: torch.Tensor


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row, logprobs where asked, and the rows where no token was allowed (-1 there)."""

    tokens: list[int]
    logprobs: list[Logprobs | None]
    no_token_rows: tuple[int, ...] = ()


class Sampler:
    """Samples one token per row from logits [B, V] (widened to fp32 unless every row is plain greedy)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # unseeded rows on the CPU
        self.rng = random.Random(seed)  # unseeded rows' noise keys on other devices

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None = None
    ) -> SamplerOutput:
        plain = mask is None and logits.device.type == "cpu" and all(r.plain_greedy for r in rows)
        if plain and cpu_kernels.available():  # one pass over each row, in the logits' own dtype
            return SamplerOutput(cpu_kernels.greedy_argmax(logits).tolist(), [None] * len(rows))
        logits = logits.float()
        batch = SamplingBatch.build(rows, logits.shape[1], logits.device, self.rng)
        want_lp = [j for j, r in enumerate(rows) if r.params.logprobs is not None]
        lp_rows = to_device(torch.tensor(want_lp, dtype=torch.int64), logits.device) if want_lp else None
        raw_lp = torch.log_softmax(logits.index_select(0, lp_rows), dim=-1) if lp_rows is not None else None
        if mask is not None:
            dev = logits.device
            apply_token_bitmask(
                logits,
                to_device(mask.bitmask, dev),
                to_device(mask.logit_rows, dev),
                to_device(mask.mask_rows, dev),
            )
        logits = _shape(logits, batch)
        tokens = self._sample(logits, batch)
        if mask is None:  # only a grammar mask sets a whole row to -inf (held stops never empty one)
            host = [tokens.tolist(), [0] * len(rows)]
        else:
            dead = ~torch.isfinite(logits).any(dim=-1)
            tokens = torch.where(dead, -1, tokens)
            host = torch.stack([tokens, dead.long()]).tolist()
        lps: list[Logprobs | None] = [None] * len(rows)
        if raw_lp is not None and lp_rows is not None:
            n = max(rows[j].params.logprobs or 0 for j in want_lp)
            got = batch_logprobs(raw_lp, tokens.index_select(0, lp_rows).clamp(min=0), n)
            for j, lp in zip(want_lp, got, strict=True):
                lps[j] = Logprobs(lp.token_logprob, lp.rank, lp.top[: rows[j].params.logprobs or 0])
        no_token = tuple(j for j, d in enumerate(host[1]) if d)
        return SamplerOutput(host[0], lps, no_token)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        tokens = logits.max(dim=-1).indices  # argmax's first-maximum rule, ~2.5x faster on CPU
        if not batch.any_random:
            return tokens
        idx = batch.random_rows
        probs = filtered_probs(logits.index_select(0, idx), batch, idx)
        if probs.device.type == "cpu":
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
        else:  # every row is keyed (no device generator: the same on every rank)
            noise = torch.empty_like(probs)
        if batch.seeded_rows.numel():
            noise.index_copy_(0, batch.seeded_rows, seeded_exponential(batch.seed_keys, probs.shape[1]))
        # Exponential race: argmax p/q with q ~ Exp(1) draws from p, reproducibly per seeded row.
        return tokens.index_copy(0, idx, (probs / noise).max(dim=-1).indices)


def _shape(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, logit bias and the stop tokens min_tokens holds back. A row whose constraint allows
    only stop tokens keeps them: the grammar's end wins over min_tokens (else nothing could be sampled)."""
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.bias is not None:
        r, t, b = batch.bias
        logits = logits.index_put((r, t), b, accumulate=True)
    if batch.held_stops is not None:
        held = logits.index_put(batch.held_stops, torch.tensor(float("-inf"), device=logits.device))
        alive = torch.isfinite(held).any(dim=-1, keepdim=True)
        logits = torch.where(alive, held, logits)
    return logits


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch, idx: torch.Tensor) -> torch.Tensor:
    """Probabilities [R, V] of rows ``idx`` after temperature, top-k, top-p and min-p (unnormalised where
    filtered: the exponential race does not need a sum of 1)."""
    logits = logits / batch.temperature.index_select(0, idx)[:, None]
    if batch.any_top_k or batch.any_top_p:
        ordered, order = logits.sort(dim=-1)  # ascending
        vocab = logits.shape[1]
        if batch.any_top_k:
            k = batch.top_k.index_select(0, idx)
            kth = ordered.gather(1, (vocab - k).clamp(min=0)[:, None])
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        if batch.any_top_p:
            cum = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
            drop = cum <= 1.0 - batch.top_p.index_select(0, idx)[:, None]
            drop[:, -1] = False  # the most likely token always stays
            ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, ordered)
    probs = torch.softmax(logits, dim=-1)
    if batch.any_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.index_select(0, idx)[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def batch_logprobs(lp: torch.Tensor, tokens: list[int] | torch.Tensor, n: int) -> list[Logprobs]:
    """Logprob, rank and top-n alternatives of ``tokens[i]`` under row i of log-probabilities ``lp`` [R, V]."""
    if isinstance(tokens, torch.Tensor):
        target = tokens.to(torch.long)[:, None]
    else:
        target = torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    token_lp = lp.gather(1, target)
    ranks = ((lp > token_lp).sum(dim=-1) + 1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * target.shape[0]
    if n > 0:
        vals, ids = torch.topk(lp, n, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return [Logprobs(v, r, t) for v, r, t in zip(token_lp[:, 0].tolist(), ranks, tops, strict=True)]
