"""Sampler: penalties, greedy/temperature/top-k/top-p/min-p sampling with per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels.cpu as cpu_kernels
from services.engine.core.outputs import Logprobs
from services.engine.core.sampling_params import SamplingParams
from services.engine.worker.structured.bitmask import apply_token_bitmask

_SEED_STRIDE = 1_000_003


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
    """Grammar bitmask rows for some rows of the step's logits (see structured/bitmask.py)."""

    logit_rows: torch.Tensor
    mask_rows: torch.Tensor
    bitmask: torch.Tensor


class Sampler:
    """Samples one token per row from logits [B, V] (widened to fp32 unless every row is plain greedy)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None = None
    ) -> tuple[list[int], list[Logprobs | None]]:
        plain = mask is None and logits.device.type == "cpu" and all(r.plain_greedy for r in rows)
        if plain and cpu_kernels.available():  # one pass over each row, in the logits' own dtype
            return cpu_kernels.greedy_argmax(logits).tolist(), [None] * len(rows)
        logits = logits.float()
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None  # before any constraint
        if mask is not None:
            apply_token_bitmask(logits, mask.bitmask, mask.logit_rows, mask.mask_rows)
        logits = self._process(logits, rows)
        tokens = self._sample(logits, rows)
        lps: list[Logprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_lp[i]:
                    lps[i] = batch_logprobs(raw_logprobs[i : i + 1], [tokens[i]], row.params.logprobs or 0)[0]
        return tokens, lps

    @staticmethod
    def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            p = row.params
            if p.needs_penalties:
                logits[i] = _apply_penalties(logits[i], row)
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                vals = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i, ids] += vals
            if row.stop_ids and row.num_output < p.min_tokens:
                logits[i, list(row.stop_ids)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        tokens = logits.max(dim=-1).indices  # argmax's first-maximum rule, ~2.5x faster on CPU
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            probs = _filtered_probs(logits[idx], [rows[i].params for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j] = self._noise(rows[i], probs.shape[1])
            # Exponential race: argmax p/q with q ~ Exp(1) draws from p, reproducibly per row.
            tokens[idx] = (probs / noise).max(dim=-1).indices
        return tokens.tolist()

    def _noise(self, row: SamplingRow, vocab: int) -> torch.Tensor:
        if row.params.seed is None:
            return torch.empty(vocab).exponential_(generator=self.generator)
        step_seed = (row.params.seed * _SEED_STRIDE + row.num_output) % (2**63)
        return torch.empty(vocab).exponential_(generator=torch.Generator().manual_seed(step_seed))


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    output = row.output_ids + row.drafts if row.drafts else row.output_ids
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(output)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[0])[: logits.shape[0]]
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temps
    for j, p in enumerate(params):
        if p.top_k_enabled and p.top_k < logits.shape[1]:
            kth = torch.topk(logits[j], p.top_k).values[-1]
            logits[j] = logits[j].masked_fill(logits[j] < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params])
    if (top_p < 1.0).any():
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    min_p = torch.tensor([p.min_p for p in params])
    if (min_p > 0).any():
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def batch_logprobs(lp: torch.Tensor, tokens: list[int], n: int) -> list[Logprobs]:
    """Logprob, rank and top-n alternatives of ``tokens[i]`` under row i of log-probabilities ``lp`` [R, V]."""
    target = torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    token_lp = lp.gather(1, target)
    ranks = ((lp > token_lp).sum(dim=-1) + 1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if n > 0:
        vals, ids = torch.topk(lp, n, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return [Logprobs(v, r, t) for v, r, t in zip(token_lp[:, 0].tolist(), ranks, tops, strict=True)]
