"""``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize``: answers from the tokenizer alone."""

from __future__ import annotations

from services.common.openai.chat_prompt import detokenize_response, tokenize_response
from services.common.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from services.engine.entrypoints.serving import ServingContext


def list_models(ctx: ServingContext) -> ModelList:
    """The model this server serves, then its LoRA adapters (``parent``: the base model)."""
    core = ctx.llm.engine.core
    card = ModelCard(
        id=ctx.model_name,
        root=ctx.llm.config.model,
        max_model_len=ctx.max_model_len,
        quantization=core.quant.describe(),
    )
    paths = core.lora.paths if core.lora is not None else {}
    adapters = [
        ModelCard(id=name, root=path, parent=ctx.model_name, max_model_len=ctx.max_model_len)
        for name, path in paths.items()
    ]
    return ModelList(data=[card, *adapters])


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    """Token ids of a prompt, or of messages rendered with the chat template."""
    ctx.check_model(body.model)
    return tokenize_response(ctx.llm.tokenizer, body, ctx.max_model_len)


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids (400 for ids outside the vocabulary)."""
    ctx.check_model(body.model)
    return detokenize_response(ctx.llm.tokenizer, body, ctx.vocab_size)
