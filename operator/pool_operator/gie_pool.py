"""GiePoolBuilder: GIE's own InferencePool (inference.networking.k8s.io/v1) and the endpoint picker Service."""

from __future__ import annotations

from typing import Any

from pool_operator.gateway_spec import GatewaySpec
from pool_operator.naming import HTTP_PORT, PoolNames

GIE_API_VERSION = "inference.networking.k8s.io/v1"
GIE_KIND = "InferencePool"
EPP_PORT_NAME = "epp"


class GiePoolBuilder:
    """The two objects a Gateway API Inference Extension gateway reads to route to a kvferry pool."""

    def __init__(self, names: PoolNames, gateway: GatewaySpec) -> None:
        self.names = names
        self.gateway = gateway

    @property
    def epp_service(self) -> str:
        return self.names.child("epp")

    def inference_pool(self) -> dict[str, Any]:
        """The engines (by their pods' role selector) on the HTTP port; the routers' picker as the EPP."""
        return {
            "apiVersion": GIE_API_VERSION,
            "kind": GIE_KIND,
            "metadata": {
                "name": self.names.pool,
                "namespace": self.names.namespace,
                "labels": self.names.labels(None),
            },
            "spec": {
                "selector": {"matchLabels": self.names.selector("engine")},
                "targetPorts": [{"number": HTTP_PORT}],
                "endpointPickerRef": {
                    "group": "",
                    "kind": "Service",
                    "name": self.epp_service,
                    "port": {"number": self.gateway.epp_port},
                    "failureMode": self.gateway.failure_mode,
                },
            },
        }

    def service(self) -> dict[str, Any]:
        """The routers' gRPC endpoint-picker port (HTTP/2 cleartext, as gateways dial ext_proc)."""
        port = self.gateway.epp_port
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": self.epp_service,
                "namespace": self.names.namespace,
                "labels": self.names.labels("router"),
            },
            "spec": {
                "type": "ClusterIP",
                "selector": self.names.selector("router"),
                "ports": [
                    {
                        "name": "grpc-epp",
                        "port": port,
                        "targetPort": EPP_PORT_NAME,
                        "protocol": "TCP",
                        "appProtocol": "kubernetes.io/h2c",
                    }
                ],
            },
        }
