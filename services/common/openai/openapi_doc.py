"""The OpenAPI document of the engine's and the router's apps, made true to what they answer.

FastAPI documents a 422 with its own validation body for every route that takes input, and nothing
else; ours answer OpenAI error bodies (400 for a bad request, 401, 404, 409, 503, 504), stream SSE
from the generation routes and serve Prometheus text from /metrics. ``document_answers`` rewrites the
generated document once, so schema-driven clients and fuzzers (schemathesis) see what really comes back.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.common.openai.errors import ErrorResponse
from services.common.openai.protocol_chat import ChatCompletionResponse
from services.common.openai.protocol_completions import CompletionResponse
from services.common.openai.sse import SSE_CONTENT_TYPE
from services.common.pool.pool_secret import SIDE_CHANNEL_PREFIX

_ERRORS = {
    "400": "Invalid request (body, field or value)",
    "401": "Missing or wrong API key (servers started with keys, /v1 routes) or pool secret (/kv/ routes)",
    "404": "Unknown model or adapter (/kv/ routes: this engine has no NIXL agent)",
    "409": "Remote KV this engine cannot take (kv_transfer_params)",
    "503": "Not ready, draining, or no engine could serve the request",
    "504": "The request ran past the server's request timeout",
}
_GENERATION: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionResponse,
}
_PLAIN_TEXT = {"/metrics"}
# One server-sent event (as parsed from ``data:`` lines): a JSON chunk, an error object, or ``[DONE]``.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
}
_REF = "#/components/schemas/"


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _add_model(doc: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s schema (and the ones it refers to) in the components; a $ref to it."""
    schema = model.model_json_schema(ref_template=_REF + "{model}")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF + model.__name__}


def _rewrite_operation(doc: dict[str, Any], path: str, op: dict[str, Any], error: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    takes_input = "requestBody" in op or bool(op.get("parameters"))
    codes = ["503"]
    if takes_input:
        codes += ["400", "404", "409", "504"]
    if path.startswith("/v1/"):
        codes.append("401")
    if path.startswith(SIDE_CHANNEL_PREFIX):  # the pool secret; 404: no NIXL agent to hand over
        codes += ["401", "404"]
    for code in sorted(codes):
        responses[code] = {"description": _ERRORS[code], "content": _json(error)}
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path in _GENERATION:
        ok["content"] = {
            **_json(_add_model(doc, _GENERATION[path])),
            SSE_CONTENT_TYPE: {"schema": _SSE_EVENT},
        }
    elif path in _PLAIN_TEXT:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}


def document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with its real answers (built once, then cached on the app)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = _add_model(doc, ErrorResponse)
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                _rewrite_operation(doc, path, op, error)
        schemas = doc.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = doc
    return app.openapi_schema


def document_answers(app: FastAPI) -> None:
    """Serve ``document(app)`` at /openapi.json instead of FastAPI's own."""
    app.openapi = lambda: document(app)  # type: ignore[method-assign]
