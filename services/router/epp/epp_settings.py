"""EppSettings: where the router's endpoint picker listens and what it answers (``--epp-*`` flags)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EppSettings(BaseModel):
    """``kvferry router --epp-port``: where the endpoint picker listens and what it answers."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    fallbacks: int = Field(
        0, ge=0, le=7, description="endpoints after the primary in the destination (data planes that retry)"
    )
    max_body_bytes: int = Field(16 * 2**20, gt=0, description="largest request body the picker reads")
