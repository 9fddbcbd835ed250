"""A small real OpenAI-compatible streaming server (FastAPI + uvicorn in a thread) for bench tests."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.openai.errors import OpenAIError, parse_body, unauthorized
from services.common.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    StreamContext,
    Usage,
)
from services.common.openai.sse import SSE_CONTENT_TYPE, SSE_DONE, sse_event

MODEL = "fake-model"


@dataclass
class FakeBehaviour:
    """Knobs: every ``fail_every``-th request answers 503, every ``cut_every``-th stops before
    [DONE]; ``usage=False`` never sends the usage chunk (the client must count chunks); with
    ``api_key`` set, requests without that bearer token get a 401."""

    token_delay: float = 0.001
    usage: bool = True
    api_key: str | None = None
    fail_every: int = 0
    cut_every: int = 0
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_index(self) -> int:
        with self.lock:
            self.count += 1
            return self.count


def _prompt_len(body: CompletionRequest | ChatCompletionRequest) -> int:
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text().split()) for m in body.messages)
    prompts = body.prompts()
    return sum(len(p) if isinstance(p, list) else len(p.split()) for p in prompts)


async def _stream(
    ctx: StreamContext, body: CompletionRequest | ChatCompletionRequest, cut: bool, delay: float
) -> AsyncIterator[bytes]:
    chat = ctx.kind == "chat"
    if chat:
        yield sse_event(ctx.chat_role_chunk(0))
    n = body.max_output_tokens() or 16
    for i in range(n):
        await asyncio.sleep(delay)
        text = f"t{i} "
        yield sse_event(ctx.chat_chunk(0, text) if chat else ctx.completion_chunk(0, text))
    if cut:
        return
    yield sse_event(ctx.chat_chunk(0, None, "length") if chat else ctx.completion_chunk(0, "", "length"))
    if ctx.include_usage:
        yield sse_event(ctx.usage_chunk(Usage.of(_prompt_len(body), n)))
    yield SSE_DONE


def make_app(behaviour: FakeBehaviour) -> FastAPI:
    """The fake server: /v1/models, streaming-only /v1/completions and /v1/chat/completions."""
    app = FastAPI()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=MODEL)]).model_dump()

    async def handle(request: Request, kind: str) -> StreamingResponse:
        model = CompletionRequest if kind == "completion" else ChatCompletionRequest
        if behaviour.api_key and request.headers.get("authorization") != f"Bearer {behaviour.api_key}":
            raise unauthorized()
        body = parse_body(model, await request.body())
        index = behaviour.next_index()
        if behaviour.fail_every and index % behaviour.fail_every == 0:
            raise OpenAIError(503, "injected failure", "server_error")
        ctx = StreamContext(kind, MODEL, include_usage=behaviour.usage and body.include_usage_in_stream())
        cut = bool(behaviour.cut_every and index % behaviour.cut_every == 0)
        stream = _stream(ctx, body, cut, behaviour.token_delay)
        return StreamingResponse(stream, media_type=SSE_CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return await handle(request, "chat")

    return app


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 and a free port in a background thread; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
