"""``POST /v1/completions``: prompts -> sub-requests -> a ``text_completion`` or its SSE stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common.openai.errors import OpenAIError, bad_request
from services.common.openai.protocol_completions import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from services.common.openai.protocol_stream import StreamContext
from services.common.openai.sse import SSE_DONE, sse_event
from services.engine.core.outputs import Logprobs
from services.engine.entrypoints.generation import Generation, RequestOptions
from services.engine.entrypoints.lifecycle import SSEResponse, cancel_on_disconnect
from services.engine.entrypoints.serving import ServingContext, SubRequest, checked_constraint, fan_out
from services.engine.entrypoints.serving_images import prepare_media
from services.engine.entrypoints.serving_logprobs import completion_logprobs, prompt_logprobs_json
from services.engine.llm_engine import RequestOutput


@dataclass
class _Prompt:
    ids: list[int]
    text: str


def _prompts(ctx: ServingContext, body: CompletionRequest) -> list[_Prompt]:
    tok = ctx.llm.tokenizer
    out = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            out.append(_Prompt(tok.encode(prompt), prompt))
        else:  # ids past the vocabulary are refused before the tokenizer sees them (it overflows on > 2**32)
            if any(t >= ctx.vocab_size for t in prompt):
                raise bad_request(f"token ids must be in [0, {ctx.vocab_size})", "prompt")
            out.append(_Prompt(list(prompt), tok.decode(list(prompt), skip_special_tokens=False)))
    return out


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request, request_id: str
) -> Response:
    """Serve one completions request (streamed or not)."""
    ctx.check_ready()
    lora_name = ctx.check_model(body.model)
    ctx.check_generates()
    prompts = _prompts(ctx, body)
    mm_inputs = None
    if (data := body.multi_modal_data) is not None:  # with exactly one prompt (validated)
        prompts[0].ids, mm_inputs = await prepare_media(
            ctx, prompts[0].ids, data.image, data.video, "multi_modal_data"
        )
    structured = await checked_constraint(ctx, body.structured_spec())
    subs = fan_out(
        body, [p.ids for p in prompts], ctx, body.logprobs, body.engine_prompt_logprobs(), structured
    )
    kv_params = await ctx.role.admit(body.kv_transfer_params, len(subs), lora_name)
    options = RequestOptions(request_id, body.cache_salt, body.priority, kv_params, lora_name, mm_inputs)
    gen = Generation(ctx, subs, options)
    stream = StreamContext(
        "completion", lora_name or ctx.model_name, body.include_usage_in_stream(), id=f"cmpl-{request_id}"
    )
    if body.stream:
        return SSEResponse(_events(ctx, body, gen, prompts, stream))
    finals = await cancel_on_disconnect(request, gen.run())
    if finals is None:
        return Response(status_code=499)
    choices = [_choice(ctx, body, sub, prompts[sub.prompt], finals[sub.index]) for sub in subs]
    response = CompletionResponse(
        id=stream.id,
        created=stream.created,
        model=lora_name or ctx.model_name,
        choices=choices,
        usage=gen.usage(),
        kv_transfer_params=finals[0].kv_transfer_params,
    )
    return JSONResponse(response.model_dump(mode="json"))


def _choice(
    ctx: ServingContext, body: CompletionRequest, sub: SubRequest, prompt: _Prompt, final: RequestOutput
) -> CompletionChoice:
    out = final.outputs[0]
    text = prompt.text + out.text if body.echo else out.text
    logprobs = prompt_lps = None
    if body.logprobs is not None:
        echoed = prompt.ids if body.echo else []
        echoed_lps = _prompt_token_logprobs(final, len(echoed))
        logprobs = completion_logprobs(
            ctx.llm.tokenizer, echoed + out.token_ids, echoed_lps + list(out.logprobs or []), 0, body.logprobs
        )
    if body.prompt_logprobs is not None:
        prompt_lps = prompt_logprobs_json(
            ctx.llm.tokenizer,
            prompt.ids,
            _prompt_token_logprobs(final, len(prompt.ids)),
            body.prompt_logprobs,
        )
    return CompletionChoice(
        index=sub.index,
        text=text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        prompt_logprobs=prompt_lps,
        token_ids=list(out.token_ids) if body.return_token_ids else None,
    )


def _prompt_token_logprobs(final: RequestOutput, num_prompt: int) -> list[Logprobs | None]:
    """The engine's prompt logprobs (the first token has none); all None if the request ended before them."""
    if num_prompt and final.prompt_logprobs is not None:
        return list(final.prompt_logprobs)
    return [None] * num_prompt


@dataclass
class _ChoiceCursor:
    """What of one choice was already streamed: tokens (for logprobs) and text length (offsets)."""

    tokens: int = 0
    offset: int = 0


async def _events(
    ctx: ServingContext,
    body: CompletionRequest,
    gen: Generation,
    prompts: list[_Prompt],
    stream: StreamContext,
) -> AsyncGenerator[bytes, None]:
    cursors = {sub.index: _ChoiceCursor() for sub in gen.subs}
    echo_pending = {sub.index: prompts[sub.prompt] for sub in gen.subs} if body.echo else {}
    try:
        if body.logprobs is None:  # echoed logprobs wait for the engine's prompt logprobs (the first output)
            for index, prompt in echo_pending.items():
                yield sse_event(_echo_chunk(ctx, body, stream, index, prompt, None, cursors[index]))
            echo_pending = {}
        async with aclosing(gen.stream()) as outputs:
            async for index, out in outputs:
                if out.finished and out.kv_transfer_params and out.outputs[0].finish_reason == "abort":
                    yield sse_event(
                        stream.moved_chunk(out.kv_transfer_params)
                    )  # drained: the router moves it
                    yield SSE_DONE
                    return
                if index in echo_pending:
                    yield sse_event(
                        _echo_chunk(ctx, body, stream, index, echo_pending.pop(index), out, cursors[index])
                    )
                chunk = _chunk(ctx, body, stream, index, out, cursors[index])
                if chunk is not None:
                    yield sse_event(chunk)
        if stream.include_usage:
            yield sse_event(stream.usage_chunk(gen.usage()))
    except OpenAIError as exc:
        yield sse_event(exc.body())
    yield SSE_DONE


def _echo_chunk(
    ctx: ServingContext,
    body: CompletionRequest,
    stream: StreamContext,
    index: int,
    prompt: _Prompt,
    first: RequestOutput | None,
    cursor: _ChoiceCursor,
) -> CompletionStreamResponse:
    logprobs = None
    if body.logprobs is not None and first is not None:
        logprobs = completion_logprobs(
            ctx.llm.tokenizer, prompt.ids, _prompt_token_logprobs(first, len(prompt.ids)), 0, body.logprobs
        )
        cursor.offset = sum(len(t) for t in logprobs.tokens)
    return stream.completion_chunk(index, prompt.text, logprobs=logprobs)


def _chunk(
    ctx: ServingContext,
    body: CompletionRequest,
    stream: StreamContext,
    index: int,
    out: RequestOutput,
    cursor: _ChoiceCursor,
) -> CompletionStreamResponse | None:
    choice = out.outputs[0]
    logprobs = None
    if body.logprobs is not None and len(choice.token_ids) > cursor.tokens:
        new_ids = choice.token_ids[cursor.tokens :]
        logprobs = completion_logprobs(
            ctx.llm.tokenizer, new_ids, (choice.logprobs or [])[cursor.tokens :], cursor.offset, body.logprobs
        )
        cursor.offset += sum(len(t) for t in logprobs.tokens)
    new_tokens = list(choice.token_ids[cursor.tokens :]) if body.return_token_ids else []
    cursor.tokens = len(choice.token_ids)
    if not (out.delta_text or out.finished or logprobs or new_tokens):
        return None
    finish = choice.finish_reason if out.finished else None
    stop_reason = choice.stop_reason if out.finished else None
    chunk = stream.completion_chunk(index, out.delta_text, finish, logprobs, stop_reason)
    if body.return_token_ids:
        chunk.choices[0].token_ids = new_tokens
    return chunk
