"""SimEngine: the engine's own scheduler and block pool, with a timing model in place of the model run."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.kv.hashing import HASH_VERSION, BlockHasher
from services.common.kv.kv_events import KVEvent
from services.common.kv.kv_transfer import KVTransferParams
from services.common.kv.prefix_index import EngineRef, PrefixIndex
from services.common.pool.roles import RoleName
from services.engine.core.kv_cache_manager import KVCacheManager
from services.engine.core.kv_connector import KVConnector, compose
from services.engine.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.router.scheduling import Endpoint, EndpointLoad
from services.sim.sim_connector import SimPullConnector
from services.sim.sim_kvstore import SimKVStore
from services.sim.sim_kvstore_connector import SimKVStoreConnector
from services.sim.timing_model import TimingModel
from services.sim.virtual_clock import VirtualClock

ITL_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))


# (request id, new tokens, finished, cached prompt tokens): called at the end of each step that produced some
TokenListener = Callable[[str, int, bool, int], None]


@dataclass
class EngineStats:
    """What the engine's /metrics would count (the autoscaler's and the report's inputs)."""

    steps: int = 0
    busy_s: float = 0.0
    prompt_tokens_total: int = 0
    computed_prompt_tokens: int = 0
    first_tokens: int = 0  # requests that got their first token (the TTFT histogram's count)
    events_published: int = 0
    batches_published: int = 0
    itl_counts: list[int] = field(default_factory=lambda: [0] * len(ITL_BOUNDS))


class SimEngine:
    """One simulated engine: ``submit`` a request, tokens come back through its listener at step ends.

    Admission, chunked prefill, prefix hits, preemption and eviction are the engine core's own code
    (services.engine.core: Scheduler, KVCacheManager, BlockPool); only the forward pass is replaced by
    ``TimingModel.step_s`` on the virtual clock. Each step's KV events go to the real Redis index as
    one numbered batch, as the engine's publisher writes them. With the pool's ``kvstore``, the engine
    fetches missing prefixes from it and offloads finished prompts, as its kvstore connector does.
    """

    def __init__(
        self,
        engine_id: str,
        role: RoleName,
        timing: TimingModel,
        clock: VirtualClock,
        hasher: BlockHasher,
        index: PrefixIndex | None,
        enable_caching: bool = True,
        kvstore: SimKVStore | None = None,
    ) -> None:
        self.ref = EngineRef(engine_id, f"{engine_id}-sim", f"http://sim/{engine_id}")
        self.role = role
        self.timing = timing
        self.clock = clock
        self.hasher = hasher
        self.index = index
        self.kv = KVCacheManager(timing.num_kv_blocks, timing.block_size, enable_caching)
        self.kv.pool.record_events = index is not None
        connectors: list[KVConnector] = [
            SimPullConnector(clock, timing.transfer_s_per_block, timing.block_size, self.wake)
        ]
        if kvstore is not None:  # as the roles compose them: the P/D connector first, then the kvstore tier
            s_per_block, offload = timing.kvstore_fetch_s_per_block, role != "decode"
            connectors.append(
                SimKVStoreConnector(kvstore, clock, s_per_block, timing.block_size, self.wake, offload)
            )
        connector = compose(connectors)
        config = SchedulerConfig(
            max_num_seqs=timing.max_num_seqs,
            max_num_batched_tokens=timing.max_num_batched_tokens,
            max_model_len=timing.max_model_len,
        )
        self.scheduler = Scheduler(config, self.kv, connector)
        self.stats = EngineStats()
        self.draining = False
        self._outputs: dict[str, list[int]] = {}
        self._listeners: dict[str, TokenListener] = {}
        self._last_token_at: dict[str, float] = {}
        self._started: set[str] = set()  # requests whose first token is out
        self._pending: SchedulerOutput | None = None
        self._stepping = False
        self._seq = 0
        self.event_log: list[KVEvent] | None = None  # parity checks keep every event here
        if index is not None:
            index.replace(self.ref, 0, {})

    @property
    def url(self) -> str:
        return self.ref.url

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        output: list[int],
        listener: TokenListener,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> None:
        """Queue one request that emits exactly ``output`` (its length is the request's max_tokens)."""
        params = SamplingParams(max_tokens=len(output), ignore_eos=True, temperature=0.0)
        request = Request(
            request_id,
            prompt,
            params,
            None,
            hash_fn=lambda hashes, toks: self.hasher.extend(hashes, toks),
            arrival_time=self.clock.now,
            kv_transfer_params=kv_transfer_params,
        )
        self.scheduler.add_request(request)
        self._outputs[request_id] = output
        self._listeners[request_id] = listener
        self.stats.prompt_tokens_total += len(prompt)
        self.wake()

    def wake(self) -> None:
        """Start stepping now unless a step is already under way."""
        if not self._stepping:
            self._stepping = True
            self.clock.call_at(self.clock.now, self._step)

    def _step(self) -> None:
        if self._pending is not None:
            self._finish(self._pending)
            self._pending = None
        sched = self.scheduler.schedule()
        self._publish()
        if sched.is_empty:
            self._stepping = False
            return
        dt = self._step_time(sched)
        self.stats.steps += 1
        self.stats.busy_s += dt
        self._pending = sched
        self.clock.call_later(dt, self._step)

    def _step_time(self, sched: SchedulerOutput) -> float:
        prefill = seqs = context = 0
        attended = 0.0  # prefill tokens x the tokens each attends to (its cached prefix, half its chunk)
        for rid, n in sched.num_scheduled_tokens:
            req = self.scheduler.requests[rid]
            if req.num_computed_tokens >= req.num_prompt_tokens:
                seqs += 1
                context += req.num_computed_tokens
            else:
                prefill += n
                attended += n * (req.num_computed_tokens + n / 2)
        self.stats.computed_prompt_tokens += prefill
        return self.timing.step_s(prefill, seqs, context, attended)

    def _finish(self, sched: SchedulerOutput) -> None:
        """The model ran: each request whose scheduled tokens reach its end samples its next token."""
        ids, sampled = [], []
        for rid, n in sched.num_scheduled_tokens:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            ids.append(rid)
            done = req.num_computed_tokens + n >= req.num_tokens
            sampled.append((self._outputs[rid][req.num_output_tokens],) if done else ())
        result = ModelRunnerOutput(tuple(ids), tuple(sampled), tuple(() for _ in ids))
        for out in self.scheduler.update_from_output(sched, result):
            self._deliver(out)

    def _deliver(self, out: EngineCoreOutput) -> None:
        rid, now, finished = out.req_id, self.clock.now, out.finish_reason is not None
        last = self._last_token_at.get(rid)
        if out.new_token_ids and rid not in self._started:
            self._started.add(rid)
            self.stats.first_tokens += 1
        if last is not None and out.new_token_ids:
            i = bisect.bisect_left(ITL_BOUNDS, now - last)
            self.stats.itl_counts[i] += 1
        self._last_token_at[rid] = now
        listener = self._listeners[rid]
        if finished:
            del self._listeners[rid], self._outputs[rid], self._last_token_at[rid]
            self._started.discard(rid)
        listener(rid, len(out.new_token_ids), finished, out.num_cached_tokens)

    def keep_events(self) -> list[KVEvent]:
        """Keep every KV event from now on (parity checks); the list fills as the engine steps."""
        self.kv.pool.record_events = True
        self.event_log = []
        return self.event_log

    def _publish(self) -> None:
        events = self.kv.pool.take_events()
        if not events:
            return
        if self.event_log is not None:
            self.event_log.extend(events)
        if self.index is None:
            return
        self._seq += 1
        self.index.apply(self.ref, self._seq, events)
        self.stats.batches_published += 1
        self.stats.events_published += sum(len(getattr(e, "block_hashes", ())) or 1 for e in events)

    def endpoint(self) -> Endpoint:
        """What the router's poller would read from this engine's /metrics now."""
        s = self.scheduler
        load = EndpointLoad(
            waiting=s.num_waiting + len(s.loading), running=s.num_running, kv_usage=self.kv.usage
        )
        return Endpoint(self.url, self.role, True, self.draining, load, None, self.timing.max_model_len)

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_unfinished()

    def close(self) -> None:
        """Deregister from the index (its blocks stop counting at once)."""
        if self.index is not None:
            self.index.deregister(self.ref)


def make_hasher(model_name: str, block_size: int) -> BlockHasher:
    return BlockHasher(model_name, block_size, HASH_VERSION)
