"""OpenAI error bodies (``{"error": {"message", "type", "param", "code"}}``) and request parsing.

``param`` names the offending field the way OpenAI does: dotted, list indices in brackets
(``messages.[0].content``). Type and code values follow OpenAI: client mistakes are
``invalid_request_error``; 401 carries code ``invalid_api_key``, 404 ``model_not_found``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
# Union-member tags pydantic puts in an error's loc; they are not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})

Model = TypeVar("Model", bound=BaseModel)


class ErrorInfo(BaseModel):
    """The inner object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body."""

    error: ErrorInfo


class OpenAIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body; raise it from handlers."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers: dict[str, str] = {}  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return ErrorResponse(error=self.info).model_dump()

    def as_tuple(self) -> tuple[int, dict[str, Any]]:
        """``(status, body)``."""
        return self.status, self.body()


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` for any OpenAI error."""
    return OpenAIError(status, message, type, param, code).as_tuple()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 ``invalid_request_error`` (e.g. prompt + max_tokens over max_model_len, param "max_tokens")."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Incorrect API key provided.") -> OpenAIError:
    """401 for a missing or wrong API key."""
    return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    """404 for a model this server does not serve (``param`` is "model")."""
    message = f"The model `{model}` does not exist."
    return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")


def not_ready(message: str = "The server is not ready yet.") -> OpenAIError:
    """503 while the model loads, during warm-up or while draining."""
    return OpenAIError(503, message, "server_error", None, "service_unavailable")


def server_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    """500 for a failure that is not the client's fault."""
    return OpenAIError(500, message, "server_error", None, None)


def param_path(loc: Sequence[str | int]) -> str | None:
    """OpenAI-style field path of a pydantic error location, without union tags or ``body``."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f".[{part}]" if out else f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def _describe(error: Mapping[str, Any]) -> tuple[str | None, str]:
    if error.get("type") == "json_invalid":
        return None, f"We could not parse the JSON body of your request: {error.get('msg', '')}"
    param = param_path(error.get("loc", ()))
    extra = (error.get("ctx") or {}).get("param")
    if extra:
        param = f"{param}.{extra}" if param else extra
    message = str(error.get("msg", "invalid value"))
    return param, f"{param}: {message}" if param else message


def validation_error_response(
    exc: ValidationError | Sequence[Mapping[str, Any]],
) -> tuple[int, dict[str, Any]]:
    """``(400, OpenAI error body)`` for a pydantic ``ValidationError`` or FastAPI's ``exc.errors()``.

    The first error names ``param``; the message says how many more there were.
    """
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else list(exc)
    if not errors:
        return bad_request("Invalid request.").as_tuple()
    param, message = _describe(errors[0])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param).as_tuple()


def parse_body(model: type[Model], raw: bytes | str | Mapping[str, Any]) -> Model:
    """Validate a raw JSON body (or an already-decoded dict); raise ``OpenAIError(400)`` if invalid."""
    try:
        if isinstance(raw, bytes | str):
            return model.model_validate_json(raw)
        return model.model_validate(raw)
    except ValidationError as exc:
        status, body = validation_error_response(exc)
        raise OpenAIError(status, **body["error"]) from exc


def config_problem(exc: ValueError) -> str:
    """One line naming each bad field of a config/flags error (pydantic's ValidationError or a ValueError)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in errors(include_url=False)
        )
    return str(exc)
