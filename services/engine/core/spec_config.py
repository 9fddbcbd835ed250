"""SpeculativeConfig: `--speculative-config` (vLLM's JSON shape), validated once for the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SpecMethod = Literal["ngram", "draft_model", "eagle"]
Quantization = Literal["auto", "none", "int8", "int4", "gguf", "gptq", "awq", "fp8"]
# A rejected n-gram draft costs only its verification; a draft model's also costs the draft's forwards.
_MIN_ACCEPTANCE = {"ngram": 0.1, "draft_model": 0.25, "eagle": 0.25}


class SpeculativeConfig(BaseModel):
    """How drafts are proposed and how many per step; the target model verifies them all in one pass."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: SpecMethod
    num_speculative_tokens: int = Field(ge=1, le=16)
    prompt_lookup_min: int | None = Field(None, ge=1)  # ngram: shortest suffix looked up (default 2)
    prompt_lookup_max: int | None = Field(None, ge=1)  # ngram: longest suffix looked up (default 5)
    model: str | None = None  # draft_model: a smaller checkpoint with the target's tokenizer; eagle: the head
    quantization: Quantization = "auto"  # draft_model: its weights in memory (as the engine's --quantization)
    # Requests whose recent drafts are mostly rejected stop proposing for a while (doubling back-off);
    # default: 0.1 for ngram, 0.25 for a draft model or EAGLE head
    min_acceptance: float | None = Field(None, ge=0.0, le=1.0)
    disable_by_batch_size: int | None = Field(None, ge=1)  # no drafts while more requests run

    @model_validator(mode="after")
    def _method_fields(self) -> SpeculativeConfig:
        if self.min_acceptance is None:
            self.min_acceptance = _MIN_ACCEPTANCE[self.method]
        if self.quantization != "auto" and self.method != "draft_model":
            raise ValueError(
                f"quantization: only a draft_model's weights can be quantized, not {self.method}'s"
            )
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("model: the ngram method proposes from the prompt, it takes no model")
            lo = self.prompt_lookup_min or min(2, self.prompt_lookup_max or 2)
            hi = self.prompt_lookup_max or max(5, lo)
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
            return self
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"prompt_lookup_min/max: only for the ngram method, not {self.method}")
        if self.model is None:
            raise ValueError(f"model: the {self.method} method needs a draft checkpoint")
        if not Path(self.model).exists():
            raise ValueError(f"model: draft checkpoint {self.model!r} does not exist")
        return self

    @property
    def lookahead(self) -> int:
        """KV slots a draft model writes past the verified tokens (its own proposals); ngram writes none."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON; a ValueError names the flag and the field."""
        try:
            return cls.model_validate(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config: not JSON ({exc})") from None
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "config"
            raise ValueError(f"--speculative-config: {where}: {err['msg']}") from None
