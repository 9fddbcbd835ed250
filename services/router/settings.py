"""RouterSettings: everything one router replica is configured with (flags, validated)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.media.media_settings import MediaLimits, RemoteMedia
from services.router.accuracy.prediction_accuracy import AccuracySettings
from services.router.admission.admission_settings import AdmissionSettings
from services.router.circuit_breaker import BreakerSettings
from services.router.discovery import DiscoverySettings
from services.router.endpoints import EndpointSpec, PollerSettings
from services.router.epp.addresses import endpoint_address
from services.router.epp.epp_settings import EppSettings
from services.router.migration.migration_settings import MigrationSettings
from services.router.p2p.p2p_settings import P2PSettings
from services.router.responses.responses_settings import ResponsesSettings
from services.router.scheduling import SchedulingConfig
from services.router.sessions.session_settings import SessionSettings


class RouterSettings(BaseModel):
    """One router replica. ``model_name`` and ``block_size`` must equal the engines' (self-checked)."""

    model_config = ConfigDict(extra="forbid")

    endpoints: list[EndpointSpec] = Field(default_factory=list)
    discovery: DiscoverySettings | None = None  # Kubernetes: endpoints come from the pool's pods
    tokenizer: Path
    model_name: str = Field(min_length=1)
    block_size: int = Field(16, gt=0)
    redis_url: str | None = None
    api_keys: list[str] = Field(default_factory=list)  # clients' keys (tenants); empty: no auth
    admin_api_keys: list[str] = Field(default_factory=list)  # also open /ui, and only they see request ids
    priority_api_keys: list[str] = Field(default_factory=list)  # client keys that may set `priority`
    salt_from_api_key: bool = False  # each key's requests get their own cache salt: no KV shared
    engine_api_key: str | None = None  # sent to the engines (started with --api-key)
    scheduling: SchedulingConfig = SchedulingConfig()
    poller: PollerSettings = PollerSettings()
    index_budget_s: float = Field(0.02, gt=0, description="Longest a prefix-index lookup may take.")
    self_check_interval_s: float = Field(60.0, gt=0)
    probe_timeout_s: float = Field(10.0, gt=0, description="How long a probe's blocks may take to show up.")
    connect_timeout_s: float = Field(2.0, gt=0)
    request_timeout_s: float | None = Field(
        None, gt=0, description="Read timeout of engine calls (--engine-read-timeout; None: none)."
    )
    prefill_timeout_s: float = Field(60.0, gt=0)
    request_deadline_s: float | None = Field(
        600.0, gt=0, description="Longest a whole request may take (--request-timeout; None: none)."
    )
    # chat shaping, as the engines' flags (the router applies the template and reads tool calls itself)
    chat_template: str | None = None  # template text (--chat-template FILE)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    remote_media: RemoteMedia = RemoteMedia()  # http(s) image / video URLs, as the engines' flags
    limit_mm_per_prompt: MediaLimits = MediaLimits()  # images / videos per request, as the engines' flag
    responses: ResponsesSettings = ResponsesSettings()  # /v1/responses: the store's TTL, cap and key
    sessions: SessionSettings = SessionSettings()  # session affinity (sticky until saturated)
    migration: MigrationSettings = MigrationSettings()  # streams resumed elsewhere when their engine fails
    p2p: P2PSettings = P2PSettings()  # the picked engine READs a long prefix another engine holds
    accuracy: AccuracySettings = AccuracySettings()  # below it an engine is routed by load only
    breaker: BreakerSettings = BreakerSettings()  # retries before the first byte, circuit breakers
    admission: AdmissionSettings = AdmissionSettings()  # tenants, bands, quotas, the flow-control queue
    epp: EppSettings | None = None  # --epp-port: also serve the Gateway API Inference Extension picker

    @model_validator(mode="after")
    def _check_keys(self) -> RouterSettings:
        if self.salt_from_api_key and not self.api_keys:
            raise ValueError("--salt-from-api-key needs client keys (--api-key or --api-key-file)")
        if self.admission.tenants and not self.api_keys:
            raise ValueError("--tenants-file: tenants need client keys (their apiKey / apiKeyEnv)")
        if set(self.priority_api_keys) - set(self.api_keys):
            raise ValueError("--priority-api-key-file: each key must also be a client key (--api-key-file)")
        return self

    @model_validator(mode="after")
    def _check_roles(self) -> RouterSettings:
        if not self.endpoints and self.discovery is None:
            raise ValueError(
                "give the pool: --engine URL... or --prefill URL... --decode URL..., "
                "or --discovery kubernetes --selector LABELS"
            )
        roles = {spec.role for spec in self.endpoints}
        if roles & {"prefill", "decode"} and "both" in roles:
            raise ValueError("use either --engine or --prefill/--decode, not both")
        if "prefill" in roles and "decode" not in roles:
            raise ValueError("--prefill needs at least one --decode")
        return self

    @model_validator(mode="after")
    def _check_epp(self) -> RouterSettings:
        """What a gateway can route: one engine per request, named by ip:port, the body unchanged."""
        if self.epp is None:
            return self
        if any(spec.role != "both" for spec in self.endpoints):
            raise ValueError(
                "--epp-port serves aggregated pools only (a gateway sends a request to one engine, so the "
                "router's prefill->decode hand-off cannot happen): use --engine, or route the gateway to "
                "the router's HTTP port for P/D"
            )
        bad = [spec.url for spec in self.endpoints if endpoint_address(spec.url) is None]
        if bad:
            raise ValueError(
                f"--epp-port: the gateway connects to engines by ip:port; give them as http://IP:PORT, not {bad[0]}"
            )
        if self.salt_from_api_key:
            raise ValueError(
                "--salt-from-api-key cannot work through --epp-port: the gateway passes request bodies to the "
                "engines unchanged, so the router cannot add a tenant's salt"
            )
        return self

    @property
    def disaggregated(self) -> bool:
        return any(spec.role == "prefill" for spec in self.endpoints)
