"""The engine's HTTP app (every engine role): OpenAI routes, ops routes, error handling, lifespan."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from services.common.openai.chat_tools import ToolSettings, check_tool_settings
from services.common.openai.errors import not_ready
from services.common.openai.http_middleware import (
    RequestContextMiddleware,
    SideChannelAuth,
    install_error_handlers,
)
from services.common.openai.openapi_doc import document_answers
from services.common.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from services.common.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from services.engine.async_llm import AsyncLLM
from services.engine.entrypoints.lifecycle import ServerState, wait_for_held_kv, warm_up
from services.engine.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from services.engine.entrypoints.role import AggregatedRole, EngineRole
from services.engine.entrypoints.serving import ServerSettings, ServingContext
from services.engine.entrypoints.serving_chat import create_chat_completion
from services.engine.entrypoints.serving_completions import create_completion
from services.engine.entrypoints.serving_embeddings import create_embedding
from services.engine.entrypoints.serving_lora import (
    LoadLoRARequest,
    UnloadLoRARequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from services.engine.entrypoints.serving_tokens import detokenize, list_models, tokenize

log = logging.getLogger(__name__)


def version() -> str:
    """The installed kvferry version (``unknown`` when running from a source tree)."""
    try:
        return importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _openai_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request, body.request_id or request.state.request_id)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request, body.request_id or request.state.request_id)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        return await create_embedding(ctx, body, request.state.request_id)

    @router.get("/v1/models")
    async def models() -> ModelList:
        return list_models(ctx)

    @router.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLoRARequest) -> PlainTextResponse:
        return PlainTextResponse(await load_lora_adapter(ctx, body))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLoRARequest) -> PlainTextResponse:
        return PlainTextResponse(await unload_lora_adapter(ctx, body))

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return tokenize(ctx, body)

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(ctx, body)

    return router


def _ops_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not ctx.state.is_ready(ctx.llm):
            error = not_ready("The engine is draining." if ctx.state.draining else "The engine is not ready.")
            return JSONResponse(error.body(), status_code=error.status)
        return JSONResponse({"status": "ok"})

    @router.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": version()}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return router


def _tool_settings(llm: AsyncLLM, settings: ServerSettings) -> ToolSettings:
    """Tool and reasoning flags, with the chat template's ability to show tools (warned about when it cannot)."""
    if settings.chat_template:
        llm.tokenizer.set_chat_template(settings.chat_template)
    llm.tokenizer.max_text_tokens = llm.engine.max_model_len  # refuse hopeless texts before tokenizing
    renders = llm.tokenizer.chat_template is not None and llm.tokenizer.renders_tools()
    tools = ToolSettings(
        settings.enable_auto_tool_choice, settings.tool_call_parser, settings.reasoning_parser, renders
    )
    check_tool_settings(tools)
    if not renders and llm.engine.core.task == "generate":
        log.warning(
            "the chat template of %s does not render `tools`: chat requests with tools get a 400 "
            "(start with --chat-template FILE to serve them)",
            llm.config.model_name,
        )
    return tools


def build_app(llm: AsyncLLM, settings: ServerSettings, role: EngineRole | None = None) -> FastAPI:
    """The app serving ``llm`` in ``role`` (default: aggregated); it owns the engine: warm-up, then shutdown.

    ``role`` must be the one whose connectors ``llm`` was built with (its routes and admission use them).
    """
    name = llm.config.model_name
    tools = _tool_settings(llm, settings)
    ctx = ServingContext(
        llm=llm,
        settings=settings,
        metrics=ServerMetrics(llm.stats, name, llm.engine.structured.take_compile_times),
        model_name=name,
        max_model_len=llm.engine.max_model_len,
        vocab_size=llm.engine.core.model_config.vocab_size,
        state=ServerState(drain_timeout=settings.drain_timeout),
        role=role or AggregatedRole(),
        tools=tools,
    )

    if ctx.role.moves_kv_on_drain:
        ctx.state.on_drain.append(llm.migrate_out)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.state.loop = asyncio.get_running_loop()
        warming = asyncio.create_task(warm_up(llm, ctx.state))
        try:
            yield
        finally:
            ctx.state.draining = True
            warming.cancel()
            if ctx.role.moves_kv_on_drain:  # the streams it moved continue on engines still reading its KV
                await wait_for_held_kv(llm, settings.drain_timeout)
            await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="kvferry engine", version=version(), lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(SideChannelAuth, secret=llm.config.pool_secret)  # /kv/: the pool's pods only
    app.add_middleware(RequestContextMiddleware, api_keys=[settings.api_key] if settings.api_key else [])
    install_error_handlers(app, log)
    app.include_router(_openai_routes(ctx))
    app.include_router(_ops_routes(ctx))
    for router in ctx.role.routes():
        app.include_router(router)
    document_answers(app)  # /openapi.json says what the routes really answer
    return app
