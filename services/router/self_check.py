"""SelfCheck: engines agree with the router on model, block size and hash version, and the index sees
a probe prompt's blocks once it is served. Any problem makes /health an error and is logged loudly
(engines that differ only in max_model_len are logged as a warning: the router uses the smallest)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from services.common.kv.hashing import HASH_VERSION, BlockHasher
from services.common.kv.prefix_index import AsyncPrefixIndex
from services.router.context_limit import disagreement
from services.router.endpoints import EndpointPoller
from services.router.engine_client import EngineClient
from services.router.metrics import RouterMetrics
from services.router.scheduling import Endpoint

log = logging.getLogger(__name__)

PROBE_TEXT = "kvferry router self-check probe: the quick brown fox jumps over the lazy dog. "
_RETRY_S = 2.0


def config_problems(endpoints: Sequence[Endpoint], model: str, block_size: int) -> list[str]:
    """Every healthy engine whose kvferry_cache_config_info differs from the router's settings."""
    want = (model, block_size, HASH_VERSION)
    out = []
    for e in endpoints:
        if not e.healthy or e.cache_config is None:
            continue
        c = e.cache_config
        if (c.model, c.block_size, c.hash_version) != want:
            out.append(
                f"{e.url} has model={c.model!r} block_size={c.block_size} hash_version={c.hash_version}, "
                f"the router model={model!r} block_size={block_size} hash_version={HASH_VERSION}"
            )
    return out


class SelfCheck:
    """Runs at start-up (once an engine is healthy) and every ``interval_s``; sooner while failing."""

    def __init__(
        self,
        poller: EndpointPoller,
        client: EngineClient,
        index: AsyncPrefixIndex | None,
        hasher: BlockHasher,
        probe_ids: list[int],
        metrics: RouterMetrics,
        interval_s: float = 60.0,
        probe_timeout_s: float = 10.0,
    ) -> None:
        self.poller, self.client, self.index, self.hasher = poller, client, index, hasher
        self.probe_ids = probe_ids
        self.probe_hashes = hasher.hash_tokens(probe_ids)
        self.metrics = metrics
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.probe_problems: list[str] = []
        self.done = False
        self._length_warning: str | None = None

    def problems(self) -> list[str]:
        """What is wrong now: config disagreement (live), failed probes (last run), no engine, not run."""
        endpoints = self.poller.endpoints()
        out = config_problems(endpoints, self.hasher.model_id, self.hasher.block_size) + self.probe_problems
        if not any(e.healthy and not e.draining for e in endpoints):
            out.append("no healthy engine")
        elif not self.done:
            out.append("self-check has not run yet")
        return out

    async def run_once(self) -> list[str]:
        """Probe every healthy engine that serves whole requests; return (and keep) the problems found."""
        endpoints = [
            e for e in self.poller.endpoints() if e.healthy and not e.draining and e.role != "prefill"
        ]
        problems = config_problems(self.poller.endpoints(), self.hasher.model_id, self.hasher.block_size)
        self._warn_lengths()
        probed: list[str | None] = []
        if self.index is not None and not problems:
            probed = await asyncio.gather(*(self._probe(e) for e in endpoints))
        self.probe_problems = [p for p in probed if p]
        self.done = self.done or bool(endpoints)
        problems += self.probe_problems
        self.metrics.self_check_ok.set(1 if self.done and not problems else 0)
        for p in problems:
            log.error("SELF-CHECK FAILED: %s (prefix-aware routing cannot work until this is fixed)", p)
        return problems

    def _warn_lengths(self) -> None:
        """Log engines that disagree on max_model_len, once per distinct disagreement."""
        warning = disagreement(self.poller.endpoints())
        if warning is not None and warning != self._length_warning:
            log.warning("self-check: %s", warning)
        self._length_warning = warning

    async def _probe(self, endpoint: Endpoint) -> str | None:
        body = {"prompt": self.probe_ids, "max_tokens": 1, "temperature": 0.0}
        try:
            await self.client.complete(
                endpoint.url, body, {"X-Request-Id": "router-self-check"}, timeout_s=self.probe_timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - a probe never crashes the router
            log.warning("self-check probe on %s could not be served: %s", endpoint.url, exc)
            return None  # the poller takes a failing engine out; that is not a config problem
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.probe_timeout_s
        while True:
            assert self.index is not None
            matches = await self.index.lookup(self.probe_hashes)
            if matches is None:
                return None  # Redis down: routing degrades to load only, counted elsewhere
            held = {m.url.rstrip("/"): m.longest for m in matches.values()}
            if held.get(endpoint.url, 0) >= len(self.probe_hashes):
                return None
            if loop.time() > deadline:
                return (
                    f"{endpoint.url} served the probe but the index lists {held.get(endpoint.url, 0)} of its "
                    f"{len(self.probe_hashes)} blocks under that url (index urls: {sorted(held)}); check the "
                    "engine's --redis-url, --advertise-url, model name and block size"
                )
            await asyncio.sleep(0.1)

    async def run_forever(self) -> None:
        """The periodic loop (a task of the app); retries every few seconds while not passing."""
        while True:
            try:
                problems = (
                    await self.run_once() if any(e.healthy for e in self.poller.endpoints()) else ["none"]
                )
            except Exception:  # noqa: BLE001 - the loop must survive any one bad round
                log.exception("self-check round failed")
                problems = ["error"]
            await asyncio.sleep(self.interval_s if not problems else min(_RETRY_S, self.interval_s))


def probe_ids(encode: list[int], block_size: int, blocks: int = 2) -> list[int]:
    """Exactly ``blocks`` full blocks of ids, repeating ``encode`` as needed."""
    need = block_size * blocks
    ids = list(encode) or [0]
    while len(ids) < need:
        ids += ids
    return ids[:need]
