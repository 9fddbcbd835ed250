"""The gateway of an InferencePool: GIE's own InferencePool for its engines, picked by the router's EPP."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pool_operator.crd_model import CelRule, CrdModel
from pool_operator.naming import HTTP_PORT

GIE_EPP_PORT = 9002  # the port GIE's InferencePool infers for an endpoint picker Service


class GatewaySpec(CrdModel):
    """Gateway API Inference Extension: a gateway (Envoy Gateway, kgateway, Istio, GKE) routes to the
    engines itself, asking the router's endpoint picker (ext_proc) which one."""

    CEL_RULES = (
        CelRule(
            f"self.eppPort != {HTTP_PORT}",
            f"gateway.eppPort must differ from the router's HTTP port {HTTP_PORT}",
            lambda s: s.epp_port != HTTP_PORT,
        ),
    )

    enabled: bool = Field(
        False,
        description="render GIE's inference.networking.k8s.io/v1 InferencePool and the endpoint picker Service",
    )
    epp_port: int = Field(
        GIE_EPP_PORT, ge=1, le=65535, description="the routers' endpoint picker (gRPC) port"
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="what the gateway does when the picker does not answer (endpointPickerRef.failureMode)",
    )
    fallbacks: int = Field(
        0,
        ge=0,
        le=7,
        description="endpoints named after the chosen one, for gateways that retry down the list",
    )
