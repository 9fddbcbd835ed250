"""PoolFileError and the parsing of InferencePool documents (files or API bodies) with field-named errors."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pool_operator.models import InferencePool


class PoolFileError(ValueError):
    """An InferencePool document is unreadable or invalid; the message names every bad field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid InferencePool:\n" + "\n".join(f"  - {p}" for p in problems))


def format_validation_error(error: ValidationError) -> list[str]:
    """One line per problem: `spec.engine.blockSize: Input should be ...`."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(document)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return lines


def parse_pool(body: Mapping[str, Any], source: str = "object") -> InferencePool:
    """Validate one InferencePool document; raise PoolFileError naming the fields."""
    live_keys = {"apiVersion", "kind", "metadata", "spec", "status"}
    document = {key: value for key, value in body.items() if key in live_keys}
    unknown = sorted(set(body) - live_keys)
    if unknown:
        raise PoolFileError(source, [f"{key}: unknown top-level field" for key in unknown])
    try:
        return InferencePool.model_validate(document)
    except ValidationError as error:
        raise PoolFileError(source, format_validation_error(error)) from None


def load_pools(path: Path) -> list[InferencePool]:
    """Every InferencePool in a (multi-document) YAML file; other kinds are an error."""
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    except OSError as error:
        raise PoolFileError(str(path), [f"cannot read: {error.strerror}"]) from None
    except yaml.YAMLError as error:
        raise PoolFileError(str(path), [f"not valid YAML: {error}"]) from None
    if not documents:
        raise PoolFileError(str(path), ["no document found"])
    pools = []
    for index, document in enumerate(documents):
        where = f"{path} (document {index + 1})" if len(documents) > 1 else str(path)
        if not isinstance(document, dict):
            raise PoolFileError(where, ["(document): expected a mapping"])
        pools.append(parse_pool(document, where))
    return pools
