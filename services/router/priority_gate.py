"""Who may set a request's ``priority`` through the router (or its endpoint picker): on a router with client
keys, only the keys of --priority-api-key-file; a keyless router (one tenant) passes it on."""

from __future__ import annotations

from services.common.openai.errors import OpenAIError
from services.common.openai.http_middleware import key_allowed
from services.router.settings import RouterSettings


def check_priority(settings: RouterSettings, priority: int, token: bytes | None) -> None:
    """403 naming ``priority`` when a client whose key may not jump the queue sets a non-zero priority."""
    if not priority or not settings.api_keys:
        return
    if key_allowed(token, [k.encode() for k in settings.priority_api_keys]):
        return
    raise OpenAIError(
        403,
        "priority: this API key may not set a priority (the router's --priority-api-key-file lists the keys "
        "that may)",
        "invalid_request_error",
        "priority",
        "priority_not_allowed",
    )
