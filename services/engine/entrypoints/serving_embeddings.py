"""``POST /v1/embeddings``: inputs -> pooling requests batched by the scheduler -> an OpenAI embedding list."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Sequence

from services.common.openai.errors import bad_request
from services.common.openai.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from services.engine.async_llm import EngineDeadError
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams
from services.engine.entrypoints.serving import ServingContext, engine_error
from services.engine.worker.pooling import supported_dimensions

_PLACEHOLDER = SamplingParams(max_tokens=1)  # an embedding request samples nothing


def _token_ids(ctx: ServingContext, body: EmbeddingRequest) -> list[list[int]]:
    tok, out = ctx.llm.tokenizer, []
    for item in body.inputs():
        ids = tok.encode(item) if isinstance(item, str) else list(item)
        if any(t >= ctx.vocab_size for t in ids):
            raise bad_request(f"token ids must be in [0, {ctx.vocab_size})", "input")
        if len(ids) > ctx.max_model_len:
            raise bad_request(
                f"an input has {len(ids)} tokens; this model embeds at most {ctx.max_model_len}", "input"
            )
        out.append(ids)
    return out


def _pooling(ctx: ServingContext, body: EmbeddingRequest) -> PoolingParams:
    if body.dimensions is None:
        return PoolingParams()
    dims = supported_dimensions(ctx.llm.config.model)
    if dims is None or body.dimensions not in dims:
        have = "none (it is not a Matryoshka model)" if dims is None else sorted(dims)
        raise bad_request(
            f"this model cannot shorten its embeddings to {body.dimensions}: supported {have}", "dimensions"
        )
    return PoolingParams(dimensions=body.dimensions)


def _encode(vector: Sequence[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def _embed_one(ctx: ServingContext, ids: list[int], pooling: PoolingParams, rid: str) -> list[float]:
    async for out in ctx.llm.generate(ids, _PLACEHOLDER, rid, pooling=pooling):
        if out.finished:
            if out.embedding is None:
                raise engine_error(out.error or "the embedding request failed")
            return out.embedding
    raise engine_error("the engine ended the request without an embedding")


async def create_embedding(ctx: ServingContext, body: EmbeddingRequest, request_id: str) -> EmbeddingResponse:
    """Serve one /v1/embeddings request: every input is one engine request, all run concurrently."""
    ctx.check_ready()
    ctx.check_model(body.model)
    if ctx.task != "embed":
        raise bad_request(
            "this model generates text; /v1/embeddings needs an engine started with --task embed "
            "(an embedding model)",
            "model",
            "model_not_embedding",
        )
    prompts, pooling = _token_ids(ctx, body), _pooling(ctx, body)
    jobs = [_embed_one(ctx, ids, pooling, f"{request_id}-{i}") for i, ids in enumerate(prompts)]
    try:
        vectors = await asyncio.gather(*jobs)
    except EngineDeadError as exc:
        raise engine_error(str(exc)) from exc
    data = [EmbeddingData(embedding=_encode(v, body.encoding_format), index=i) for i, v in enumerate(vectors)]
    tokens = sum(len(p) for p in prompts)
    return EmbeddingResponse(
        data=data, model=ctx.model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
