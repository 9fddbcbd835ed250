"""CrdReference: every InferencePool field, from the CRD schema the pydantic models generate."""

from __future__ import annotations

import json
from typing import Any

from pool_operator import models
from pool_operator.crdgen import CrdGenerator
from scripts.docsgen.markdown import code, generated_header, table

_CONSTRAINTS = (
    ("minimum", ">= {}"),
    ("maximum", "<= {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("pattern", "matches {}"),
)


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type(node['additionalProperties'])}"
    if kind == "object" and node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (free form)"
    return str(kind)


def _constraints(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(code(v) for v in node["enum"]))
    for key, fmt in _CONSTRAINTS:
        if key in node:
            strict = node.get(f"exclusive{key[0].upper()}{key[1:]}") is True
            text = fmt.format(code(node[key]) if key == "pattern" else node[key])
            parts.append(text.replace(">=", ">").replace("<=", "<") if strict else text)
    return "; ".join(parts)


class CrdReference:
    """Walks the CRD's openAPIV3Schema: one table row per field, the CEL rules after each table."""

    def render(self) -> str:
        schema = CrdGenerator().root_schema()
        out = [
            generated_header(
                "InferencePool reference", "`operator/pool_operator/models.py` (via `pool_operator.crdgen`)"
            )
        ]
        out.append(
            f"`apiVersion: {models.API_VERSION}`, `kind: {models.KIND}` (plural `{models.PLURAL}`, short name "
            f"`{models.SHORT_NAMES[0]}`). The CRD (`crds/{models.PLURAL}.{models.GROUP}.yaml`) and this page "
            "are both generated from the pydantic models, so they cannot disagree. A field marked required must "
            "be set; the API server applies the defaults shown. Unknown fields are an error for the operator and `kvferry render` (the models forbid them) and for `kubectl apply` (strict field validation); the API server prunes them from other clients.\n\n"
        )
        out.append(self._rules(models.KIND, schema))
        for part in ("spec", "status"):
            node = schema["properties"][part]
            out.append(f"\n## `{part}`\n\n{node.get('description', '')}\n\n")
            rows: list[tuple[str, str, str, str, str]] = []
            rules: list[str] = []
            self._walk(part, node, rows, rules)
            out.append(table(["field", "type", "default", "constraints", "meaning"], rows))
            rules = [r for r in rules if r]
            if rules:
                out.append(
                    "\n**Validation rules** (CEL rules of the CRD, checked by the API server; the operator "
                    "and `kvferry render` check the same rules when they read a pool):\n\n"
                )
                out.append("".join(rules))
        return "".join(out)

    def _walk(self, path: str, node: dict[str, Any], rows: list[Any], rules: list[str]) -> None:
        rules.append(self._rules(path, node))
        required = set(node.get("required", ()))
        for name, child in node.get("properties", {}).items():
            child_path = f"{path}.{name}"
            default = json.dumps(child["default"]) if "default" in child else ""
            name_cell = code(child_path) + (" (required)" if name in required else "")
            rows.append(
                (
                    name_cell,
                    _type(child),
                    code(default) if default else "",
                    _constraints(child),
                    child.get("description", ""),
                )
            )
            items = child.get("items", {})
            if child.get("type") == "array" and items.get("type") == "object":
                self._walk(f"{child_path}[]", items, rows, rules)
            elif child.get("type") == "object" and "properties" in child:
                self._walk(child_path, child, rows, rules)

    @staticmethod
    def _rules(path: str, node: dict[str, Any]) -> str:
        return "".join(
            f"- on {code(path)}: {rule['message']} ({code(rule['rule'])})\n"
            for rule in node.get("x-kubernetes-validations", ())
        )
