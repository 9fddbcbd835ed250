"""CrdModel: the base of the InferencePool schema models (camelCase, strict, CEL rules in Python and in the CRD)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from pool_operator.quantity import QUANTITY_PATTERN


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` rule and, unless it is a transition rule, its Python twin."""

    rule: str
    message: str
    check: Callable[[Any], bool] | None = None


def _quantity_or_str(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_or_str),
    Field(pattern=QUANTITY_PATTERN),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
        }
    ),
]
FreeForm = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]


class CrdModel(BaseModel):
    """Base: camelCase keys, unknown fields rejected, CEL rules enforced in Python and emitted in the CRD."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
    CEL_RULES: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> CrdModel:
        for rule in type(self).CEL_RULES:
            if rule.check is not None and not rule.check(self):
                raise ValueError(rule.message)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler.resolve_ref_schema(handler(core_schema))
        if "CEL_RULES" in cls.__dict__ and cls.CEL_RULES:
            schema["x-kubernetes-validations"] = [
                {"rule": r.rule, "message": r.message} for r in cls.CEL_RULES
            ]
        return schema


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class SecretKeyRef(CrdModel):
    """A key of a Secret in the pool's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)
