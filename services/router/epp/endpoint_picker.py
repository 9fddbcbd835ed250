"""EndpointPicker: one gateway request -> the engines that should serve it, by the router's own pipeline.

The body is validated, templated, tokenized and hashed by the router's PromptPreparer, looked up in the
prefix index (RouterState.context) and scheduled by the router's Scheduler: the same code path as a
request the router serves itself, minus the P/D split (a gateway sends the request to ONE engine, so the
EPP serves aggregated pools: engines of role ``both``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from services.common.openai.errors import bad_request, model_not_found, parse_body, unauthorized
from services.common.openai.http_middleware import tenant_of
from services.common.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.router.admission.admission import BAND_HEADER, Lease
from services.router.context_limit import check_prompt_fits
from services.router.epp.addresses import endpoint_address
from services.router.pd_flow import no_endpoint
from services.router.priority_gate import check_priority
from services.router.prompt import PreparedRequest
from services.router.router_state import RouterState
from services.router.scheduling import Endpoint, RequestContext, RouteDecision

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pick:
    """The endpoints (``ip:port``, primary first, then fallbacks by score) and the decision behind them."""

    endpoints: tuple[str, ...]
    decision: RouteDecision
    headers: Mapping[str, str] = field(default_factory=dict)  # set on the request the gateway forwards
    lease: Lease | None = None  # the admission slot: given back when the gateway's stream ends


class EndpointPicker:
    """Picks among a RouterState's aggregated engines; raises OpenAIError for what the client must see."""

    def __init__(self, state: RouterState, fallbacks: int = 0) -> None:
        self.state = state
        self.fallbacks = fallbacks
        self._api_keys = [k.encode() for k in state.settings.api_keys]
        key = state.settings.engine_api_key  # the engines' pool-internal key: it replaces the client's
        self._engine_headers = {"authorization": f"Bearer {key}"} if key else {}

    def candidates(self, subset: frozenset[str] | None) -> list[Endpoint]:
        """Aggregated engines with an ``ip:port`` address, within the data plane's subset when it gave one."""
        out = []
        for endpoint in self.state.poller.endpoints():
            address = endpoint_address(endpoint.url)
            if endpoint.role != "both" or address is None:
                continue
            if subset is None or address in subset:
                out.append(endpoint)
        return out

    async def pick(
        self,
        headers: Mapping[str, str],
        body: bytes,
        subset: frozenset[str] | None = None,
        arrival: float | None = None,
    ) -> Pick:
        """The pick for one request (``headers`` lower-cased, with the ``:path`` pseudo-header);
        ``arrival`` (perf_counter) is when its headers reached the EPP (the routing overhead starts there)."""
        path = headers.get(":path", "").split("?", 1)[0]
        token = None
        if self._api_keys and path.startswith("/v1"):
            token = self._authorize(headers)
        if subset is not None and not subset:
            raise no_endpoint("the gateway's endpoint subset is empty")
        pool = self.candidates(subset)
        prepared = (
            self._prepare(path, body, token) if path in ("/v1/completions", "/v1/chat/completions") else None
        )
        if prepared is None:
            ctx = RequestContext(0, self.state.settings.block_size, {}, splittable=False)
        else:
            if arrival is not None:
                prepared.arrival = arrival
            check_prompt_fits(prepared, self.state.max_model_len())
            ctx = replace(await self.state.context(prepared), splittable=False)
        lease = await self._admit(headers, token, prepared)
        decision = self.state.flow.scheduler.schedule(pool, ctx)
        if decision is None:
            if lease is not None:
                lease.cancel()
            self.state.metrics.requests.labels(decision="no_endpoint").inc()
            where = "in the gateway's subset" if subset is not None else "in the pool"
            raise no_endpoint(f"no healthy aggregated engine {where}")
        if prepared is not None:
            self.state.flow.record(decision, prepared, ctx)
            # the pool page's decision log: Envoy's x-request-id names the request (attempt 0: Envoy retries)
            self.state.note_route(decision, prepared, ctx, headers.get("x-request-id", "epp"), 0)
        return Pick(self._ranked(decision, pool), decision, self._engine_headers, lease)

    async def _admit(
        self, headers: Mapping[str, str], token: bytes | None, prepared: PreparedRequest | None
    ) -> Lease | None:
        """The router's admission (tenant, band, quota, the flow-control queue) for a generation request."""
        admission = self.state.admission
        if prepared is None or admission is None:
            return None
        key_id = tenant_of(token) if token else None
        band = headers.get(BAND_HEADER)
        return await admission.admit(key_id, band, prepared.prompt_tokens, prepared.max_output_tokens)

    def _authorize(self, headers: Mapping[str, str]) -> bytes:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in self._api_keys:  # constant time over every key, as the router's middleware
            matched |= secrets.compare_digest(given, key)
        if not matched:
            raise unauthorized()
        return given

    def _prepare(self, path: str, body: bytes, token: bytes | None) -> PreparedRequest:
        """The request as the router would prepare it (400 for a bad body, 404 for an unknown model, 403 for
        a priority this key may not set: the gateway passes the body on unchanged)."""
        if not body:
            raise bad_request("The request has no body: a JSON object is required.")
        state = self.state
        state.tokenizer.max_text_tokens = state.max_model_len()
        if path == "/v1/completions":
            completion = parse_body(CompletionRequest, body)
            check_priority(state.settings, completion.priority, token)
            return state.preparer.completion(completion, self._adapter(completion.model))
        chat = parse_body(ChatCompletionRequest, body)
        check_priority(state.settings, chat.priority, token)
        return state.preparer.chat(chat, self._adapter(chat.model))

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 when no engine serves it."""
        if model is None or model == self.state.settings.model_name:
            return None
        if model in self.state.lora_adapters():
            return model
        raise model_not_found(model)

    def _ranked(self, decision: RouteDecision, pool: Sequence[Endpoint]) -> tuple[str, ...]:
        """The chosen engine, then up to ``fallbacks`` others by descending score."""
        scores = decision.decode_choice.scores
        others = sorted(
            (e for e in pool if e.url != decision.decode.url and e.healthy and not e.draining),
            key=lambda e: -scores.get(e.url, 0.0),
        )
        chosen = [decision.decode, *others[: self.fallbacks]]
        return tuple(a for a in (endpoint_address(e.url) for e in chosen) if a is not None)
