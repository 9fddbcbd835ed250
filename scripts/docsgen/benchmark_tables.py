"""BenchmarkTables: any benchmark JSON as Markdown: its provenance, then a table per list or mapping."""

from __future__ import annotations

import re
from typing import Any

from scripts.docsgen.markdown import code, number, table

NOT_RECORDED = "not recorded in the JSON"
_PROVENANCE = {  # what the page shows -> the keys benchmarks have used for it, first found wins
    "date": ("date", "time"),
    "CPU": ("cpu",),
    "machine": ("machine", "arch"),
    "cores": ("cores", "cpus"),
    "command": ("command",),
}
_SKIPPED = {"runs", "sample", "out", "note", "floor_formula", "prefix_warming", "vllm_env", "baseline"}


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _flat(value: Any) -> str | None:
    """A cell for a value, or None when it is too big for one (long lists of repeats stay in the JSON)."""
    if _scalar(value):
        return number(value) if not isinstance(value, str) else value
    if isinstance(value, list) and len(value) <= 2 and all(_scalar(v) for v in value):
        return " → ".join(number(v) for v in value)
    return None


def _row_cells(row: dict[str, Any]) -> dict[str, str]:
    cells: dict[str, str] = {}
    for key, value in row.items():
        if key in _SKIPPED:
            continue
        if isinstance(value, dict):
            for sub, inner in value.items():
                text = _flat(inner)
                if text is not None:
                    cells[f"{key}.{sub}"] = text
            continue
        text = _flat(value)
        if text is not None:
            cells[key] = text
    return cells


def _records_table(records: list[tuple[str | None, dict[str, Any]]]) -> str:
    rows = [({"": name} if name is not None else {}) | _row_cells(rec) for name, rec in records]
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    numeric = ["r" if all(r.get(c, "–")[:1] in "-–0123456789" for r in rows) else "l" for c in columns]
    return table(columns, ([r.get(c, "") for c in columns] for r in rows), numeric)


class BenchmarkTables:
    """Renders one benchmark result file; nothing in it is typed by hand."""

    def provenance(self, data: dict[str, Any], command: str) -> list[tuple[str, str]]:
        """(what, value) rows: date, CPU, machine, cores, command, from the JSON where it says."""
        places = [data, data.get("meta") or {}, data.get("config") or {}]
        out = []
        for label, keys in _PROVENANCE.items():
            found = next(
                (p[k] for p in places for k in keys if isinstance(p, dict) and p.get(k) is not None), None
            )
            if label == "command":
                found = re.sub(r"^\S*/bin/python3?\b", "python", str(found)) if found else None
                out.append(
                    (
                        label,
                        code(found) if found else f"{code(command)} (the script; arguments {NOT_RECORDED})",
                    )
                )
            else:
                out.append((label, str(found) if found is not None else NOT_RECORDED))
        return out

    def render(self, data: dict[str, Any]) -> str:
        """Settings (top-level scalars), then one table per list of records or mapping of records."""
        out = []
        settings = [(k, _flat(v)) for k, v in data.items() if k not in _SKIPPED and _flat(v) is not None]
        for key, value in data.items():
            if key in ("meta", "config") and isinstance(value, dict):
                settings += [
                    (f"{key}.{k}", _flat(v))
                    for k, v in value.items()
                    if k not in _SKIPPED and _flat(v) is not None
                ]
        if settings:
            out.append(table(["setting", "value"], ((code(k), v) for k, v in settings)))
        for key, value in data.items():
            if key in _SKIPPED or key in ("meta", "config"):
                continue
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                out.append(f"\n**{key}**\n\n" + _records_table([(None, v) for v in value]))
            elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
                out.append(f"\n**{key}**\n\n" + _records_table(list(value.items())))
            elif isinstance(value, dict) and value and any(_flat(v) is not None for v in value.values()):
                pairs = [(code(k), _flat(v)) for k, v in value.items() if _flat(v) is not None]
                out.append(f"\n**{key}**\n\n" + table([key, "value"], pairs))
        return "".join(out)
