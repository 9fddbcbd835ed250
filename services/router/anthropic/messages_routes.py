"""The ``/v1/messages`` route (Anthropic Messages API): plain and streamed."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.common.openai.sse import SSE_CONTENT_TYPE
from services.router.anthropic import messages_bridge as mb
from services.router.anthropic.messages_protocol import MessagesRequest
from services.router.anthropic.messages_stream import MessagesStream, sse
from services.router.chat_adapter import ChatAdapter
from services.router.chat_dispatch import dispatch_chat
from services.router.engine_client import EngineUnavailable
from services.router.pd_flow import Dispatched
from services.router.responses.response_stream import chunk_json
from services.router.router_state import RouterState


async def _events(d: Dispatched, adapter: ChatAdapter, model: str) -> AsyncGenerator[bytes, None]:
    assert d.stream is not None
    told = MessagesStream(model)
    for event in told.start():
        yield sse(event)
    try:
        async for raw in adapter.stream(d.stream.events()):
            chunk = chunk_json(raw)
            for event in told.feed(chunk) if chunk is not None else []:
                yield sse(event)
    except EngineUnavailable as exc:
        told.error = f"The engine failed while streaming: {exc.reason}"
    finally:
        await d.stream.aclose()
    for event in told.end():
        yield sse(event)


def messages_routes(state: RouterState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        user = (body.metadata or {}).get("user_id")
        d, adapter, headers = await dispatch_chat(
            state, request, mb.chat_body(body), session=user if isinstance(user, str) else None
        )
        if d.stream is not None:
            return StreamingResponse(
                _events(d, adapter, body.model), media_type=SSE_CONTENT_TYPE, headers=headers
            )
        assert d.body is not None
        return JSONResponse(mb.message_object(body.model, adapter.response(d.body)), headers=headers)

    return router
