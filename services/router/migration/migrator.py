"""Migrator: which streams can be migrated, what their engine body needs for it, and the migration metric."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from services.common.openai.protocol_structured import CONSTRAINT_FIELDS
from services.router.metrics import outcome_counter
from services.router.migration.migration_settings import MigrationSettings
from services.router.migration.splice import Splice
from services.router.prompt import PreparedRequest

if TYPE_CHECKING:
    from services.router.router_state import RouterState

# A resumed engine would restart these from the beginning (a grammar's state, the echoed prompt, images)
_NOT_RESUMABLE = (*CONSTRAINT_FIELDS, "structured_outputs_after", "echo", "multi_modal_data")
OUTCOMES = ("resumed", "moved", "exhausted", "refused")


def migration_counter(registry: CollectorRegistry) -> Counter:
    """``kvferry_router_migrations_total{outcome}`` in ``registry``, every outcome declared."""
    return outcome_counter(
        "kvferry_router_migrations",
        "Streams whose engine failed or drained mid-way, by outcome: resumed on another engine (it "
        "recomputed the tokens so far), moved (a draining decode handed its KV to the next engine), "
        "exhausted (--migration-attempts reached) or refused (no engine could take the continuation).",
        OUTCOMES,
        registry,
    )


class Migrator:
    """Decides which streams can move and prepares them (a Splice); counts migrations by outcome."""

    def __init__(self, state: RouterState, settings: MigrationSettings) -> None:
        self.state = state
        self.settings = settings
        self.migrations = migration_counter(state.metrics.registry)

    def count(self, outcome: str) -> None:
        self.migrations.labels(outcome=outcome).inc()

    def prepare(self, req: PreparedRequest) -> Splice | None:
        """A Splice for a stream that can move (one prompt, one choice, nothing an engine restarts), its
        engine body asking for token ids; None for any other request (left as it is)."""
        body = req.engine_body
        if not self.settings.attempts or not req.stream or req.n != 1 or len(req.prompts) != 1:
            return None
        if any(body.get(k) for k in _NOT_RESUMABLE):
            return None
        stop = body.get("stop") or ()
        splice = Splice(
            prompt=list(req.prompts[0]),
            stops=(stop,) if isinstance(stop, str) else tuple(stop),
            client_wants_ids=bool(body.get("return_token_ids")),
            skip_special=body.get("skip_special_tokens", True),
        )
        # a draining decode hands this stream's KV on (its last chunk names it) instead of dropping it
        req.engine_body = {**body, "return_token_ids": True, "kv_transfer_params": {"migrate_on_drain": True}}
        if (
            body.get("seed") is None and body.get("temperature") != 0
        ):  # a continuation draws what it would have
            req.engine_body["seed"] = secrets.randbits(31)
        return splice
