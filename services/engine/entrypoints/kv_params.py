"""kv_transfer_params as a role's admission reads them: validated (400 naming the field) or refused (409)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from services.common.kv.kv_transfer import KVIncompatibleError, KVTransferParams
from services.common.openai.errors import OpenAIError, bad_request


def parse_kv_transfer_params(raw: dict[str, Any], n: int, role: str, unsupported: str) -> KVTransferParams:
    """Validated params (400 naming the field otherwise); ``unsupported`` is the flag this role refuses."""
    try:
        params = KVTransferParams.model_validate(raw)
    except ValidationError as exc:
        raise bad_request(
            f"invalid kv_transfer_params: {exc.errors()[0]['msg']}", "kv_transfer_params"
        ) from exc
    if n != 1:
        raise bad_request("kv_transfer_params needs n=1", "n")
    if getattr(params, unsupported):
        raise bad_request(
            f"this is a {role} engine: kv_transfer_params.{unsupported} is not served here",
            "kv_transfer_params",
        )
    return params


def kv_incompatible(exc: KVIncompatibleError) -> OpenAIError:
    """Engines that disagree on model / block size / hash version refuse KV: loudly, never silently."""
    return OpenAIError(409, str(exc), "invalid_request_error", "kv_transfer_params", "kv_incompatible")
