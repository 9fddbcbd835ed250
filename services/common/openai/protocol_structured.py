"""Structured-output request fields (OpenAI ``response_format``, vLLM ``structured_outputs`` / ``guided_*``)
and the one canonical ``StructuredSpec`` the engine compiles (hashable: the grammar cache key).

A request gives at most one constraint; giving two is a 400 naming the second field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.openai.protocol_base import RequestModel, field_error

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


class StructuredSpec(BaseModel):
    """One output constraint as the engine compiles it. ``value``: the JSON schema / structural tag
    as canonical JSON text, the regex, the EBNF grammar, or the choices as a JSON list."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: SpecKind
    value: str = ""

    @classmethod
    def of(cls, kind: SpecKind, value: Any) -> StructuredSpec:
        """Canonical text for ``value`` (objects as compact JSON; key order kept: it orders the output's keys)."""
        if isinstance(value, str) and kind in ("regex", "grammar"):
            return cls(kind=kind, value=value)
        return cls(kind=kind, value=json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def spec_request_fields(spec: StructuredSpec) -> dict[str, Any]:
    """The request fields that say ``spec`` again (a router forwarding a constraint to an engine)."""
    if spec.kind == "json_object":
        return {"structured_outputs": {"json_object": True}}
    value: Any = spec.value if spec.kind in ("regex", "grammar") else json.loads(spec.value)
    return {"structured_outputs": {spec.kind: value}}


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error("json_schema", "is required when type is 'json_schema'")
        return self


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag") if self._get(k)
        ]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one constraint, got {given or 'none'}")
        return self

    def _get(self, key: str) -> Any:
        return self.json_ if key == "json" else getattr(self, key)

    def spec(self) -> StructuredSpec:
        """The constraint as a StructuredSpec."""
        if self.json_ is not None:
            schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            return StructuredSpec.of("json", schema)
        if self.json_object:
            return StructuredSpec(kind="json_object")
        if self.structural_tag is not None:
            tag = (
                json.loads(self.structural_tag)
                if isinstance(self.structural_tag, str)
                else self.structural_tag
            )
            return StructuredSpec.of("structural_tag", tag)
        if self.choice is not None:
            return StructuredSpec.of("choice", self.choice)
        if self.regex is not None:
            return StructuredSpec.of("regex", self.regex)
        return StructuredSpec.of("grammar", self.grammar)


class StructuredRequestFields(RequestModel):
    """The constraint fields both endpoints accept; ``structured_spec()`` merges them into one spec."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredRequestFields:
        given = [name for name in CONSTRAINT_FIELDS if _given(self, name)]
        if len(given) > 1:
            raise field_error(
                given[1], f"cannot be combined with {given[0]} (one output constraint per request)"
            )
        if isinstance(self.guided_json, str) or (
            self.structured_outputs and isinstance(self.structured_outputs.json_, str)
        ):
            try:
                self.structured_spec()
            except json.JSONDecodeError as exc:
                field = "guided_json" if isinstance(self.guided_json, str) else "structured_outputs.json"
                raise field_error(field, f"is not valid JSON: {exc}") from exc
        return self

    def structured_spec(self) -> StructuredSpec | None:
        """The request's output constraint, None when it has none."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return StructuredSpec(kind="json_object")
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            return StructuredSpec.of("json", rf.json_schema.schema_)
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if self.guided_json is not None:
            schema = json.loads(self.guided_json) if isinstance(self.guided_json, str) else self.guided_json
            return StructuredSpec.of("json", schema)
        if self.guided_regex is not None:
            return StructuredSpec.of("regex", self.guided_regex)
        if self.guided_choice is not None:
            return StructuredSpec.of("choice", self.guided_choice)
        if self.guided_grammar is not None:
            return StructuredSpec.of("grammar", self.guided_grammar)
        return None


# Every request field that constrains the output (one of them at most): routers drop them for prefill.
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _given(fields: StructuredRequestFields, name: str) -> bool:
    value = getattr(fields, name)
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None
