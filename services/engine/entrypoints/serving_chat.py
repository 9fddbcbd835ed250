"""``POST /v1/chat/completions``: chat template -> sub-requests -> a ``chat.completion`` or its chunks."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common.openai.chat_prompt import chat_prompt_ids, chat_top_logprobs, image_urls, video_urls
from services.common.openai.chat_tools import ChatDeltas, ChatPlan, finish_reason, plan_chat
from services.common.openai.errors import OpenAIError
from services.common.openai.protocol_chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
)
from services.common.openai.protocol_common import PromptLogprobs
from services.common.openai.protocol_stream import StreamContext
from services.common.openai.protocol_tools import ToolCall
from services.common.openai.sse import SSE_DONE, sse_event
from services.engine.entrypoints.generation import Generation, RequestOptions
from services.engine.entrypoints.lifecycle import SSEResponse, cancel_on_disconnect
from services.engine.entrypoints.serving import OutputShape, ServingContext, checked_constraint, fan_out
from services.engine.entrypoints.serving_images import image_marker, prepare_media, video_marker
from services.engine.entrypoints.serving_logprobs import chat_logprobs, prompt_logprobs_json
from services.engine.llm_engine import CompletionOutput, RequestOutput


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request, request_id: str
) -> Response:
    """Serve one chat completions request (streamed or not), with tools and reasoning as the plan says."""
    ctx.check_ready()
    lora_name = ctx.check_model(body.model)
    ctx.check_generates()
    plan = plan_chat(body, ctx.tools)
    markers = image_marker(ctx), video_marker(ctx)
    prompt_ids = chat_prompt_ids(ctx.llm.tokenizer, body, plan.template_tools, *markers)
    prompt_ids, mm_inputs = await prepare_media(
        ctx, prompt_ids, image_urls(body), video_urls(body), "messages"
    )
    structured = await checked_constraint(ctx, plan.constraint)
    subs = fan_out(
        body,
        [prompt_ids],
        ctx,
        chat_top_logprobs(body),
        body.prompt_logprobs,
        structured,
        _shape(ctx, plan, structured is not None),
    )
    kv_params = await ctx.role.admit(body.kv_transfer_params, len(subs), lora_name)
    options = RequestOptions(request_id, body.cache_salt, body.priority, kv_params, lora_name, mm_inputs)
    gen = Generation(ctx, subs, options)
    stream = StreamContext(
        "chat", lora_name or ctx.model_name, body.include_usage_in_stream(), id=f"chatcmpl-{request_id}"
    )
    if body.stream:
        return SSEResponse(_events(ctx, body, gen, stream, plan))
    finals = await cancel_on_disconnect(request, gen.run())
    if finals is None:
        return Response(status_code=499)
    choices = [_choice(ctx, body, sub.index, finals[sub.index].outputs[0], plan) for sub in subs]
    response = ChatCompletionResponse(
        id=stream.id,
        created=stream.created,
        model=lora_name or ctx.model_name,
        choices=choices,
        usage=gen.usage(),
        kv_transfer_params=finals[0].kv_transfer_params,
        prompt_logprobs=_prompt_logprobs(ctx, body, prompt_ids, finals[0]),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _shape(ctx: ServingContext, plan: ChatPlan, constrained: bool) -> OutputShape:
    """Constraints start after the reasoning of a model that always reasons first (deepseek_r1: the output is
    reasoning until its end tag); with an explicit ``<think>`` (qwen3) they apply from the first token.
    Special-token tool markers stay in the parsed text."""
    reasoning = plan.reasoning
    after = reasoning.end_tag if reasoning is not None and reasoning.implicit_start and constrained else None
    markers = plan.tool_parser.markers if plan.tool_parser is not None else ()
    special = any(ctx.llm.tokenizer.backend.token_to_id(m) is not None for m in markers)
    return OutputShape(structured_after=after, keep_special_tokens=special)


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
    ctx: ServingContext, body: ChatCompletionRequest, index: int, out: CompletionOutput, plan: ChatPlan
) -> ChatChoice:
    message = plan.finish(out.text)
    ctx.metrics.tool_call_failures(len(message.failures))
    calls = [ToolCall.model_validate(c) for c in message.tool_calls] if message.tool_calls else None
    return ChatChoice(
        index=index,
        message=AssistantMessage(
            content=message.content, reasoning_content=message.reasoning_content, tool_calls=calls
        ),
        logprobs=_logprobs(ctx, body, out.token_ids, out, 0),
        finish_reason=finish_reason(out.finish_reason, message),
        stop_reason=out.stop_reason,
    )


async def _events(
    ctx: ServingContext, body: ChatCompletionRequest, gen: Generation, stream: StreamContext, plan: ChatPlan
) -> AsyncGenerator[bytes, None]:
    """Role chunk per choice, delta chunks, a last chunk with finish_reason per choice, usage, [DONE]."""
    sent = {sub.index: 0 for sub in gen.subs}
    deltas = {sub.index: ChatDeltas(plan) for sub in gen.subs}
    try:
        for sub in gen.subs:
            yield sse_event(stream.chat_role_chunk(sub.index))
        async with aclosing(gen.stream()) as outputs:
            async for index, out in outputs:
                choice = out.outputs[0]
                new_ids = choice.token_ids[sent[index] :]
                logprobs = _logprobs(ctx, body, new_ids, choice, sent[index]) if new_ids else None
                sent[index] = len(choice.token_ids)
                for part in _stream_parts(deltas[index], out.delta_text, logprobs):
                    yield sse_event(
                        stream.chat_delta_chunk(index, part)
                        if "logprobs" not in part
                        else stream.chat_chunk(index, part.get("content", ""), logprobs=part["logprobs"])
                    )
                if out.finished:
                    tail = deltas[index].finish()
                    for part in tail:
                        yield sse_event(stream.chat_delta_chunk(index, part))
                    reason = (
                        "tool_calls"
                        if choice.finish_reason == "stop" and deltas[index].saw_tool_calls
                        else (choice.finish_reason)
                    )
                    yield sse_event(stream.chat_delta_chunk(index, {}, reason, choice.stop_reason))
        if stream.include_usage:
            yield sse_event(stream.usage_chunk(gen.usage()))
    except OpenAIError as exc:
        yield sse_event(exc.body())
    yield SSE_DONE


def _stream_parts(deltas: ChatDeltas, text: str, logprobs: ChatLogprobs | None) -> list[dict[str, Any]]:
    """The delta dicts of one engine output; logprobs ride on the first content part (or their own)."""
    parts = deltas.feed(text) if text else []
    if logprobs is None:
        return parts
    for part in parts:
        if "content" in part:
            part["logprobs"] = logprobs
            return parts
    return [*parts, {"content": "", "logprobs": logprobs}]
