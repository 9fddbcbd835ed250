"""The pool page's routes: ``/ui`` (the page), its script and style, and ``/ui/state`` (the JSON it polls)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from services.common.openai.http_middleware import key_allowed, presented_key
from services.router.decision_log import DECISIONS_KEPT
from services.router.router_state import RouterState
from services.router.ui.pool_view import DECISIONS_SHOWN, PoolView, pool_view

_ASSETS = {
    "": ("pool.html", "text/html; charset=utf-8"),
    "/pool.js": ("pool.js", "text/javascript; charset=utf-8"),
    "/pool.css": ("pool.css", "text/css; charset=utf-8"),
}
# Everything the page loads comes from the router itself: no CDN, no inline script, no external font.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_REALM = 'Basic realm="kvferry pool page", charset="UTF-8"'


def _asset(name: str, media_type: str) -> Callable[[], Awaitable[Response]]:
    """A route serving one file of ``static/`` (read once: the files ship inside the package)."""
    body = files("services.router.ui").joinpath("static", name).read_bytes()

    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    return asset


def ui_routes(state: RouterState) -> APIRouter:
    """The page is open when the router has no API keys; with keys, every /ui route needs one of them
    or an admin key (a Bearer token, or a browser's Basic login with the key as the password), like /v1.
    Request ids (a tenant's own labels) are shown only to an admin key, or to all on a router without keys."""
    admins = [k.encode() for k in state.settings.admin_api_keys]
    keys = [k.encode() for k in state.settings.api_keys] + admins

    def guard(request: Request) -> None:
        if keys and not key_allowed(presented_key(request.headers), keys):
            raise HTTPException(
                401,
                "The pool page needs one of the router's API keys: 'Authorization: Bearer KEY', or KEY as "
                "the password of the browser's login (any user name).",
                headers={"WWW-Authenticate": _REALM},
            )

    router = APIRouter(prefix="/ui", dependencies=[Depends(guard)])
    for path, (name, media_type) in _ASSETS.items():
        router.add_api_route(path, _asset(name, media_type), methods=["GET"], include_in_schema=False)

    @router.get("/state")
    async def ui_state(
        request: Request,
        decisions: Annotated[int, Query(ge=0, le=DECISIONS_KEPT)] = DECISIONS_SHOWN,
    ) -> PoolView:
        """Engines, the last ``decisions`` routing decisions (newest first) and the router's settings."""
        unknown = sorted(set(request.query_params) - {"decisions"})
        if unknown:  # e.g. decisions[x]=1: a misspelt or misshapen parameter is an error, not the default
            raise HTTPException(
                400, f"unknown query parameter(s) {', '.join(unknown)}; /ui/state takes decisions=N"
            )
        occupancy = await state.index.occupancy() if state.index is not None else None
        view = pool_view(state, decisions, occupancy)
        if keys and not key_allowed(presented_key(request.headers), admins):
            view.decisions = [d.model_copy(update={"request_id": ""}) for d in view.decisions]
            if view.queue is not None:  # other tenants' names and load are an admin's to see
                view.queue.rows = []
        return view

    return router
