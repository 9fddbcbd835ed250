"""TimingModel: how long a simulated engine step takes, its KV capacity and its transfer time per block."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_TIMING = Path(__file__).with_name("default_timing.json")


class TimingModelError(ValueError):
    """A timing model file is unreadable or invalid; the message names the field."""


class TimingModel(BaseModel):
    """One step costs ``step_overhead_s`` plus its prefill tokens, decoding sequences and their context.

    ``step_s = overhead [+ prefill_overhead] + prefill_tokens * s_per_prefill_token + decode_seqs *
    s_per_decode_seq + decode_context_tokens * s_per_context_token + prefill_context *
    s_per_prefill_context_token`` (``prefill_context``: each prefill token times the tokens it attends
    to, the quadratic part of a long prefill): the engine runs one forward pass per
    step over the flattened batch, so each term is what one more token, sequence or attended token adds.
    """

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="where the figures come from (engine, machine, date)")
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int = Field(ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int = Field(8192, ge=16)
    vocab_size: int = Field(49152, ge=2)
    step_overhead_s: float = Field(ge=0)
    prefill_step_overhead_s: float = Field(0.0, ge=0, description="added to a step that prefills anything")
    s_per_prefill_token: float = Field(ge=0)
    s_per_decode_seq: float = Field(ge=0)
    s_per_context_token: float = Field(0.0, ge=0)
    s_per_prefill_context_token: float = Field(
        0.0, ge=0, description="per prefill token per token it attends to (cached prefix plus half its chunk)"
    )
    transfer_s_per_block: float = Field(0.0, ge=0)
    kv_bytes_per_block: int | None = Field(
        None, ge=1, description="one KV block, every layer: sizes a pool's kvstore capacity in blocks"
    )
    kvstore_s_per_block: float | None = Field(
        None, ge=0, description="a block fetched from the kvstore (default: transfer_s_per_block)"
    )
    samples: dict[str, list[list[float]]] = Field(
        default_factory=dict, description="the measurements the fit came from (for the record)"
    )

    def step_s(
        self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int, prefill_context: float = 0.0
    ) -> float:
        """Seconds one engine step takes for this batch."""
        return (
            self.step_overhead_s
            + (self.prefill_step_overhead_s if prefill_tokens else 0.0)
            + prefill_tokens * self.s_per_prefill_token
            + decode_seqs * self.s_per_decode_seq
            + decode_context_tokens * self.s_per_context_token
            + prefill_context * self.s_per_prefill_context_token
        )

    @property
    def kvstore_fetch_s_per_block(self) -> float:
        return self.transfer_s_per_block if self.kvstore_s_per_block is None else self.kvstore_s_per_block

    @classmethod
    def load(cls, path: Path | None = None) -> TimingModel:
        """Read a timing model file (the committed default when ``path`` is None)."""
        path = path or DEFAULT_TIMING
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise TimingModelError(f"{path}: cannot read: {exc.strerror}") from None
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}" for e in exc.errors()
            )
            raise TimingModelError(f"{path}: invalid timing model: {problems}") from None

    def save(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")
