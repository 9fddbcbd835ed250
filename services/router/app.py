"""The router's HTTP app: the engine's OpenAI routes, served by routing each request into the pool."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.common.openai.chat_prompt import detokenize_response, tokenize_response
from services.common.openai.errors import OpenAIError, model_not_found, not_ready
from services.common.openai.http_middleware import (
    RequestContextMiddleware,
    install_error_handlers,
    presented_key,
)
from services.common.openai.openapi_doc import document_answers
from services.common.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from services.common.openai.protocol_embeddings import EmbeddingRequest
from services.common.openai.sse import SSE_CONTENT_TYPE, SSE_DONE, SSEEvent, sse_event
from services.common.pool.roles import DECODE_ROLES
from services.router.anthropic.messages_routes import messages_routes
from services.router.chat_adapter import ChatAdapter
from services.router.context_limit import check_prompt_fits
from services.router.engine_client import EngineUnavailable
from services.router.metrics import CONTENT_TYPE
from services.router.migration.stream_replay import StreamReplay
from services.router.pd_flow import Dispatched, no_endpoint
from services.router.priority_gate import check_priority
from services.router.prompt import PreparedRequest
from services.router.responses.responses_routes import build_store, responses_routes
from services.router.router_state import RouterState
from services.router.scheduling.filters import eligible
from services.router.sessions.session_affinity import session_key
from services.router.settings import RouterSettings
from services.router.ui.routes import ui_routes

log = logging.getLogger(__name__)


def _timed_out(seconds: float | None) -> OpenAIError:
    """504 for a request past the router's --request-timeout (its engine call was closed, which aborts it)."""
    return OpenAIError(
        504,
        f"The request did not finish within the router's request timeout of {seconds or 0:g}s and was aborted.",
        "server_error",
        None,
        "request_timeout",
    )


async def _relay(
    state: RouterState,
    d: Dispatched,
    chunks: AsyncGenerator[bytes, None],
    deadline: float | None,
    replay: StreamReplay | None = None,
) -> AsyncGenerator[bytes, None]:
    """Yield ``chunks`` until ``deadline`` (loop time); an engine failure after the first token (that could
    not be migrated), or the deadline, ends the stream with an error event."""
    assert d.stream is not None
    try:
        async with aclosing(chunks) as items:
            while True:
                async with asyncio.timeout_at(deadline):
                    chunk = await anext(items, None)
                if chunk is None:
                    break
                yield chunk
        if replay is not None and replay.migrations:
            yield replay.trailer()
    except TimeoutError:
        state.metrics.stream_errors.inc()
        yield sse_event(_timed_out(state.settings.request_deadline_s).body())
        yield SSE_DONE
    except EngineUnavailable as exc:
        state.metrics.stream_errors.inc()
        log.warning("stream from %s broke after the first token: %s", d.stream.url, exc.reason)
        error = OpenAIError(
            502, f"The engine failed while streaming: {exc.reason}", "server_error", None, "engine_failed"
        )
        yield sse_event(error.body())
        yield SSE_DONE
    finally:
        await d.stream.aclose()
        if replay is not None:
            await replay.aclose()


async def _passthrough(events: AsyncGenerator[SSEEvent, None]) -> AsyncGenerator[bytes, None]:
    async with aclosing(events) as items:
        async for event in items:
            yield sse_event(event.data)


async def _embed(state: RouterState, body: EmbeddingRequest, request_id: str) -> Response:
    """Embeddings go to the least-loaded engine (no prefix reuse: every input token is pooled); an engine
    that fails is retried on the next one."""
    engines = sorted(
        eligible(state.poller.endpoints(), DECODE_ROLES),
        key=lambda e: (e.load.waiting + e.load.running, e.load.kv_usage),
    )
    if not engines:
        raise no_endpoint("no healthy engine")
    payload = body.model_dump(mode="json", exclude_unset=True, exclude={"model"})
    headers = {"X-Request-Id": request_id}
    for endpoint in engines[:3]:
        try:
            answer = await state.client.complete(endpoint.url, payload, headers, path="/v1/embeddings")
        except EngineUnavailable as exc:
            log.warning("embeddings on %s failed (%s); trying the next engine", endpoint.url, exc.reason)
            continue
        answer["model"] = state.settings.model_name
        return JSONResponse(answer, headers={"X-Kvferry-Endpoint": endpoint.url})
    raise no_endpoint("every engine tried failed")


async def _serve(
    state: RouterState, req: PreparedRequest, request_id: str, adapter: ChatAdapter | None, request: Request
) -> Response:
    check_prompt_fits(req, state.max_model_len())
    assert state.admission is not None
    lease = await state.admission.admit_request(request, req.prompt_tokens, req.max_output_tokens)
    limit = state.settings.request_deadline_s
    deadline = None if limit is None else asyncio.get_running_loop().time() + limit
    splice = state.migrator.prepare(req)
    try:
        ctx = await state.context(req)
        async with asyncio.timeout_at(deadline):
            d = await state.flow.run(req, ctx, request_id)
    except TimeoutError:
        lease.cancel()
        raise _timed_out(limit) from None
    except BaseException:
        lease.cancel()
        raise
    lease.bind(d.body, None if d.stream is None else d.stream.on_close)
    headers = {**d.headers(), **lease.headers}
    if d.stream is not None:
        replay = None
        if splice is not None:
            observe = functools.partial(state.accuracy.observe, d.decision, ctx)
            replay = StreamReplay(state.migrator, req, request_id, d.stream, splice, observe)
        events = replay.events() if replay else d.stream.events()
        chunks = adapter.stream(events) if adapter else _passthrough(events)
        relay = _relay(state, d, chunks, deadline, replay)
        return StreamingResponse(relay, media_type=SSE_CONTENT_TYPE, headers=headers)
    assert d.body is not None
    state.accuracy.observe(d.decision, ctx, d.body)
    answer = adapter.response(d.body) if adapter else d.body
    return JSONResponse(answer, headers=headers)


def _openai_routes(state: RouterState) -> APIRouter:
    router = APIRouter()
    name = state.settings.model_name

    def check_model(model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 when no engine serves it."""
        if model is None or model == name:
            return None
        if model in state.lora_adapters():
            return model
        raise model_not_found(model)

    def admit(body: CompletionRequest | ChatCompletionRequest, request: Request) -> str | None:
        """Before a generation request is prepared: its adapter (``check_model``); with
        --salt-from-api-key the tenant's salt leading its own, so tenants never share KV; and the pool's
        context as the tokenizer's limit, so a text that cannot fit is refused before it is tokenized."""
        check_priority(state.settings, body.priority, presented_key(request.headers))
        if state.settings.salt_from_api_key:
            tenant = f"tenant:{request.state.tenant}"
            body.cache_salt = f"{tenant}:{body.cache_salt}" if body.cache_salt else tenant
        state.tokenizer.max_text_tokens = state.max_model_len()
        return check_model(body.model)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora = admit(body, request)
        rid = body.request_id or request.state.request_id
        req = await state.preparer.completion_async(body, lora)
        req.session = session_key(request, body.user)
        req.arrival = request.state.arrival  # the overhead counts parsing, tokenizing and hashing too
        return await _serve(state, req, rid, None, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        lora = admit(body, request)
        rid = body.request_id or request.state.request_id
        req = await state.preparer.chat_async(body, lora)
        req.session = session_key(request, body.user)
        req.arrival = request.state.arrival
        adapter = ChatAdapter(
            lora or name, rid, req.chat_top_logprobs, body.n, req.include_usage, req.chat_plan
        )
        return await _serve(state, req, rid, adapter, request)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        if check_model(body.model) is not None:
            raise model_not_found(str(body.model))  # adapters are for generation
        return await _embed(state, body, request.state.request_id)

    @router.get("/v1/models")
    async def models() -> ModelList:
        limit = state.max_model_len()
        card = ModelCard(id=name, root=str(state.settings.tokenizer), max_model_len=limit)
        adapters = [ModelCard(id=a, parent=name, max_model_len=limit) for a in sorted(state.lora_adapters())]
        return ModelList(data=[card, *adapters])

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Answered by the router's tokenizer; ``max_model_len`` is the pool's (0 before any engine answered)."""
        check_model(body.model)
        return tokenize_response(state.tokenizer, body, state.max_model_len() or 0)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        return detokenize_response(state.tokenizer, body, state.tokenizer.vocab_size)

    return router


def _ops_routes(state: RouterState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        problems = state.self_check.problems()
        if problems:
            error = not_ready("Router not ready: " + "; ".join(problems))
            return JSONResponse(error.body(), status_code=error.status)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        state.metrics.healthy_endpoints.set(sum(e.healthy for e in state.poller.endpoints()))
        if state.index is not None and state.metrics.redis_up is not None:
            state.metrics.redis_up.set(1 if await state.index.ping() else 0)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return router


def build_app(settings: RouterSettings, state: RouterState | None = None) -> FastAPI:
    """The router app; its lifespan starts the poller, the self-check and (``settings.epp``) the endpoint
    picker, and closes every client."""
    state = state or RouterState.build(settings)
    store = build_store(state)

    epp = None
    if settings.epp is not None:  # imported only when asked for: the Envoy protos are the EPP's alone
        from services.router.epp.epp_server import EppServer

        epp = EppServer(state, settings.epp)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            if epp is not None:
                await epp.start()
            yield
        finally:
            if epp is not None:
                await epp.stop()
            await state.stop()
            await store.kv.aclose()

    app = FastAPI(title="kvferry router", lifespan=lifespan)
    app.state.router = state
    app.add_middleware(RequestContextMiddleware, api_keys=settings.api_keys)
    install_error_handlers(app, log)
    app.include_router(_openai_routes(state))
    app.include_router(responses_routes(state, store))
    app.include_router(messages_routes(state))
    app.include_router(_ops_routes(state))
    app.include_router(ui_routes(state))
    document_answers(app)  # /openapi.json says what the routes really answer
    return app
