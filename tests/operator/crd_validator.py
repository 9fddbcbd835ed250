"""CrdValidator: what the API server does with a custom resource: default, reject unknown fields, check CEL."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

from pool_operator.crdgen import CRD_FILENAME

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / CRD_FILENAME


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """Structural pruning as validation: objects with properties reject unknown fields."""
    schema = {
        k: (
            _closed(v)
            if isinstance(v, dict)
            else [_closed(i) if isinstance(i, dict) else i for i in v]
            if isinstance(v, list)
            else v
        )
        for k, v in schema.items()
    }
    if "properties" in schema:
        schema["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    return schema


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, outside in, as the apiserver does it."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def typed(schema: dict[str, Any], value: Any) -> Any:
    """Numbers in `type: number` fields are CEL doubles even when written as 1 (as in the apiserver)."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return {k: typed(props.get(k, extra if isinstance(extra, dict) else {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(schema.get("items", {}), v) for v in value]
    return value


class CrdValidator:
    """Validates InferencePool objects against the generated CRD's openAPIV3Schema and CEL rules."""

    def __init__(self, crd_path: Path = CRD_PATH) -> None:
        crd = yaml.safe_load(crd_path.read_text())
        self.schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft4Validator(_closed(self.schema))
        self.cel = celpy.Environment()

    def errors(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
        """All problems (empty: accepted). `old` enables transition rules (an update)."""
        obj = apply_defaults(self.schema, copy.deepcopy(obj))
        problems = [
            f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in self.validator.iter_errors(obj)
        ]
        if problems:
            return problems
        old = apply_defaults(self.schema, copy.deepcopy(old)) if old is not None else None
        return self._cel(self.schema, obj, old, "")

    def _cel(self, schema: dict[str, Any], value: Any, old: Any, path: str) -> list[str]:
        problems = []
        for rule in schema.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"] and old is None:
                continue
            activation = {"self": celpy.json_to_cel(typed(schema, value))}
            if old is not None:
                activation["oldSelf"] = celpy.json_to_cel(typed(schema, old))
            result = self.cel.program(self.cel.compile(rule["rule"])).evaluate(activation)
            if not bool(result):
                problems.append(f"{path or '(root)'}: {rule['message']}")
        if isinstance(value, dict):
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    old_sub = old.get(key) if isinstance(old, dict) else None
                    problems += self._cel(sub, value[key], old_sub, f"{path}.{key}" if path else key)
        elif isinstance(value, list) and "items" in schema:
            for index, item in enumerate(value):
                problems += self._cel(schema["items"], item, None, f"{path}[{index}]")
        return problems
