"""FaithfulKubernetes: kmock's emulator plus what kopf relies on (uid, resourceVersion, generation, ...)."""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml

from tests.operator.patching import ApplyConflict, FieldManagers, json_patch, merge_patch

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


class ApiError(Exception):
    """An API answer with a status code (rendered as a metav1.Status)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": message,
        },
        status=code,
    )


def selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Label selector grammar: a=b, a==b, a!=b, a, !a, a in (x,y), a notin (x,y); comma = AND."""
    if not selector:
        return True
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    terms.append(current.strip())
    for term in filter(None, terms):
        words = term.replace("(", " ( ").split()
        if len(words) >= 2 and words[1] in ("in", "notin"):
            values = {v.strip() for v in term.split("(", 1)[1].rstrip(")").split(",")}
            if (labels.get(words[0]) in values) != (words[1] == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _expired(since: int, compacted: int) -> bytes:
    """The watch event the API server sends when the requested resourceVersion was compacted away."""
    status = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": 410,
        "reason": "Expired",
        "message": f"too old resource version: {since} ({compacted})",
    }
    return json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"


def _essence(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class FaithfulKubernetes(kmock.KubernetesEmulator):
    """Adds uid/resourceVersion/generation, status subresources, patch types, SSA, 409/422, watch-from-RV, GC."""

    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _managers: dict[tuple[Any, str | None, str], FieldManagers] = attrs.field(factory=dict, init=False)
    _compacted: int = attrs.field(default=0, init=False)  # watches from an older resourceVersion get 410
    _expiries: int = attrs.field(default=0, init=False)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is None or not resource.plural or not resource.version:
            return await super()._handle(request)
        try:
            if resource not in self.resources:
                raise ApiError(
                    404, "NotFound", f"the server could not find the requested resource {resource}"
                )
            return await self._dispatch(request)
        except ApiError as error:
            return _status(error.code, error.reason, error.message)

    async def _dispatch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        method, name, sub = request.method.value.upper(), request.name, request.subresource
        info = self.resources[request.resource]
        if sub and sub not in info.subresources:
            raise ApiError(404, "NotFound", f"{request.resource.plural} has no subresource {sub!r}")
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request)
        if method == "GET":
            return aiohttp.web.json_response(self._get(request) if name else self._list(request))
        if method == "POST" and not name:
            return aiohttp.web.json_response(await self._create(request), status=201)
        if method == "PATCH" and name:
            return aiohttp.web.json_response(await self._patch(request))
        if method == "PUT" and name:
            return aiohttp.web.json_response(await self._write(request, self._body(request), "update"))
        if method == "DELETE" and name:
            return aiohttp.web.json_response(await self._delete(request.resource, request.namespace, name))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    # -- helpers ----------------------------------------------------------------------------
    def _key(self, request: kmock.Request, name: str | None = None) -> tuple[Any, str | None, str]:
        return request.resource, request.namespace, name or request.name

    def _current(self, key: tuple[Any, str | None, str]) -> dict[str, Any] | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _body(self, request: kmock.Request) -> Any:
        try:
            return yaml.safe_load(request.text) if request.text else None
        except yaml.YAMLError as error:
            raise ApiError(400, "BadRequest", f"cannot decode body: {error}") from None

    @staticmethod
    def _manager(request: kmock.Request) -> str:
        return (
            request.params.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
        )

    async def _emit(self, resource: Any, kind: str, obj: dict[str, Any]) -> None:
        async with self._changed:
            self._log.append((self._rv, resource, {"type": kind, "object": copy.deepcopy(obj)}))
            self._changed.notify_all()

    def _stamp(self, key: tuple[Any, str | None, str], obj: dict[str, Any]) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        managers = self._managers.setdefault(key, FieldManagers())
        fields = managers.managed_fields(obj.get("apiVersion", ""), _now())
        if fields:
            obj["metadata"]["managedFields"] = fields

    # -- reads ------------------------------------------------------------------------------
    def _get(self, request: kmock.Request) -> dict[str, Any]:
        obj = self._current(self._key(request))
        if obj is None:
            raise ApiError(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        return obj

    def _matching(self, request: kmock.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return (request.namespace is None or meta.get("namespace") == request.namespace) and selector_matches(
            request.params.get("labelSelector"), meta.get("labels") or {}
        )

    def _list(self, request: kmock.Request) -> dict[str, Any]:
        items = [
            copy.deepcopy(o.raw)
            for (res, _, _), o in self._objects.items()
            if res == request.resource and not o.deleted
        ]
        items = [o for o in items if self._matching(request, o)]
        return {
            "apiVersion": "v1",
            "kind": "List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    async def _watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        since = request.params.get("resourceVersion")
        if since in (None, "", "0"):
            cursor = self._rv
            for item in self._list(request)["items"]:
                await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        else:
            cursor = int(since)
            if cursor < self._compacted:
                await response.write(_expired(cursor, self._compacted))
                return response
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        epoch = self._expiries
        try:
            async with asyncio.timeout(timeout):
                while True:
                    async with self._changed:
                        await self._changed.wait_for(
                            lambda seen=cursor: self._rv > seen or self._expiries != epoch
                        )
                    if self._expiries != epoch:
                        await response.write(_expired(cursor, self._compacted))
                        break
                    events = [(rv, e) for rv, res, e in self._log if rv > cursor and res == request.resource]
                    cursor = self._rv
                    for _, event in events:
                        if self._matching(request, event["object"]):
                            await response.write(json.dumps(event).encode() + b"\n")
        except TimeoutError:
            pass
        return response

    async def expire_watches(self) -> None:
        """Compact the history up to now, as etcd does: open watches end with an ERROR event (410
        Expired), and so does any later watch from an older resourceVersion (clients must list again)."""
        async with self._changed:
            self._compacted = self._rv
            self._expiries += 1
            self._changed.notify_all()

    # -- writes -----------------------------------------------------------------------------
    async def _create(self, request: kmock.Request) -> dict[str, Any]:
        body = self._body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be an object")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        if request.namespace:
            meta["namespace"] = request.namespace
        key = self._key(request, meta["name"])
        if self._current(key) is not None:
            raise ApiError(409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
        return await self._store_new(key, body, self._manager(request), "Update")

    async def _store_new(
        self, key: tuple[Any, str | None, str], body: dict[str, Any], manager: str, operation: str
    ) -> dict[str, Any]:
        if "status" in self.resources[key[0]].subresources:
            body.pop("status", None)  # set through the status subresource only
        meta = body["metadata"]
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        meta.pop("resourceVersion", None)
        meta.pop("deletionTimestamp", None)
        managers = self._managers[key] = FieldManagers()
        if operation == "Apply":
            managers.apply(manager, {}, body, force=True)
        else:
            managers.record_update(manager, {}, body)
        self._stamp(key, body)
        if key in self._objects:
            self._objects[key].create(body)
        else:
            self._objects[key] = body
        await self._emit(key[0], "ADDED", body)
        return copy.deepcopy(body)

    async def _patch(self, request: kmock.Request) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = self._body(request)
        key = self._key(request)
        live = self._current(key)
        if content_type == APPLY:
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "apply config must be an object")
            if not request.params.get("fieldManager"):
                raise ApiError(400, "BadRequest", "fieldManager is required for apply requests")
            if live is None and not request.subresource:
                body.setdefault("metadata", {}).update(name=request.name, namespace=request.namespace)
                return await self._store_new(key, body, request.params["fieldManager"], "Apply")
            return await self._write(request, body, "apply")
        if live is None:
            raise ApiError(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        if content_type in (MERGE, STRATEGIC):
            return await self._write(request, merge_patch(live, body), "update", precondition=body)
        if content_type == JSON_PATCH:
            try:
                return await self._write(request, json_patch(live, body), "update")
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                raise ApiError(422, "Invalid", f"the server rejected our request: {error}") from None
        raise ApiError(
            415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {content_type}"
        )

    async def _write(
        self, request: kmock.Request, body: Any, mode: str, precondition: Any = None
    ) -> dict[str, Any]:
        key = self._key(request)
        live = self._current(key)
        if live is None:
            raise ApiError(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        expected = (
            ((precondition if mode == "update" and precondition is not None else body) or {})
            .get("metadata", {})
            .get("resourceVersion")
        )
        if expected and expected != live["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        managers = self._managers.setdefault(key, FieldManagers())
        if mode == "apply":
            try:
                new = managers.apply(
                    request.params["fieldManager"], live, body, force=request.params.get("force") == "true"
                )
            except ApplyConflict as error:
                raise ApiError(409, "Conflict", str(error)) from None
        else:
            new = body
        new = self._protect(request, live, new)
        if mode != "apply":
            managers.record_update(self._manager(request), live, new)
        return await self._commit(key, live, new)

    def _protect(self, request: kmock.Request, live: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """Status subresource rules, immutable identity, generation bumps."""
        new = copy.deepcopy(new)
        has_status = "status" in self.resources[request.resource].subresources
        if request.subresource == "status":
            new = {**copy.deepcopy(live), "status": new.get("status")}
        elif has_status:
            new["status"] = live.get("status")
        new = {k: v for k, v in new.items() if v is not None}
        meta = new.setdefault("metadata", {})
        for field in ("uid", "name", "namespace", "creationTimestamp", "generation", "deletionTimestamp"):
            if field in live["metadata"]:
                meta[field] = live["metadata"][field]
        meta = {k: v for k, v in meta.items() if v is not None}
        new["metadata"] = meta
        if _essence(new) != _essence(live):
            meta["generation"] = live["metadata"].get("generation", 1) + 1
        return new

    async def _commit(
        self, key: tuple[Any, str | None, str], live: dict[str, Any], new: dict[str, Any]
    ) -> dict[str, Any]:
        if new == {**live}:
            return live  # a no-op write keeps the resourceVersion, as the API server does
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._stamp(key, new)
            await self._remove(key, new)
            return new
        self._stamp(key, new)
        self._objects[key].history.append(new)
        await self._emit(key[0], "MODIFIED", new)
        return copy.deepcopy(new)

    async def _delete(self, resource: Any, namespace: str | None, name: str) -> dict[str, Any]:
        key = (resource, namespace, name)
        live = self._current(key)
        if live is None:
            raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found')
        if live["metadata"].get("deletionTimestamp"):
            return live
        if live["metadata"].get("finalizers"):
            new = copy.deepcopy(live)
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            self._stamp(key, new)
            self._objects[key].history.append(new)
            await self._emit(resource, "MODIFIED", new)
            return new
        self._stamp(key, live)
        await self._remove(key, live)
        return live

    async def _remove(self, key: tuple[Any, str | None, str], last: dict[str, Any]) -> None:
        """Final removal, then the garbage collector: delete dependents whose owners are all gone."""
        self._objects[key].delete()
        self._managers.pop(key, None)
        await self._emit(key[0], "DELETED", last)
        alive = {o.raw["metadata"].get("uid") for o in self._objects.values() if not o.deleted}
        for (res, ns, name), obj in list(self._objects.items()):
            if obj.deleted:
                continue
            owners = obj.raw["metadata"].get("ownerReferences") or []
            if owners and not any(ref.get("uid") in alive for ref in owners):
                await self._delete(res, ns, name)
