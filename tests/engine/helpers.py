"""Model-free drivers for scheduler tests: requests with real hashes and a fake runner that samples."""

from __future__ import annotations

import random

from services.common.kv.hashing import BlockHasher
from services.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams

HASHER = BlockHasher("test-model", 4)


def make_request(rid: str, tokens: list[int], max_tokens: int = 4, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=kw.pop("ignore_eos", True))
    return Request(rid, tokens, params, eos_token_id=0, hash_fn=HASHER.extend, **kw)


class FakeRunner:
    """Tracks what the runner would know and samples a random token when a request reaches its end.

    ``num_drafts``: it also proposes that many random drafts for each sampling request, and accepts a
    random prefix of the drafts it verifies (as speculative decoding would).
    """

    def __init__(self, seed: int = 0, num_drafts: int = 0) -> None:
        self.rng = random.Random(seed)
        self.num_tokens: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.num_drafts = num_drafts

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.num_tokens.pop(rid, None)
        for new in sched.new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in sched.cached_reqs:
            assert self.computed[cached.req_id] == cached.num_computed_tokens
        ids, sampled, proposed = [], [], []
        drafts = dict(sched.spec_token_ids)
        for rid, n in sched.num_scheduled_tokens:
            d = drafts.get(rid, ())
            self.computed[rid] += n
            assert self.computed[rid] <= self.num_tokens[rid] + len(d)
            ids.append(rid)
            if self.computed[rid] == self.num_tokens[rid] + len(d):
                accepted = self.rng.randint(0, len(d))
                self.computed[rid] -= len(d) - accepted
                self.num_tokens[rid] += accepted + 1
                sampled.append((*d[:accepted], self.rng.randrange(1, 50)))
                if self.num_drafts:
                    proposed.append((rid, tuple(self.rng.randrange(1, 50) for _ in range(self.num_drafts))))
            else:
                sampled.append(())
        return ModelRunnerOutput(tuple(ids), tuple(sampled), ((),) * len(ids), spec_token_ids=tuple(proposed))
