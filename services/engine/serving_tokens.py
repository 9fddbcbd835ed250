"""``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize``: answers from the tokenizer alone."""

from __future__ import annotations

from services.common.errors import bad_request
from services.common.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from services.common.tokenizer import ChatTemplateError
from services.engine.serving import ServingContext


def list_models(ctx: ServingContext) -> ModelList:
    """The one model this server serves."""
    card = ModelCard(id=ctx.model_name, root=ctx.llm.config.model, max_model_len=ctx.max_model_len)
    return ModelList(data=[card])


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    """Token ids of a prompt, or of messages rendered with the chat template."""
    ctx.check_model(body.model)
    tok = ctx.llm.tokenizer
    if body.messages is not None:
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = tok.encode_chat(conversation, body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    else:
        ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    strs = [tok.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids (400 for ids outside the vocabulary)."""
    ctx.check_model(body.model)
    if any(t >= ctx.vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {ctx.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=ctx.llm.tokenizer.decode(body.tokens))
