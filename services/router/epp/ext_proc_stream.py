"""ExtProcStream: one Envoy ext_proc stream (one HTTP request), from its request headers to its response.

Body modes (Envoy sends its ``protocol_config`` on the stream's first message):
- FULL_DUPLEX_STREAMED (GIE's mode; assumed when Envoy does not say): body chunks are buffered until the
  end of the body (``end_of_stream`` or the trailers), then the headers response carries the pick and the
  body goes back unchanged as streamed chunks;
- BUFFERED (and BUFFERED_PARTIAL when the body fit): the headers pass, the body response carries the pick;
- a request without a body (``end_of_stream`` on its headers) is picked by load at once;
- NONE (for a request with a body), STREAMED and GRPC cannot carry a pick made from the body: refused
  with a 500 naming the setting, never a silent pick without the prompt.
Responses pass through unchanged (full-duplex response chunks are handed straight back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from services.common.openai.errors import OpenAIError, server_error
from services.router.admission.admission import Lease
from services.router.epp.endpoint_picker import EndpointPicker
from services.router.epp.gie_protocol import (
    destination,
    header_map,
    headers_response,
    immediate,
    served_endpoint,
    streamed_body,
    subset_hint,
)
from services.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

Mode = ProcessingMode.BodySendMode
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED_MODES = (ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL)
Responses = list[ext_proc.ProcessingResponse]
Builder = Callable[[ext_proc.CommonResponse], Responses]  # the destination -> the responses carrying it


class ExtProcStream:
    """State of one request's stream; ``handle`` answers each message; ``done`` after an immediate response."""

    def __init__(self, picker: EndpointPicker, metrics: RouterMetrics, max_body_bytes: int) -> None:
        self.picker = picker
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.request_mode: int = FULL_DUPLEX
        self.response_mode: int = ProcessingMode.NONE
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.arrival = time.perf_counter()
        self.picked: str | None = None
        self.lease: Lease | None = None  # the admission slot of the picked request
        self.done = False

    def close(self) -> None:
        """The gateway's stream for this request ended (answered, failed or cut): give the slot back."""
        if self.lease is not None:
            self.lease.finish(None)

    async def handle(self, message: ext_proc.ProcessingRequest) -> Responses:
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            self._note_served(message)
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
        if kind == "response_body":
            if self.response_mode == FULL_DUPLEX:
                chunk = message.response_body
                return streamed_body(chunk.body, chunk.end_of_stream, response=True)
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
        if kind == "response_trailers":
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    async def _request_headers(self, message: ext_proc.ProcessingRequest) -> Responses:
        self.arrival = time.perf_counter()
        self.headers = header_map(message.request_headers.headers)
        self.subset = subset_hint(message.metadata_context)
        if message.request_headers.end_of_stream:  # no body (e.g. GET /v1/models): by load
            return await self._decide(lambda common: [headers_response(common)])
        if self.request_mode == FULL_DUPLEX:
            return []  # the pick waits for the body
        if self.request_mode in BUFFERED_MODES:
            return [headers_response()]
        name = Mode.Name(self.request_mode)
        return self._refuse(
            server_error(
                f"The gateway's ext_proc request_body_mode is {name}: the endpoint picker reads the "
                "prompt from the body; configure FULL_DUPLEX_STREAMED (or BUFFERED)."
            ),
            f"unsupported request_body_mode {name}",
        )

    async def _request_body(self, chunk: ext_proc.HttpBody) -> Responses:
        self.body += chunk.body
        if len(self.body) > self.max_body_bytes:
            return self._too_large()
        if self.request_mode in BUFFERED_MODES:
            if not chunk.end_of_stream and self.request_mode == ProcessingMode.BUFFERED_PARTIAL:
                return self._too_large()  # the gateway cut the body at its buffer limit
            return await self._decide(
                lambda common: [
                    ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common))
                ]
            )
        if not chunk.end_of_stream:
            return []
        return await self._full_duplex_pick(end_of_stream=True)

    async def _request_trailers(self) -> Responses:
        trailers = [ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if self.request_mode == FULL_DUPLEX and self.picked is None:
            picked = await self._full_duplex_pick(end_of_stream=False)  # the trailers end the body
            return picked if self.done else picked + trailers
        return trailers

    async def _full_duplex_pick(self, end_of_stream: bool) -> Responses:
        """The headers response with the pick, then the whole body handed back unchanged."""
        body = bytes(self.body)
        return await self._decide(
            lambda common: [headers_response(common), *streamed_body(body, end_of_stream)]
        )

    async def _decide(self, build: Builder) -> Responses:
        """Pick; the responses ``build`` makes around the destination (metadata on the first), or a refusal."""
        try:
            pick = await self.picker.pick(self.headers, bytes(self.body), self.subset, self.arrival)
        except OpenAIError as exc:
            return self._refuse(exc, exc.info.message)
        except Exception as exc:  # never a traceback or a hung stream: the client gets a 500
            log.exception("endpoint pick failed")
            return self._refuse(server_error(), f"endpoint pick failed: {exc!r}")
        self.picked = pick.endpoints[0]
        self.lease = pick.lease
        self.metrics.epp_requests.labels(code="200").inc()
        common, metadata = destination(pick.endpoints, pick.headers)
        responses = build(common)
        responses[0].dynamic_metadata.CopyFrom(metadata)
        return responses

    def _refuse(self, error: OpenAIError, details: str) -> Responses:
        self.done = True
        self.metrics.epp_requests.labels(code=str(error.status)).inc()
        log.info("gateway request %s refused: %d %s", self.headers.get(":path", "?"), error.status, details)
        return [immediate(error.status, error.body(), details, error.headers)]

    def _too_large(self) -> Responses:
        limit = self.max_body_bytes
        error = OpenAIError(
            413,
            f"The request body is larger than the endpoint picker reads ({limit} bytes).",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        return self._refuse(error, "request body too large")

    def _note_served(self, message: ext_proc.ProcessingRequest) -> None:
        served = served_endpoint(message.metadata_context)
        if served is not None and self.picked is not None and served != self.picked:
            log.info(
                "the gateway served %s from %s (picked %s first)",
                self.headers.get(":path"),
                served,
                self.picked,
            )
