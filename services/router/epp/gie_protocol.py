"""The GIE endpoint-picker protocol on the wire: its names, and the ext_proc messages that carry a pick.

Follows gateway-api-inference-extension ``docs/proposals/004-endpoint-picker-protocol`` (v1.0.0): the
picked endpoints go in the ``x-gateway-destination-endpoint`` request header AND, with the same value,
in the ``envoy.lb`` dynamic metadata; a subset hint in ``envoy.lb.subset_hint`` filter metadata limits
the choice; no endpoint is an ImmediateResponse 503.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
BODY_CHUNK = 64 * 1024  # Envoy's recommended largest streamed body chunk


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The data plane's endpoint subset (None: no hint, pick from the whole pool)."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    """The endpoint the data plane says served the request (on the response path), if it says."""
    if METADATA_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[METADATA_NAMESPACE].fields
    return fields[SERVED_KEY].string_value if SERVED_KEY in fields else None


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-cased header names -> values (Envoy sends ``raw_value`` bytes; older ones ``value``)."""
    return {h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value for h in headers.headers}


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def destination(
    endpoints: Sequence[str], headers: Mapping[str, str] | None = None
) -> tuple[ext_proc.CommonResponse, struct_pb2.Struct]:
    """The header mutation and the dynamic metadata naming ``endpoints`` (primary first), equal values;
    ``headers`` are set on the request too (the engines' pool-internal key replacing the client's)."""
    value = ",".join(endpoints)
    sets = [_set_header(DESTINATION_HEADER, value)] + [_set_header(k, v) for k, v in (headers or {}).items()]
    common = ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(set_headers=sets),
        clear_route_cache=True,  # a route may match on the header (e.g. a fail-open default route)
    )
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: value}})
    return common, metadata


def headers_response(common: ext_proc.CommonResponse | None = None) -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=common))


def streamed_body(
    body: bytes, end_of_stream: bool, response: bool = False
) -> list[ext_proc.ProcessingResponse]:
    """``body`` handed back in FULL_DUPLEX_STREAMED chunks (the last one carries ``end_of_stream``)."""
    chunks = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        streamed = ext_proc.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream and i == len(chunks) - 1
        )
        body_response = ext_proc.BodyResponse(
            response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=streamed))
        )
        key = "response_body" if response else "request_body"
        out.append(ext_proc.ProcessingResponse(**{key: body_response}))
    return out


def immediate(
    status: int, body: dict[str, Any], details: str, headers: Mapping[str, str] | None = None
) -> ext_proc.ProcessingResponse:
    """An ImmediateResponse: Envoy answers the client with ``status``, the JSON ``body`` and ``headers``
    (e.g. a 429's Retry-After) itself."""
    extra = [_set_header(k.lower(), v) for k, v in (headers or {}).items()]
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(
                set_headers=[_set_header("content-type", "application/json"), *extra]
            ),
            body=json.dumps(body).encode(),
            details=details[:200],
        )
    )
