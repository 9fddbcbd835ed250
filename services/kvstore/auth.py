"""PoolSecretInterceptor: every kvstore RPC needs the pool secret in its metadata, else UNAUTHENTICATED."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from pydantic import SecretStr

from services.common.pool.pool_secret import POOL_SECRET_METADATA, secret_matches

_REFUSAL = f"missing or wrong pool secret ({POOL_SECRET_METADATA} metadata)"


def _refuse(_request: Any, context: grpc.ServicerContext) -> NoReturn:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    raise AssertionError("grpc.ServicerContext.abort returned")


class PoolSecretInterceptor(grpc.ServerInterceptor):
    """Refuses a call before its handler runs (and before a streamed request is read) unless the metadata
    carries the pool secret (compared in constant time)."""

    def __init__(self, secret: SecretStr) -> None:
        self._secret = secret

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        presented = dict(handler_call_details.invocation_metadata or ()).get(POOL_SECRET_METADATA)
        handler = continuation(handler_call_details)
        if handler is None or secret_matches(presented, self._secret):
            return handler
        if handler.response_streaming:
            factory = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )
        elif handler.request_streaming:
            factory = grpc.stream_unary_rpc_method_handler
        else:
            factory = grpc.unary_unary_rpc_method_handler
        return factory(
            _refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
