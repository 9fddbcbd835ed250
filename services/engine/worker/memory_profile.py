"""Profile run (vLLM's): the device memory one step at the full token budget needs beyond the weights.

``--gpu-memory-utilization U`` then gives the KV cache ``U x total`` less what the device already holds
(weights, CUDA context, other processes) less this step's peak, measured instead of guessed.
"""

from __future__ import annotations

import torch

from services.engine.core.outputs import NewRequestData, SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.worker.attention import ComputeBackend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.model_runner import ModelRunner, kv_cache_shape
from services.engine.worker.models.interface import CausalLM
from services.engine.worker.structured.manager import StepConstraints

# the sampler's worst case: every row samples (fp32 logits, the top-p/top-k sort, noise), reports the most
# logprobs, carries penalties and a grammar bitmask, so --gpu-memory-utilization leaves room for all of it
WORST_CASE = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    seed=0,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logprobs=20,
    max_tokens=1,
    ignore_eos=True,
)


def dummy_prompts(num_tokens: int, max_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths filling ``num_tokens`` with up to ``max_seqs`` prompts (so the sampler's batch is
    profiled too), each at most ``max_model_len - 1`` tokens."""
    n = max(1, min(max_seqs, num_tokens))
    per, extra = divmod(num_tokens, n)
    lengths = [per + (1 if i < extra else 0) for i in range(n)]
    return [min(length, max_model_len - 1) for length in lengths if length > 0]


def profile_blocks(lengths: list[int], block_size: int) -> int:
    """KV blocks the profile step's prompts use."""
    return sum(-(-length // block_size) for length in lengths)


def all_allowed(reqs: list[NewRequestData], vocab_size: int) -> StepConstraints:
    """A grammar bitmask row per request that allows every token (the mask's memory, not its effect)."""
    words = -(-vocab_size // 32)
    bitmask = torch.full((len(reqs), words), -1, dtype=torch.int32)
    return StepConstraints({r.req_id: i for i, r in enumerate(reqs)}, bitmask)


def profile_step(runner: ModelRunner, lengths: list[int]) -> int:
    """Peak CUDA bytes allocated while ``runner`` prefills prompts of ``lengths`` in one step, over what
    was allocated before (the runner's KV cache needs ``profile_blocks`` blocks); the runner forgets the
    prompts afterwards. RuntimeError if the step fails."""
    device = runner.device
    reqs, block, sched_tokens = [], 0, []
    for i, length in enumerate(lengths):
        blocks = tuple(range(block, block + -(-length // runner.block_size)))
        block += len(blocks)
        rid = f"profile-{i}"
        reqs.append(NewRequestData(rid, (0,) * length, (), WORST_CASE, blocks, 0))
        sched_tokens.append((rid, length))
    step = SchedulerOutput(tuple(reqs), (), tuple(sched_tokens), sum(lengths))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = runner.execute(step, all_allowed(reqs, runner.cfg.vocab_size))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    runner.execute(SchedulerOutput((), (), (), 0, finished_req_ids=frozenset(r.req_id for r in reqs)))
    if out.failed_req_ids:
        raise RuntimeError("the profile step at max_num_batched_tokens failed: see the log above")
    torch.cuda.empty_cache()
    return peak


def profile_model(
    model: CausalLM,
    cfg: ModelConfig,
    dtype: torch.dtype,
    backend: ComputeBackend,
    device: torch.device,
    block_size: int,
    lengths: list[int],
) -> int:
    """``profile_step`` of a freshly loaded model on ``device``, with a KV cache just large enough."""
    shape = kv_cache_shape(cfg, profile_blocks(lengths, block_size), block_size)
    kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    runner = ModelRunner(model, cfg, kv_cache, block_size, backend, device, ())
    try:
        return profile_step(runner, lengths)
    finally:
        del runner, kv_cache
        torch.cuda.empty_cache()
