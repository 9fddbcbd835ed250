"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's endpoints), for engines with LoRA."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.common.openai.errors import OpenAIError, bad_request
from services.engine.entrypoints.serving import ServingContext


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's optional id: accepted, unused


def _check_allowed(ctx: ServingContext) -> None:
    if ctx.llm.engine.core.lora is None:
        raise bad_request("this engine was started without --enable-lora", "lora_name", "lora_disabled")
    if not ctx.settings.allow_runtime_lora_updating:
        raise bad_request(
            "runtime LoRA updates are off (start the engine with --allow-runtime-lora-updating)",
            "lora_name",
            "lora_updates_disabled",
        )


async def load_lora_adapter(ctx: ServingContext, body: LoadLoRARequest) -> str:
    """Load an adapter between engine steps; 400 naming the problem for a bad folder or a taken name."""
    _check_allowed(ctx)
    if body.lora_name == ctx.model_name:
        raise bad_request(f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
    try:
        await ctx.llm.update_lora(body.lora_name, body.lora_path)
    except (ValueError, OSError) as exc:
        raise bad_request(str(exc), "lora_path") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


async def unload_lora_adapter(ctx: ServingContext, body: UnloadLoRARequest) -> str:
    """Unload an adapter: new requests get 404, requests already running under it finish first."""
    _check_allowed(ctx)
    try:
        await ctx.llm.update_lora(body.lora_name, None)
    except KeyError:
        raise OpenAIError(
            404,
            f"The LoRA adapter '{body.lora_name}' is not loaded.",
            "invalid_request_error",
            "lora_name",
            "model_not_found",
        ) from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
