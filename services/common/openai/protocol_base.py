"""Base models of the OpenAI protocol: strict request bodies, lax responses, and errors that name a field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


def field_error(param: str, message: str) -> PydanticCustomError:
    """A validation error for a model-level check that names ``param`` as the offending field."""
    return PydanticCustomError("invalid_field", message, {"param": param})


class RequestModel(BaseModel):
    """Base of every request body: strict types, no NaN or infinity, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ResponseModel(BaseModel):
    """Base of every response body: lax, so the server may pass tuples or numpy scalars."""

    model_config = ConfigDict(extra="forbid")
