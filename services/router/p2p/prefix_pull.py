"""PrefixPull: before a request goes to the engine picked for it, lease a long prefix another engine holds."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from services.common.kv.kv_transfer import EXPORT_PATH, KVTransferParams
from services.common.openai.errors import OpenAIError
from services.common.pool.pool_secret import auth_headers
from services.router.engine_client import EngineClient, EngineUnavailable
from services.router.metrics import outcome_counter
from services.router.p2p.p2p_settings import P2PSettings
from services.router.scheduling import Endpoint, RequestContext, RouteDecision

log = logging.getLogger(__name__)

# leased: the picked engine is sent the holder's params (it READs, or counts why it could not and recomputes);
# holder_unreachable / not_cached / refused / bad_answer: no params, the picked engine computes the prompt
OUTCOMES = ("leased", "holder_unreachable", "not_cached", "refused", "bad_answer")


def p2p_counter(registry: CollectorRegistry) -> Counter:
    """``kvferry_router_p2p_pulls_total{outcome}`` in ``registry``, every outcome declared."""
    return outcome_counter(
        "kvferry_router_p2p_pulls",
        "Prefix pulls from a peer engine (--p2p-min-tokens), by outcome: leased (the picked engine was "
        "sent the holder's blocks), holder_unreachable, not_cached (the holder no longer had them), "
        "refused (a 4xx) or bad_answer; all but leased recompute the prompt on the picked engine.",
        OUTCOMES,
        registry,
    )


class PrefixPull:
    """Finds a holder with ``min_tokens`` more of the prompt in its primary pool than the picked engine has in
    any tier (the prefix index says), and asks it over ``/kv/export`` for do_remote_prefill params."""

    def __init__(self, settings: P2PSettings, client: EngineClient, registry: CollectorRegistry) -> None:
        self.settings, self.client = settings, client
        self._headers = auth_headers(settings.pool_secret)
        self.pulls = p2p_counter(registry)

    def holder(
        self, decision: RouteDecision, ctx: RequestContext, endpoints: Sequence[Endpoint]
    ) -> Endpoint | None:
        """The healthy engine (not the picked one) holding the most of the prompt's leading blocks in its
        primary pool, when it beats the picked engine by ``min_tokens`` or more."""
        if (
            not self.settings.enabled
            or ctx.matches is None
            or not ctx.block_size
            or decision.prefill is not None
        ):
            return None
        chosen, best, best_tokens = decision.decode, None, 0
        for e in endpoints:
            m = ctx.matches.get(e.url)
            if e.url == chosen.url or not e.healthy or m is None or e.role == "prefill":
                continue
            tokens = min(m.gpu * ctx.block_size, ctx.prompt_tokens)
            if tokens > best_tokens:
                best, best_tokens = e, tokens
        if best is None or best_tokens - ctx.cached_tokens(chosen) < self.settings.min_tokens:
            return None
        return best

    async def lease(
        self, holder: Endpoint, block_hashes: Sequence[bytes], lora_name: str | None
    ) -> dict[str, Any] | None:
        """The holder's do_remote_prefill params for the prompt's leading blocks; None (counted) on any failure."""
        body = {"block_hashes": [h.hex() for h in block_hashes], "lora_name": lora_name}
        try:
            answer = await self.client.complete(
                holder.url, body, self._headers, timeout_s=self.settings.timeout_s, path=EXPORT_PATH
            )
            params = KVTransferParams.model_validate(answer)
            if not params.do_remote_prefill or not params.remote_block_ids:
                raise ValueError("the answer names no blocks")
        except EngineUnavailable as exc:
            self._failed("holder_unreachable", holder, exc)
            return None
        except OpenAIError as exc:
            self._failed("not_cached" if exc.status == 404 else "refused", holder, exc)
            return None
        except (ValidationError, ValueError) as exc:
            self._failed("bad_answer", holder, exc)
            return None
        self.pulls.labels(outcome="leased").inc()
        return answer

    def _failed(self, outcome: str, holder: Endpoint, exc: Exception) -> None:
        self.pulls.labels(outcome=outcome).inc()
        log.info(
            "prefix pull from %s failed (%s: %s); the picked engine computes the prompt",
            holder.url,
            outcome,
            exc,
        )
