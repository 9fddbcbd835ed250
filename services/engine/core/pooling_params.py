"""PoolingParams: what an embedding request asks of the engine (its prompt is pooled, nothing is sampled)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PoolingParams(BaseModel):
    """``dimensions``: keep the first N dimensions (Matryoshka models only), re-normalized when the model normalizes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dimensions: int | None = Field(None, ge=1)
