"""``POST /v1/chat/completions``: chat template -> sub-requests -> a ``chat.completion`` or its chunks."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common.chat_prompt import chat_prompt_ids, chat_top_logprobs
from services.common.errors import OpenAIError
from services.common.protocol_chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
)
from services.common.protocol_common import PromptLogprobs
from services.common.protocol_stream import StreamContext
from services.common.sse import SSE_DONE, sse_event
from services.engine.entrypoints.generation import Generation, RequestOptions
from services.engine.entrypoints.lifecycle import SSEResponse, cancel_on_disconnect
from services.engine.entrypoints.serving import ServingContext, checked_constraint, fan_out
from services.engine.entrypoints.serving_logprobs import chat_logprobs, prompt_logprobs_json
from services.engine.llm_engine import CompletionOutput, RequestOutput


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request, request_id: str
) -> Response:
    """Serve one chat completions request (streamed or not)."""
    ctx.check_ready()
    ctx.check_model(body.model)
    ctx.check_generates()
    prompt_ids = chat_prompt_ids(ctx.llm.tokenizer, body)
    structured = await checked_constraint(ctx, body.structured_spec())
    subs = fan_out(body, [prompt_ids], ctx, chat_top_logprobs(body), body.prompt_logprobs, structured)
    kv_params = await ctx.role.admit(body.kv_transfer_params, len(subs))
    gen = Generation(ctx, subs, RequestOptions(request_id, body.cache_salt, body.priority, kv_params))
    stream = StreamContext(
        "chat", ctx.model_name, body.include_usage_in_stream(), id=f"chatcmpl-{request_id}"
    )
    if body.stream:
        return SSEResponse(_events(ctx, body, gen, stream))
    finals = await cancel_on_disconnect(request, gen.run())
    if finals is None:
        return Response(status_code=499)
    choices = [_choice(ctx, body, sub.index, finals[sub.index].outputs[0]) for sub in subs]
    response = ChatCompletionResponse(
        id=stream.id,
        created=stream.created,
        model=ctx.model_name,
        choices=choices,
        usage=gen.usage(),
        kv_transfer_params=finals[0].kv_transfer_params,
        prompt_logprobs=_prompt_logprobs(ctx, body, prompt_ids, finals[0]),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _prompt_logprobs(
    ctx: ServingContext, body: ChatCompletionRequest, prompt_ids: list[int], final: RequestOutput
) -> PromptLogprobs | None:
    """vLLM's top-level ``prompt_logprobs`` of a chat response, when the request asked for them."""
    if body.prompt_logprobs is None or final.prompt_logprobs is None:
        return None
    return prompt_logprobs_json(ctx.llm.tokenizer, prompt_ids, final.prompt_logprobs, body.prompt_logprobs)


def _logprobs(
    ctx: ServingContext, body: ChatCompletionRequest, token_ids: list[int], out: CompletionOutput, start: int
) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    lps = (out.logprobs or [])[start : start + len(token_ids)]
    return chat_logprobs(ctx.llm.tokenizer, token_ids, lps, body.top_logprobs or 0)


def _choice(
    ctx: ServingContext, body: ChatCompletionRequest, index: int, out: CompletionOutput
) -> ChatChoice:
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=out.text),
        logprobs=_logprobs(ctx, body, out.token_ids, out, 0),
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )


async def _events(
    ctx: ServingContext, body: ChatCompletionRequest, gen: Generation, stream: StreamContext
) -> AsyncGenerator[bytes, None]:
    """Role chunk per choice, content chunks, an empty-delta chunk with finish_reason, usage, [DONE]."""
    sent = {sub.index: 0 for sub in gen.subs}
    try:
        for sub in gen.subs:
            yield sse_event(stream.chat_role_chunk(sub.index))
        async with aclosing(gen.stream()) as outputs:
            async for index, out in outputs:
                choice = out.outputs[0]
                new_ids = choice.token_ids[sent[index] :]
                logprobs = _logprobs(ctx, body, new_ids, choice, sent[index]) if new_ids else None
                sent[index] = len(choice.token_ids)
                if out.delta_text or logprobs:
                    yield sse_event(stream.chat_chunk(index, out.delta_text, logprobs=logprobs))
                if out.finished:
                    yield sse_event(
                        stream.chat_chunk(index, None, choice.finish_reason, stop_reason=choice.stop_reason)
                    )
        if stream.include_usage:
            yield sse_event(stream.usage_chunk(gen.usage()))
    except OpenAIError as exc:
        yield sse_event(exc.body())
    yield SSE_DONE
