"""EndpointPoller: polls every engine's /health and /metrics, keeping a fresh Endpoint snapshot of each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import httpx
from pydantic import BaseModel, Field

from services.common.pool.load_report import LoadReport, parse_load_report
from services.router.scheduling.endpoint import CacheConfig, Endpoint, EndpointLoad, Role, normalize_url

log = logging.getLogger(__name__)


class EndpointSpec(BaseModel):
    """One engine the router was told about (flags or discovery)."""

    url: str
    role: Role = "both"
    draining: bool = False  # e.g. annotated by the operator for scale-down: finish, but take nothing new


class _ModelCard(BaseModel):
    """The fields of an engine's /v1/models cards the router reads (the others are ignored)."""

    id: str = ""
    parent: str | None = None  # set on LoRA adapter cards
    max_model_len: int | None = Field(None, ge=1)


class _ModelList(BaseModel):
    data: list[_ModelCard] = Field(default_factory=list)


_LORA_INFO = "kvferry_lora_requests_info"  # on the /metrics page of engines started with --enable-lora


class PollerSettings(BaseModel):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    # A healthy engine whose polls time out stays in rotation until this many in a row did (a busy engine
    # answers late: a long prefill step holds its event loop); a refused connection or an error status
    # takes it out at once.
    slow_polls_out: int = Field(3, ge=1)


def parse_metrics(text: str) -> tuple[EndpointLoad, CacheConfig | None]:
    """Load gauges and the cache-config info of an engine's Prometheus text (missing ones read 0)."""
    report = parse_load_report(text)
    return _load_of(report), report.cache_config


def _load_of(report: LoadReport) -> EndpointLoad:
    return EndpointLoad(int(report.waiting), int(report.running), report.kv_usage)


# Called after every poll with each engine's report (None: that engine's poll failed), e.g. the pool page.
PollListener = Callable[[Mapping[str, LoadReport | None]], None]


def _is_draining(response: httpx.Response) -> bool:
    return response.status_code == 503 and "draining" in response.text.lower()


class EndpointPoller:
    """Engines start out unhealthy; a poll where /health answers 200 and /metrics parses puts one in
    (its /v1/models card is read then, for max_model_len), any failure takes it out (its last load is
    kept) except a time-out, which does only after ``slow_polls_out`` in a row; a 503 that says
    "draining" marks it draining."""

    def __init__(
        self,
        specs: Sequence[EndpointSpec],
        settings: PollerSettings | None = None,
        client: httpx.AsyncClient | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings or PollerSettings()
        self._client = client or httpx.AsyncClient(timeout=self.settings.timeout_s, headers=headers)
        self._owns_client = client is None
        self._endpoints: dict[str, Endpoint] = {}
        self._draining: set[str] = set()
        self._slow: dict[str, int] = {}  # url -> polls in a row that timed out
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[PollListener] = []
        self.set_specs(specs)

    def set_specs(self, specs: Sequence[EndpointSpec]) -> None:
        """Replace the set of engines (discovery); known ones keep their state, new ones start out."""
        fresh = {}
        self._draining = {normalize_url(s.url) for s in specs if s.draining}
        for spec in specs:
            url = normalize_url(spec.url)
            old = self._endpoints.get(url)
            fresh[url] = (
                Endpoint(url, spec.role, healthy=False) if old is None or old.role != spec.role else old
            )
            if spec.draining and fresh[url].healthy:
                fresh[url] = replace(fresh[url], draining=True)
        self._endpoints = fresh

    def endpoints(self) -> list[Endpoint]:
        """The current snapshot of every endpoint (healthy or not)."""
        return list(self._endpoints.values())

    async def poll_once(self) -> list[Endpoint]:
        """Poll every endpoint concurrently and publish the new snapshots."""
        current = self.endpoints()
        results = await asyncio.gather(*(self._poll(e) for e in current))
        polled = [endpoint for endpoint, _ in results]
        for old, new in zip(current, polled, strict=True):
            if old.healthy != new.healthy or old.draining != new.draining:
                state = "draining" if new.draining else "healthy" if new.healthy else "unhealthy"
                log.log(logging.INFO if new.healthy else logging.WARNING, "endpoint %s is %s", new.url, state)
            if new.url in self._endpoints:  # not dropped by set_specs meanwhile
                self._endpoints[new.url] = new
        reports = {e.url: report for e, report in results if e.url in self._endpoints}
        for listener in self.listeners:
            listener(reports)
        return self.endpoints()

    async def _poll(self, endpoint: Endpoint) -> tuple[Endpoint, LoadReport | None]:
        down = replace(endpoint, healthy=False, draining=False)  # last load, config and context length kept
        try:
            health, metrics = await asyncio.gather(
                self._client.get(f"{endpoint.url}/health"), self._client.get(f"{endpoint.url}/metrics")
            )
        except httpx.TimeoutException:
            slow = self._slow[endpoint.url] = self._slow.get(endpoint.url, 0) + 1
            if endpoint.healthy and slow < self.settings.slow_polls_out:
                log.info("endpoint %s: poll timed out (%d in a row); kept in rotation", endpoint.url, slow)
                return endpoint, None
            return down, None
        except httpx.HTTPError:
            return down, None
        self._slow.pop(endpoint.url, None)
        if _is_draining(health):
            return replace(endpoint, healthy=True, draining=True), None
        drained = endpoint.url in self._draining
        if health.status_code != 200 or metrics.status_code != 200:
            return down, None
        try:
            report = parse_load_report(metrics.text)
        except ValueError:
            log.warning("endpoint %s: unreadable /metrics", endpoint.url)
            return down, None
        # The cards are read when an engine (re)joins (a restarted engine may have a new context length),
        # and on every poll of an engine serving LoRA adapters (they are loaded and unloaded at runtime).
        lora = _LORA_INFO in metrics.text
        limit: int | None = endpoint.max_model_len if endpoint.healthy else None
        adapters = endpoint.lora_adapters
        if limit is None or lora:
            fetched, adapters = await self._cards(endpoint.url)
            limit = fetched or limit
        fresh = replace(
            endpoint,
            healthy=True,
            draining=drained,
            load=_load_of(report),
            cache_config=report.cache_config or endpoint.cache_config,
            max_model_len=limit,
            lora_adapters=adapters,
        )
        return fresh, report

    async def _cards(self, url: str) -> tuple[int | None, frozenset[str]]:
        """The context length and the LoRA adapters on the engine's /v1/models cards (None / empty: no answer)."""
        try:
            reply = await self._client.get(f"{url}/v1/models")
            reply.raise_for_status()
            cards = _ModelList.model_validate_json(reply.content).data
        except (httpx.HTTPError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            log.debug("endpoint %s: no cards from /v1/models (%s)", url, exc)
            return None, frozenset()
        lengths = [c.max_model_len for c in cards if c.max_model_len]
        adapters = frozenset(c.id for c in cards if c.parent and c.id)
        return (min(lengths) if lengths else None), adapters

    async def run(self) -> None:
        """Poll forever, every ``interval_s``; a failing round never stops the loop."""
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad answer
                log.exception("endpoint poll failed")
            await asyncio.sleep(self.settings.interval_s)

    def start(self) -> None:
        """Run the loop as a task of the current event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="endpoint-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._owns_client:
            await self._client.aclose()
