"""EppServer: the router's gRPC endpoint-picker port (Envoy ext_proc + gRPC health), in the router's loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.epp.endpoint_picker import EndpointPicker
from services.router.epp.epp_settings import EppSettings
from services.router.epp.ext_proc_stream import ExtProcStream
from services.router.router_state import RouterState

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The health services GIE's protocol names; "" is gRPC's whole-server status.
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Processor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, server: EppServer) -> None:
        self.server = server

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        stream = ExtProcStream(
            self.server.picker, self.server.state.metrics, self.server.settings.max_body_bytes
        )
        try:
            async for message in request_iterator:
                for response in await stream.handle(message):
                    yield response
                if stream.done:
                    return
        finally:
            stream.close()


class _Health(health_pb2_grpc.HealthServicer):
    """GIE's health services: liveness always; readiness (and ext_proc) once an engine can be picked."""

    def __init__(self, server: EppServer) -> None:
        self.server = server

    def status(self, service: str) -> int | None:
        if service not in HEALTH_SERVICES:
            return None
        if service == "liveness":
            return SERVING
        return SERVING if self.server.ready() else NOT_SERVING

    async def Check(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(1.0)


class EppServer:
    """Serves ext_proc on ``settings.host:port`` with a RouterState's picker; start/stop in its lifespan."""

    def __init__(self, state: RouterState, settings: EppSettings) -> None:
        self.state = state
        self.settings = settings
        self.picker = EndpointPicker(state, settings.fallbacks)
        self._server: grpc.aio.Server | None = None

    def ready(self) -> bool:
        return self._server is not None and any(e.healthy for e in self.picker.candidates(None))

    async def start(self) -> None:
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(_Processor(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(_Health(self), server)
        address = f"{self.settings.host}:{self.settings.port}"
        try:
            server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"--epp-port: cannot listen on {address}: {exc}") from None
        await server.start()
        self._server = server
        log.info("endpoint picker (Envoy ext_proc, GIE protocol) listening on %s", address)

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=5.0)
