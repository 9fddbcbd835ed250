"""The ``/v1/responses`` routes: create (plain or streamed), retrieve, delete, list input items."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any, Literal

import redis.asyncio as aioredis
from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.common.openai.errors import OpenAIError, bad_request
from services.common.openai.sse import SSE_CONTENT_TYPE
from services.router.chat_adapter import ChatAdapter
from services.router.chat_dispatch import dispatch_chat
from services.router.engine_client import EngineUnavailable
from services.router.pd_flow import Dispatched
from services.router.responses import chat_bridge as cb
from services.router.responses.response_protocol import ResponsesRequest
from services.router.responses.response_store import (
    KeyValue,
    MemoryKeyValue,
    ResponseStore,
    StoreTooLarge,
    StoreUnreadable,
)
from services.router.responses.response_stream import ResponsesStream, chunk_json, sse
from services.router.router_state import RouterState

log = logging.getLogger(__name__)
STORE_DOWN = (aioredis.RedisError, OSError)


def store_unavailable(exc: BaseException) -> OpenAIError:
    return OpenAIError(
        503,
        f"The response store (Redis) is unavailable ({exc.__class__.__name__}); retry later.",
        "server_error",
    )


Conversation = tuple[list[dict[str, Any]], str]  # the items of the chain so far, and the chain's first id
PUBLIC = "public"  # the tenant of a router without API keys


def tenant(request: Request) -> str:
    return str(getattr(request.state, "tenant", PUBLIC))


def build_store(state: RouterState) -> ResponseStore:
    """The pool's Redis when the router has one (shared by every replica), else this process's memory."""
    s = state.settings.responses
    kv: KeyValue = (
        aioredis.Redis.from_url(state.settings.redis_url) if state.settings.redis_url else MemoryKeyValue()
    )
    if s.key is None:
        log.warning("stored responses are not encrypted: give --responses-key-file")
    return ResponseStore(kv, s.ttl_s, s.max_bytes, s.key)


class ResponsesService:
    """One router's Responses API: the chain's conversation, the routed chat request, the store."""

    def __init__(self, state: RouterState, store: ResponseStore) -> None:
        self.state = state
        self.store = store

    async def record(self, request: Request, response_id: str) -> dict[str, Any]:
        """The stored record of ``response_id`` for this request's tenant; 404 when absent or expired."""
        who = tenant(request)
        try:
            found = await self.store.get(who, response_id)
            if found is None:
                raise cb.not_found(response_id, await self.store.expired(who, response_id))
        except StoreUnreadable as exc:
            log.warning("stored response %s: %s", response_id, exc)
            raise cb.not_found(response_id, False) from None
        except STORE_DOWN as exc:
            raise store_unavailable(exc) from None
        return found

    async def conversation(
        self, body: ResponsesRequest, request: Request
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The chain's items (previous conversation and its answer) followed by this input, and the id
        of the chain's first response (None: this one starts a chain)."""
        if body.previous_response_id is None:
            return cb.item_dicts(body.input_items()), None
        prev = await self.record(request, body.previous_response_id)
        history = prev["items"] + prev["response"]["output"]
        return history + cb.item_dicts(body.input_items()), prev.get("chain") or prev["response"]["id"]

    async def save(self, request: Request, response: dict[str, Any], chat: Conversation) -> None:
        if not response["store"]:
            return
        record = {"response": response, "items": chat[0], "chain": chat[1]}
        try:
            await self.store.put(tenant(request), response["id"], record)
        except StoreTooLarge as exc:  # the answer pushed it over: served, not stored
            log.warning("response %s not stored: %s", response["id"], exc)
        except STORE_DOWN as exc:  # the answer is served; a later previous_response_id gets a 404
            log.warning("response %s not stored: the store is unavailable (%r)", response["id"], exc)

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        items, chain = await self.conversation(body, request)
        messages = cb.chat_messages(body.instructions, items)
        response = cb.response_object(body, cb.new_id("resp"), body.model or self.state.settings.model_name)
        chain = chain or response["id"]
        if body.store:
            try:
                self.store.check_size({"response": response, "items": items})
            except StoreTooLarge as exc:
                raise bad_request(f"input too large to store: {exc}", "input") from None
        chat = cb.chat_body(body, messages, body.model)
        d, adapter, headers = await dispatch_chat(self.state, request, chat, session=chain)
        if d.stream is not None:
            events = self.stream(request, d, adapter, response, (items, chain))
            return StreamingResponse(events, media_type=SSE_CONTENT_TYPE, headers=headers)
        assert d.body is not None
        chat = adapter.response(d.body)
        choice = chat["choices"][0]
        done = cb.finish(
            response, cb.output_items(choice["message"]), choice["finish_reason"], chat.get("usage")
        )
        await self.save(request, done, (items, chain))
        return JSONResponse(done, headers=headers)

    async def stream(
        self,
        request: Request,
        d: Dispatched,
        adapter: ChatAdapter,
        response: dict[str, Any],
        chat: Conversation,
    ) -> AsyncGenerator[bytes, None]:
        """The Responses events of the routed chat stream; the response is stored before it completes."""
        assert d.stream is not None
        told = ResponsesStream(response)
        for event in told.start():
            yield sse(event)
        try:
            async for raw in adapter.stream(d.stream.events()):
                chunk = chunk_json(raw)
                for event in told.feed(chunk) if chunk is not None else []:
                    yield sse(event)
        except EngineUnavailable as exc:
            told.error = {"message": f"The engine failed while streaming: {exc.reason}"}
        finally:
            await d.stream.aclose()
        closing, final = told.finish()
        for event in closing:
            yield sse(event)
        if final["status"] == "failed":
            yield sse(told.event("response.failed", response=final))
            return
        await self.save(request, final, chat)
        yield sse(told.event(f"response.{final['status']}", response=final))


def responses_routes(state: RouterState, store: ResponseStore) -> APIRouter:
    router = APIRouter()
    service = ResponsesService(state, store)

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await service.create(body, request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        return JSONResponse((await service.record(request, response_id))["response"])

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        await service.record(request, response_id)  # 404 (naming an expired id) when absent
        try:
            await store.delete(tenant(request), response_id)
        except STORE_DOWN as exc:
            raise store_unavailable(exc) from None
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> Response:
        items = list((await service.record(request, response_id))["items"])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise bad_request(f"after: no input item {after!r} in response {response_id!r}", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    return router
