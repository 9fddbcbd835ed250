"""OpenAI ``/v1/embeddings``: the request (strings or token ids, float or base64, dimensions) and the response."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.common.openai.protocol_base import RequestModel, ResponseModel, field_error

TokenIds = list[Annotated[int, Field(ge=0)]]


class EmbeddingRequest(RequestModel):
    """``input``: a string, a list of strings, a list of token ids, or a list of token-id lists."""

    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> EmbeddingRequest:
        items = self.inputs()
        if not items or any(len(item) == 0 for item in items):
            raise field_error("input", "must not be empty (nor contain an empty string or token list)")
        return self

    def inputs(self) -> list[str | list[int]]:
        """Each input to embed, in order."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [[t for t in self.input if isinstance(t, int)]]
        return [item for item in self.input if not isinstance(item, int)]


class EmbeddingData(ResponseModel):
    """One embedding: floats, or the base64 of their little-endian float32 bytes."""

    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(ResponseModel):
    """Token accounting: every input token is a prompt token."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    """``{"object": "list", "data": [...], "model", "usage"}``."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
