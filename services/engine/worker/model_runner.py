"""ModelRunner: keeps per-request state, flattens each step into one batch, runs the model, samples."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import cast

import torch

from services.engine.core.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from services.engine.worker.absent_features import NoGraphs, NoLoRA, NoSpec, NoVision
from services.engine.worker.attention import ComputeBackend
from services.engine.worker.cuda_graphs import DecodeGraphs
from services.engine.worker.decode_inputs import DecodeInputs
from services.engine.worker.input_batch import CachedRequestState, PromptLogprobRows, StepInputs
from services.engine.worker.lora.lora_manager import LoRAManager
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.interface import CausalLM, EmbeddingModel
from services.engine.worker.multimodal.encoder_cache import VisionModel
from services.engine.worker.multimodal.vision_step import VisionStep
from services.engine.worker.pooling import PoolingConfig, pool
from services.engine.worker.sampler import Sampler, SamplingRow, TokenMask, batch_logprobs
from services.engine.worker.spec_decode.proposal import accepted_prefix
from services.engine.worker.spec_decode.spec_decoder import SpecDecoder
from services.engine.worker.structured.manager import StepConstraints

log = logging.getLogger(__name__)
_PROMPT_LOGITS_SLICE = 512  # prompt rows per logits matrix when scoring prompt tokens
_NO_TOKEN = (
    "no token can be sampled: the output constraint, logit_bias and min_tokens together allow none "
    "at this position"
)


@dataclass(frozen=True)
class RunnerFeatures:
    """What a runner serves beyond plain generation, given at construction (None: not served)."""

    pooling: PoolingConfig | None = None  # --task embed
    lora: LoRAManager | None = None  # --enable-lora
    spec: SpecDecoder | None = None  # --speculative-config (rank 0's proposer)


class ModelRunner:
    """Runs a model over the paged KV cache (one block-major tensor, see allocate_kv_cache)."""

    def __init__(
        self,
        model: CausalLM | EmbeddingModel,
        cfg: ModelConfig,
        kv_cache: torch.Tensor,
        block_size: int,
        backend: ComputeBackend,
        device: torch.device,
        eos_ids: tuple[int, ...],
        seed: int = 0,
        features: RunnerFeatures | None = None,
    ) -> None:
        self.model, self.cfg, self.kv_cache = model, cfg, kv_cache
        self.block_size, self.backend, self.device = block_size, backend, device
        self.eos_ids = eos_ids
        self.sampler = Sampler(seed)
        self.states: dict[str, CachedRequestState] = {}
        self.inputs = DecodeInputs(backend, block_size, device)
        f = features or RunnerFeatures()
        self.pooling = f.pooling
        self.lora: LoRAManager | NoLoRA = f.lora if f.lora is not None else NoLoRA()
        self.spec: SpecDecoder | NoSpec = f.spec if f.spec is not None else NoSpec()
        self.graphs: DecodeGraphs | NoGraphs = NoGraphs()  # the Worker's on CUDA unless --enforce-eager
        self.vision: VisionStep | NoVision = (  # vision-language models: image features by content hash
            VisionStep(cast(VisionModel, model), device) if hasattr(model, "encode_images") else NoVision()
        )
        self._signed: tuple[object, bool] = (None, False)  # (model, its compute_logits takes fp32)

    def _lm(self) -> CausalLM:
        """The model as a language model (an encoder has no logits: its requests are pooled, never sampled)."""
        if not hasattr(self.model, "compute_logits"):
            raise ValueError("this engine serves embeddings only: nothing can be sampled from an encoder")
        return cast(CausalLM, self.model)

    def _logits(self, hidden: torch.Tensor, idx: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """The logits of the hidden rows ``idx`` (with LoRA: each row under its request's adapter); with
        ``fp32=False`` in the model's dtype (the sampler widens them unless it only takes argmaxes)."""
        lm, args = self._lm(), self._logits_args(fp32)
        with self.lora.logit_rows(idx):
            return lm.compute_logits(hidden[idx], *args)

    def _logits_args(self, fp32: bool) -> tuple[bool, ...]:
        """(fp32,) where the model's compute_logits takes it, else () (a plugin written to the one-argument
        form always gives fp32); looked up again whenever the runner's model is replaced."""
        model, takes = self._signed
        if model is not self.model:
            fn = getattr(self.model, "compute_logits", None)
            takes = fn is not None and "fp32" in inspect.signature(fn).parameters
            self._signed = (self.model, takes)
        return (fp32,) if takes else ()

    def _update_states(self, sched: SchedulerOutput) -> None:
        gone = sched.finished_req_ids | sched.preempted_req_ids
        for req_id in gone:
            self.states.pop(req_id, None)
        self.spec.forget(gone)
        for new in sched.new_reqs:
            p = new.sampling_params
            stop_ids = () if p.ignore_eos else tuple(self.eos_ids)
            self.states[new.req_id] = CachedRequestState(
                prompt_ids=list(new.prompt_token_ids),
                output_ids=list(new.output_token_ids),
                params=p,
                block_ids=list(new.block_ids),
                num_computed=new.num_computed_tokens,
                stop_ids=stop_ids + tuple(p.stop_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                pooling=new.pooling,
                lora_name=new.lora_name,
                num_draft_computed=new.num_local_kv_tokens,
                mm_inputs=new.mm_inputs,
            )
        for cached in sched.cached_reqs:
            state = self.states[cached.req_id]
            if 0 <= cached.num_blocks_before < len(state.block_ids):  # the scheduler freed draft slots
                del state.block_ids[cached.num_blocks_before :]
                self.inputs.invalidate()
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed = cached.num_computed_tokens
        for req_id, drafts in sched.spec_token_ids:  # (_sample clears them once verified)
            self.states[req_id].spec_ids = list(drafts)

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput:
        """Run one step; an exception fails this step's requests instead of the engine.

        ``constraints``: the token bitmask rows of the structured-output requests that sample now.
        """
        self._update_states(sched)
        self.vision.drop(sched.freed_encoder_hashes)
        req_ids = tuple(r for r, _ in sched.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput((), (), ())
        try:
            self.vision.encode(sched, self.states)
            inputs = self.inputs.build(sched, self.states)
            self.lora.prepare(req_ids, self.states, inputs.meta.query_start_loc)
            extra = self.vision.embeddings(sched, inputs, self.states)
            kwargs = {"inputs_embeds": extra} if extra is not None else {}
            if extra is None and self.graphs.serves(inputs):
                hidden = self.graphs.run(inputs)  # a pure decode step: replay its batch size's graph
            else:
                hidden = self.model(
                    inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend, **kwargs
                )
            prompt_lps = tuple(self._prompt_logprobs(hidden, rows) for rows in inputs.prompt_rows)
            pooled = self._pool(hidden, inputs, req_ids) if inputs.pool_rows else ()
            sampled: list[tuple[int, ...]] = [()] * len(req_ids)
            lps: list[tuple[Logprobs, ...]] = [()] * len(req_ids)
            dead: set[str] = set()
            rejected = (
                self._sample(hidden, inputs, req_ids, constraints, sampled, lps, dead)
                if inputs.sample_rows
                else {}
            )
            starts = [self.states[r].num_computed for r in req_ids] if self.spec.proposes else []
            for req_id, n in sched.num_scheduled_tokens:  # rejected drafts' KV is overwritten later
                self.states[req_id].num_computed += n - rejected.get(req_id, 0)
            proposed = self._propose(req_ids, sampled, hidden, inputs, starts) if starts else ()
            for req_id in dead:
                self.states.pop(req_id, None)
            proposed = tuple(p for p in proposed if p[0] not in dead)
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            log.exception("model step failed; failing its %d requests", len(req_ids))
            for req_id in req_ids:
                self.states.pop(req_id, None)
            return ModelRunnerOutput(
                req_ids,
                ((),) * len(req_ids),
                ((),) * len(req_ids),
                failed_req_ids=frozenset(req_ids),
                error=f"{type(exc).__name__}: {exc}",
            )
        return ModelRunnerOutput(
            req_ids,
            tuple(sampled),
            tuple(lps),
            prompt_logprobs=prompt_lps,
            pooled=pooled,
            spec_token_ids=proposed,
            failed_req_ids=frozenset(dead),
            error=_NO_TOKEN if dead else None,
        )

    def _sample(
        self,
        hidden: torch.Tensor,
        inputs: StepInputs,
        req_ids: tuple[str, ...],
        constraints: StepConstraints | None,
        sampled: list[tuple[int, ...]],
        lps: list[tuple[Logprobs, ...]],
        dead: set[str],
    ) -> dict[str, int]:
        """Sample every logits row; a request verifying drafts keeps the tokens its target confirms.

        Returns the number of rejected drafts per request that verified some; ``dead`` gets the requests
        with a row where no token was allowed (their constraint, bias and min_tokens left nothing).
        """
        logits = self._logits(hidden, inputs.logits_idx, fp32=False)
        spec_lens = inputs.spec_lens or [0] * len(inputs.sample_rows)
        rows: list[SamplingRow] = []
        row_reqs: list[str] = []
        for r, m in zip(inputs.sample_rows, spec_lens, strict=True):
            st = self.states[req_ids[r]]
            for j in range(m + 1):  # row j samples the position after drafts[:j]
                rows.append(
                    SamplingRow(st.params, st.prompt_ids, st.output_ids, st.stop_ids, st.spec_ids[:j])
                )
                row_reqs.append(req_ids[r])
        out = self.sampler(logits, rows, _mask_rows(constraints, row_reqs))
        tokens, logprobs = out.tokens, out.logprobs
        dead.update(row_reqs[j] for j in out.no_token_rows)
        off, rejected = 0, {}
        for r, m in zip(inputs.sample_rows, spec_lens, strict=True):
            st = self.states[req_ids[r]]
            if req_ids[r] in dead:  # failed by execute: nothing sampled, no draft verified
                off += m + 1
                continue
            targets = tokens[off : off + m + 1]
            n = accepted_prefix(targets, st.spec_ids) + 1
            sampled[r] = tuple(targets[:n])
            lps[r] = tuple(lp for lp in logprobs[off : off + n] if lp is not None)
            st.token_ids.extend(targets[:n])
            st.output_ids.extend(targets[:n])
            if m:
                rejected[req_ids[r]] = m - (n - 1)
                self.spec.record(req_ids[r], m, n - 1)
            st.spec_ids = []
            off += m + 1
        return rejected

    def _propose(
        self,
        req_ids: tuple[str, ...],
        sampled: list[tuple[int, ...]],
        hidden: torch.Tensor,
        inputs: StepInputs,
        starts: list[int],
    ) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The next step's drafts (the states hold this step's tokens and KV counts)."""
        rows = inputs.meta.query_start_loc.tolist()
        steps = [
            (rid, self.states[rid], bool(tok), rows[i], starts[i])
            for i, (rid, tok) in enumerate(zip(req_ids, sampled, strict=True))
        ]
        return self.spec.propose(steps, hidden)

    def _pool(
        self, hidden: torch.Tensor, inputs: StepInputs, req_ids: tuple[str, ...]
    ) -> tuple[tuple[str, tuple[float, ...]], ...]:
        """Embeddings of the requests whose whole prompt ran in this step (``pooling`` is set by the engine)."""
        if self.pooling is None:
            raise ValueError("this engine does not serve embeddings (start it with --task embed)")
        starts = inputs.meta.query_start_loc.tolist()
        out = []
        for row in inputs.pool_rows:
            st = self.states[req_ids[row]]
            if st.num_computed != 0:
                raise ValueError("an embedding request must run its whole prompt in one step")
            span = hidden[starts[row] : starts[row + 1]]
            loc = torch.tensor([0, span.shape[0]], dtype=torch.int32, device=span.device)
            dims = st.pooling.dimensions if st.pooling is not None else None
            out.append((req_ids[row], tuple(pool(span, loc, self.pooling, dims)[0].tolist())))
        return tuple(out)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: PromptLogprobRows
    ) -> tuple[str, int, tuple[Logprobs, ...]]:
        """Raw-logit logprobs of the next prompt tokens, in slices so the logits stay small."""
        entries: list[Logprobs] = []
        for s in range(0, len(rows.hidden_idx), _PROMPT_LOGITS_SLICE):
            idx = torch.tensor(
                rows.hidden_idx[s : s + _PROMPT_LOGITS_SLICE], dtype=torch.long, device=self.device
            )
            lp = torch.log_softmax(self._logits(hidden, idx), dim=-1)
            entries.extend(batch_logprobs(lp, rows.targets[s : s + _PROMPT_LOGITS_SLICE], rows.top_n))
        return rows.req_id, rows.first, tuple(entries)

    def _row(self, req_id: str) -> SamplingRow:
        st = self.states[req_id]
        return SamplingRow(st.params, st.prompt_ids, st.output_ids, st.stop_ids)


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Block-major layout: one block of all layers is contiguous (one region to ferry per block)."""
    return (num_blocks, cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elems = cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim
    return elems * torch.empty((), dtype=dtype).element_size()


def _mask_rows(constraints: StepConstraints | None, sampling: list[str]) -> TokenMask | None:
    """(logit rows, bitmask rows, bitmask) of the sampling requests that carry a grammar."""
    if constraints is None:
        return None
    pairs = [(i, constraints.rows[rid]) for i, rid in enumerate(sampling) if rid in constraints.rows]
    if not pairs:
        return None
    logit_rows, mask_rows = zip(*pairs, strict=True)
    return TokenMask(torch.tensor(logit_rows), torch.tensor(mask_rows), constraints.bitmask)
