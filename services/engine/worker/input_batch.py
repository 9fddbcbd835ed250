"""The runner's per-request state and one step's flattened batch: token ids, positions, slots, block tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.core.mm_input import MMInput
from services.engine.core.outputs import SchedulerOutput
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams
from services.engine.worker.attention import AttentionMetadata, ComputeBackend


@dataclass
class CachedRequestState:
    """The runner's copy of a request: all tokens so far and its block table."""

    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed: int
    stop_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    pooling: PoolingParams | None = None  # an embedding request: pooled when its prompt ends, never sampled
    lora_name: str | None = None  # its LoRA adapter
    spec_ids: list[int] = field(default_factory=list)  # draft tokens it verifies in this step
    num_draft_computed: int = 0  # leading tokens the draft model holds KV for (speculative decoding)
    mm_inputs: tuple[MMInput, ...] = ()  # its images (vision-language models)


@dataclass
class StepInputs:
    """The flattened batch of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # index into the scheduled requests of those that sample
    logits_idx: torch.Tensor  # token rows whose hidden state feeds the sampler (1 + drafts per sample row)
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    pool_rows: list[int] = field(
        default_factory=list
    )  # index into the scheduled requests of those pooled now
    spec_lens: list[int] = field(default_factory=list)  # per sample row: drafts it verifies (empty: none)


@dataclass
class PromptLogprobRows:
    """Token rows of one request's prompt chunk whose logits score the next prompt token."""

    req_id: str
    first: int  # index in the prompt of the first token scored
    hidden_idx: list[int]
    targets: list[int]
    top_n: int


def build_inputs(
    sched: SchedulerOutput,
    states: dict[str, CachedRequestState],
    backend: ComputeBackend,
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """Flatten the scheduled requests (batch order) into one step's inputs and attention metadata."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    q_lens, seq_lens, tables, sample_rows = [], [], [], []
    logits_idx: list[int] = []
    prompt_rows: list[PromptLogprobRows] = []
    pool_rows: list[int] = []
    spec_lens: list[int] = []
    for row, (req_id, n) in enumerate(sched.num_scheduled_tokens):
        st = states[req_id]
        start, end = st.num_computed, st.num_computed + n
        total = len(st.token_ids) + len(st.spec_ids)
        ids.extend(st.token_ids[start:end])
        if end > len(st.token_ids):  # the drafts it verifies follow its last token
            ids.extend(st.spec_ids[: end - len(st.token_ids)])
        positions = range(start, end)
        pos.extend(positions)
        blocks = st.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in positions)
        if st.params.prompt_logprobs is not None and start < len(st.prompt_ids) - 1:
            prompt_rows.append(_prompt_rows(req_id, st, start, end, len(ids) - n))
        q_lens.append(n)
        seq_lens.append(end)
        tables.append(blocks)
        if end == total and st.pooling is not None:
            pool_rows.append(row)
        elif end == total:
            sample_rows.append(row)
            spec_lens.append(len(st.spec_ids))
            logits_idx.extend(range(len(ids) - 1 - len(st.spec_ids), len(ids)))
    meta = backend.build_metadata(q_lens, seq_lens, tables, slots, block_size, device)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        meta=meta,
        sample_rows=sample_rows,
        logits_idx=torch.tensor(logits_idx, dtype=torch.long, device=device),
        prompt_rows=prompt_rows,
        pool_rows=pool_rows,
        spec_lens=spec_lens if any(spec_lens) else [],
    )


def _prompt_rows(req_id: str, st: CachedRequestState, start: int, end: int, base: int) -> PromptLogprobRows:
    """Positions start..end of the prompt that have a next prompt token (the last one has none)."""
    last = min(end, len(st.prompt_ids) - 1)
    return PromptLogprobRows(
        req_id,
        start + 1,
        [base + p - start for p in range(start, last)],
        st.prompt_ids[start + 1 : last + 1],
        st.params.prompt_logprobs or 0,
    )
