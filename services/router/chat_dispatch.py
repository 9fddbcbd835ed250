"""dispatch_chat: route a chat body built by another API (Responses, Anthropic Messages) down the router's
own chat path (template, tools, prefix index, scheduler), answering through a ChatAdapter."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from services.common.openai.errors import model_not_found, parse_body
from services.common.openai.http_middleware import presented_key
from services.common.openai.protocol import ChatCompletionRequest
from services.router.chat_adapter import ChatAdapter
from services.router.context_limit import check_prompt_fits
from services.router.pd_flow import Dispatched
from services.router.priority_gate import check_priority
from services.router.router_state import RouterState
from services.router.sessions.session_affinity import session_key


def adapter_name(state: RouterState, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model); 404 when no engine serves it."""
    if model is None or model == state.settings.model_name:
        return None
    if model in state.lora_adapters():
        return model
    raise model_not_found(model)


async def dispatch_chat(
    state: RouterState, request: Request, body: dict[str, Any], session: str | None = None
) -> tuple[Dispatched, ChatAdapter, dict[str, str]]:
    """Validate ``body`` as a chat request (400 naming the field), prepare and route it as
    ``/v1/chat/completions`` does (the tenant's cache salt under --salt-from-api-key); with the answer's
    headers (the routing headers and the tenant's ``x-ratelimit-*``)."""
    chat = parse_body(ChatCompletionRequest, body)
    check_priority(state.settings, chat.priority, presented_key(request.headers))  # as admit() does
    lora = adapter_name(state, chat.model)
    if state.settings.salt_from_api_key:
        chat.cache_salt = f"tenant:{request.state.tenant}"
    state.tokenizer.max_text_tokens = state.max_model_len()
    req = await state.preparer.chat_async(chat, lora)
    req.arrival = request.state.arrival
    req.session = session_key(request, session, chat.user)
    check_prompt_fits(req, state.max_model_len())
    assert state.admission is not None
    lease = await state.admission.admit_request(request, req.prompt_tokens, req.max_output_tokens)
    rid = request.state.request_id
    try:
        d = await state.flow.run(req, await state.context(req), rid)
    except BaseException:
        lease.cancel()
        raise
    lease.bind(d.body, None if d.stream is None else d.stream.on_close)
    adapter = ChatAdapter(lora or state.settings.model_name, rid, None, 1, req.include_usage, req.chat_plan)
    return d, adapter, {**d.headers(), **lease.headers}
