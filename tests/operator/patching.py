"""FieldManagers: the API server's patch semantics for the emulator (merge, JSON patch, server-side apply)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

Path = tuple[str, ...]


class ApplyConflict(Exception):
    """Another manager owns a field with a different value (HTTP 409 without force)."""

    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        self.conflicts = conflicts
        text = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {text}")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902; raises jsonpatch.JsonPatchException (incl. a failed `test`) -> HTTP 422."""
    return jsonpatch.apply_patch(target, operations, in_place=False)


def leaf_paths(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Path -> value of every leaf; lists are atomic leaves (no list-map merging)."""
    if isinstance(obj, dict) and obj:
        out: dict[Path, Any] = {}
        for key, value in obj.items():
            out.update(leaf_paths(value, (*prefix, key)))
        return out
    return {prefix: obj} if prefix else {}


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _remove(obj: dict[str, Any], path: Path) -> None:
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):  # drop emptied parents
        if parents[depth] == {}:
            parents[depth - 1].pop(path[depth - 1], None)


def _to_fields_v1(paths: list[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


IGNORED_ROOTS = {
    ("metadata", "managedFields"),
    ("metadata", "resourceVersion"),
    ("metadata", "uid"),
    ("metadata", "generation"),
    ("metadata", "creationTimestamp"),
    ("apiVersion",),
    ("kind",),
    ("metadata", "name"),
    ("metadata", "namespace"),
}


def _tracked(path: Path) -> bool:
    return not any(path[: len(root)] == root for root in IGNORED_ROOTS)


@dataclass
class FieldManagers:
    """Who owns which leaf of one object (metadata.managedFields, simplified to atomic lists)."""

    owners: dict[str, tuple[str, set[Path]]] = field(default_factory=dict)  # manager -> (operation, paths)

    def record_update(self, manager: str, before: dict[str, Any], after: dict[str, Any]) -> None:
        """A non-apply write: the manager takes the leaves it changed."""
        changed = {p for p, v in leaf_paths(after).items() if _tracked(p) and _get(before, p) != v}
        if not changed:
            return
        for other, (_, paths) in self.owners.items():
            if other != manager:
                paths -= changed
        operation, paths = self.owners.get(manager, ("Update", set()))
        self.owners[manager] = ("Update" if operation != "Apply" else operation, paths | changed)

    def apply(
        self, manager: str, live: dict[str, Any], config: dict[str, Any], force: bool
    ) -> dict[str, Any]:
        """Server-side apply of `config` by `manager` onto `live`; returns the new object."""
        wanted = {p: v for p, v in leaf_paths(config).items() if _tracked(p)}
        conflicts = [
            (other, p)
            for other, (_, paths) in self.owners.items()
            if other != manager
            for p in sorted(paths)
            if p in wanted and _get(live, p) != wanted[p]
        ]
        if conflicts and not force:
            raise ApplyConflict(conflicts)
        result = copy.deepcopy(live)
        _, previous = self.owners.get(manager, ("Apply", set()))
        shared = set().union(*(paths for other, (_, paths) in self.owners.items() if other != manager))
        for path in sorted(previous - set(wanted) - shared, key=len, reverse=True):
            _remove(result, path)
        for other, (_, paths) in self.owners.items():
            if other != manager:
                paths -= set(wanted)
        result = merge_patch(result, _without_nulls(config))
        self.owners[manager] = ("Apply", set(wanted))
        return result

    def managed_fields(self, api_version: str, time: str) -> list[dict[str, Any]]:
        return [
            {
                "manager": manager,
                "operation": operation,
                "apiVersion": api_version,
                "time": time,
                "fieldsType": "FieldsV1",
                "fieldsV1": _to_fields_v1(sorted(paths)),
            }
            for manager, (operation, paths) in sorted(self.owners.items())
            if paths
        ]


def _without_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    return obj
