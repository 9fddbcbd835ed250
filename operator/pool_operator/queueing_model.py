"""QueueingModel: the prefill and decode replicas a demand needs to meet TTFT and ITL targets.

Fed by a calibrated timing model (`kvferry sim calibrate`'s file: step overhead, seconds per prefill
token, per decoding sequence and per context token, KV blocks, transfer time per block).

- Prefill: one prompt alone takes ``S`` (its steps' overheads, its tokens, the attention over its
  context); under load an engine is busy ``rho = rate * W / P`` (``W``: a prompt's work with the step
  overhead shared by a full batch). Waiting as in an M/M/1 queue (mean wait ``S * rho / (1 - rho)``,
  about three times that at the 95th percentile), a prompt's TTFT is ``S * (1 + 3 rho / (1 - rho))``:
  meeting the TTFT budget ``b`` (the target less the KV transfer and decode's first step) needs
  ``rho <= x / (3 + x)`` with ``x = b / S - 1`` (and at most ``RHO_CAP``), so ``P = ceil(rate * W / rho_max)``.
- Decode: a step lasts ``o + n * k`` (``n`` sequences per engine, ``k`` what one sequence and its
  context add), stretched by the share ``u`` of its time spent prefilling the prompts below the P/D
  threshold. By Little's law ``n = rate * output * ITL / D`` on average; sequences spread over engines
  as a Poisson count, so a busy engine runs ``n + sqrt(n)`` (one standard deviation up: a request's ITL
  is its mean gap, which averages the fluctuations out): the ITL target needs
  ``o + k * (n + sqrt(n)) <= target * (1 - u)``, solved for ``D`` by bisection; KV blocks and
  ``max_num_seqs`` bound ``n`` as well.

Targets are aimed at ``MARGIN`` of their value (headroom for bursts the mean does not show).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.sim.timing_model import TimingModel

MARGIN = 0.9  # aim at 90% of each target
RHO_CAP = 0.85  # never plan a prefill engine busier than this
TAIL_Z = 1.0  # size for a decode engine one standard deviation (Poisson) busier than the mean
TAIL_WAITS = 3.0  # the 95th percentile of an exponential wait is about three times its mean
KV_FILL = 0.9  # plan at most this share of a decode engine's KV blocks


@dataclass(frozen=True)
class Demand:
    """The load on the pool: requests per second and their shape (the queueing model's inputs)."""

    rate: float  # requests/s (every request decodes)
    prefill_share: float  # fraction of them the prefill engines serve (shorter prompts prefill on decode)
    prefill_tokens: float  # mean uncached prompt tokens a prefill engine computes per request it serves
    prompt_tokens: float  # mean prompt tokens per request (decode's context)
    output_tokens: float  # mean output tokens per request
    backlog: float = 0.0  # requests waiting now, on every engine together


class QueueingModel:
    """Replicas per role for a Demand, from a timing model and the TTFT and ITL targets."""

    def __init__(self, timing: TimingModel, ttft_s: float, itl_s: float) -> None:
        self.t = timing
        self.ttft_s = ttft_s
        self.itl_s = itl_s

    def prefill_alone_s(self, d: Demand) -> float:
        """Seconds one prompt of the demand's size takes on an idle prefill engine."""
        t, tokens = self.t, d.prefill_tokens
        steps = max(1, math.ceil(tokens / t.max_num_batched_tokens))
        attended = tokens * max(d.prompt_tokens - tokens / 2, tokens / 2)
        overhead = steps * (t.step_overhead_s + t.prefill_step_overhead_s)
        return overhead + tokens * t.s_per_prefill_token + attended * t.s_per_prefill_context_token

    def prefill_work_s(self, d: Demand, tokens: float | None = None) -> float:
        """Busy seconds one prompt costs a loaded engine (step overheads shared by a full batch)."""
        t = self.t
        tokens = d.prefill_tokens if tokens is None else tokens
        attended = tokens * max(d.prompt_tokens - tokens / 2, tokens / 2)
        shared = (t.step_overhead_s + t.prefill_step_overhead_s) * tokens / t.max_num_batched_tokens
        return shared + tokens * t.s_per_prefill_token + attended * t.s_per_prefill_context_token

    def prefill(self, d: Demand) -> tuple[float, str]:
        """Prefill replicas (fractional, before rounding) and why."""
        rate = d.rate * d.prefill_share
        if rate <= 0 or d.prefill_tokens <= 0:
            return 0.0, "no prompts reach prefill"
        transfer = math.ceil(d.prompt_tokens / self.t.block_size) * self.t.transfer_s_per_block
        budget = self.ttft_s * MARGIN - transfer - self.itl_s * MARGIN
        alone = self.prefill_alone_s(d)
        if alone >= budget:
            return (
                math.inf,
                f"one {d.prefill_tokens:.0f}-token prefill ({alone:.2f}s) exceeds the TTFT budget",
            )
        slack = budget / alone - 1
        rho = min(RHO_CAP, slack / (TAIL_WAITS + slack))
        need = rate * self.prefill_work_s(d) / rho
        return need, f"{rate:.2f} prefills/s of {d.prefill_tokens:.0f} tokens at utilisation <= {rho:.2f}"

    def decode(self, d: Demand) -> tuple[float, str]:
        """Decode replicas (fractional, before rounding) and why."""
        t, target = self.t, self.itl_s * MARGIN
        if d.rate <= 0:
            return 0.0, "no requests"
        context = d.prompt_tokens + d.output_tokens / 2
        per_seq = t.s_per_decode_seq + context * t.s_per_context_token
        if t.step_overhead_s >= target:
            return math.inf, f"the step overhead {t.step_overhead_s:.3f}s exceeds the ITL target"
        load = d.rate * d.output_tokens  # tokens/s to generate
        local = d.rate * (1 - d.prefill_share)  # prompts below the P/D threshold prefill on decode
        local_work = local * self.prefill_work_s(d, min(d.prefill_tokens or d.prompt_tokens, d.prompt_tokens))

        def meets(replicas: float) -> bool:  # a busy engine's step (n + z sqrt(n) sequences) within target
            n = load * target / replicas
            stretch = 1 - local_work / replicas
            return (
                stretch > 0 and t.step_overhead_s + per_seq * (n + TAIL_Z * math.sqrt(n)) <= target * stretch
            )

        low = (load * per_seq + local_work) / (1 - t.step_overhead_s / target)  # the mean alone
        high = max(2 * low, 1.0)
        while not meets(high):
            high *= 2
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (low, mid) if meets(mid) else (mid, high)
        by_itl = high
        seqs = load * target  # sequences decoding at once (Little's law)
        blocks = seqs * math.ceil((d.prompt_tokens + d.output_tokens) / t.block_size)
        by_kv = blocks / (t.num_kv_blocks * KV_FILL)
        by_seqs = seqs / t.max_num_seqs
        need = max(by_itl, by_kv, by_seqs)
        bound = "ITL" if need == by_itl else "KV blocks" if need == by_kv else "max_num_seqs"
        return need, f"{load:.1f} output tokens/s over {context:.0f}-token contexts ({bound} bound)"
