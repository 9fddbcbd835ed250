"""SamplingBatch: a step's per-row sampling settings as tensors on the logits' device, built once per step.

Everything the sampler needs from Python (temperatures, filters, penalties, seeds, logit biases, the
stop tokens ``min_tokens`` holds back, penalty token lists) is gathered into a few host tensors and moved
to the logits' device once each, non-blocking from pinned memory on a GPU; the sampler then works on
whole batches with no per-row Python loop over tensors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.worker.device_copy import to_device

if TYPE_CHECKING:
    from services.engine.worker.sampler import SamplingRow

_SEED_STRIDE = 1_000_003
_KEY_MOD = 2**63


def _pairs(device: torch.device, rows: list[int], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    both = to_device(torch.tensor([rows, cols], dtype=torch.int64).reshape(2, -1), device)
    return both[0], both[1]


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row settings of one step's rows [B] (see the module docstring)."""

    greedy: torch.Tensor  # bool [B]
    temperature: torch.Tensor  # fp32 [B] (1.0 for greedy rows: never divided by 0)
    top_p: torch.Tensor  # fp32 [B]
    min_p: torch.Tensor  # fp32 [B]
    top_k: torch.Tensor  # int64 [B] (vocab when off)
    random_rows: torch.Tensor  # int64 [R]: rows that sample
    seeded_rows: torch.Tensor  # int64 [S]: positions in random_rows whose noise comes from a key
    seed_keys: torch.Tensor  # int64 [S]: their keys ((seed, position), or random for unseeded rows)
    any_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    penalties: PenaltyBatch | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, tokens, biases)
    held_stops: tuple[torch.Tensor, torch.Tensor] | None  # (rows, tokens) masked before min_tokens

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab: int, device: torch.device, rng: random.Random
    ) -> SamplingBatch:
        """``rng`` keys the unseeded rows off the CPU (every rank of a tensor-parallel engine draws the
        same keys, as the ranks' samplers are seeded alike); on the CPU they draw from a generator."""
        floats = [
            (1.0 if r.params.greedy else r.params.temperature, r.params.top_p, r.params.min_p) for r in rows
        ]
        ints = [(r.params.top_k if 0 < r.params.top_k < vocab else vocab, int(r.params.greedy)) for r in rows]
        f = to_device(torch.tensor(floats, dtype=torch.float32).reshape(-1, 3), device)
        i = to_device(torch.tensor(ints, dtype=torch.int64).reshape(-1, 2), device)
        random_rows = [j for j, r in enumerate(rows) if not r.params.greedy]
        keyed = device.type != "cpu"  # every random row gets a key; on the CPU only the seeded ones
        picked = [(k, rows[j]) for k, j in enumerate(random_rows) if keyed or rows[j].params.seed is not None]
        keys = [_key(r, rng) for _, r in picked]
        sk = _pairs(device, [k for k, _ in picked], keys)
        return cls(
            greedy=i[:, 1].bool(),
            temperature=f[:, 0],
            top_p=f[:, 1],
            min_p=f[:, 2],
            top_k=i[:, 0],
            random_rows=to_device(torch.tensor(random_rows, dtype=torch.int64), device),
            seeded_rows=sk[0],
            seed_keys=sk[1],
            any_random=bool(random_rows),
            any_top_k=any(0 < r.params.top_k < vocab for r in rows),
            any_top_p=any(r.params.top_p < 1.0 for r in rows),
            any_min_p=any(r.params.min_p > 0 for r in rows),
            penalties=PenaltyBatch.build(rows, device),
            bias=_bias(rows, vocab, device),
            held_stops=_held_stops(rows, vocab, device),
        )


def _key(row: SamplingRow, rng: random.Random) -> int:
    """A seeded row's key is (seed, absolute position in the sequence): its draw there is the same on any
    engine and device, also when a router resumes the request elsewhere with prompt + the tokens so far as
    the new prompt (the position of the next token is the same)."""
    if row.params.seed is None:
        return rng.getrandbits(63)
    return (row.params.seed * _SEED_STRIDE + len(row.prompt_ids) + row.num_output) % _KEY_MOD


@dataclass(frozen=True)
class PenaltyBatch:
    """Penalties of the rows that have any: their settings and the tokens they count."""

    rows: torch.Tensor  # int64 [P]: rows of the batch with penalties
    presence: torch.Tensor  # fp32 [P]
    frequency: torch.Tensor  # fp32 [P]
    repetition: torch.Tensor  # fp32 [P]
    output: tuple[torch.Tensor, torch.Tensor]  # (row in P, token) per output token (drafts included)
    seen: tuple[torch.Tensor, torch.Tensor]  # (row in P, token) per prompt or output token (repetition)

    @classmethod
    def build(cls, rows: list[SamplingRow], device: torch.device) -> PenaltyBatch | None:
        which = [j for j, r in enumerate(rows) if r.params.needs_penalties]
        if not which:
            return None
        out_rows: list[int] = []
        out_toks: list[int] = []
        seen_rows: list[int] = []
        seen_toks: list[int] = []
        for p, j in enumerate(which):
            row = rows[j]
            output = row.output_ids + row.drafts if row.drafts else row.output_ids
            if resumed := row.params.resumed_output_tokens:  # output an earlier engine generated
                output = row.prompt_ids[len(row.prompt_ids) - resumed :] + output
            if row.params.frequency_penalty or row.params.presence_penalty:
                out_rows += [p] * len(output)
                out_toks += output
            if row.params.repetition_penalty != 1.0:
                seen = set(row.prompt_ids) | set(output)
                seen_rows += [p] * len(seen)
                seen_toks += seen
        settings = [
            (
                rows[j].params.presence_penalty,
                rows[j].params.frequency_penalty,
                rows[j].params.repetition_penalty,
            )
            for j in which
        ]
        s = to_device(torch.tensor(settings, dtype=torch.float32), device)
        return cls(
            rows=to_device(torch.tensor(which, dtype=torch.int64), device),
            presence=s[:, 0],
            frequency=s[:, 1],
            repetition=s[:, 2],
            output=_pairs(device, out_rows, out_toks),
            seen=_pairs(device, seen_rows, seen_toks),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, V] with the penalties applied to the penalised rows (vLLM's order: repetition,
        then frequency and presence)."""
        sub = logits.index_select(0, self.rows)
        rep = self.repetition[:, None]
        seen = torch.zeros_like(sub, dtype=torch.bool).index_put_(
            self.seen, torch.ones((), dtype=torch.bool, device=sub.device)
        )
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        counts = torch.zeros_like(sub).index_put_(
            self.output, torch.ones((), device=sub.device), accumulate=True
        )
        sub = sub - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).float()
        return logits.index_copy(0, self.rows, sub)


def _bias(
    rows: list[SamplingRow], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, tokens, biases) of the rows' logit_bias entries. Ids past the logits' width were refused with
    a 400 at the API; one that gets here is left out rather than indexed out of bounds (a device assert)."""
    triples = [
        (j, tok, b)
        for j, r in enumerate(rows)
        if r.params.logit_bias
        for tok, b in r.params.logit_bias.items()
        if tok < vocab
    ]
    if not triples:
        return None
    rt = _pairs(device, [t[0] for t in triples], [t[1] for t in triples])
    return rt[0], rt[1], to_device(torch.tensor([t[2] for t in triples], dtype=torch.float32), device)


def _held_stops(
    rows: list[SamplingRow], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, tokens): the stop tokens of rows that have not reached ``min_tokens`` yet."""
    pairs = [
        (j, tok)
        for j, r in enumerate(rows)
        if r.stop_ids and r.num_output < r.params.min_tokens
        for tok in r.stop_ids
        if tok < vocab
    ]
    if not pairs:
        return None
    return _pairs(device, [p[0] for p in pairs], [p[1] for p in pairs])
