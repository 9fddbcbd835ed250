"""The KV-transfer contract: kv_transfer_params, engine KV compatibility, and the NIXL handshake body."""

from __future__ import annotations

import time
from typing import Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    field_validator,
    model_validator,
)

DEFAULT_LEASE_S = 30.0
HANDSHAKE_PATH = (
    "/kv/handshake"  # a prefill engine's side channel: GET it for its NIXL metadata (KVHandshake)
)

EXPORT_PATH = (
    "/kv/export"  # any engine with a NIXL agent: POST a prompt's block hashes, get its cached prefix leased
)
MAX_EXPORT_BLOCKS = 65536  # hashes in one /kv/export body (a 1M-token prompt at block size 16)


class KVExportRequest(BaseModel):
    """``POST /kv/export``'s body: a prompt's chained block hashes; the engine leases the leading ones it holds."""

    model_config = ConfigDict(extra="forbid")

    block_hashes: list[str] = Field(
        min_length=1,
        max_length=MAX_EXPORT_BLOCKS,
        description="Hex chained block hashes of the prompt (services.common.kv.hashing), first block first.",
    )
    lora_name: str | None = Field(
        None, description="The LoRA adapter the prompt runs under (echoed in the answer's params)."
    )

    @field_validator("block_hashes")
    @classmethod
    def _hex(cls, hashes: list[str]) -> list[str]:
        for h in hashes:
            bytes.fromhex(h)  # raises ValueError on a malformed hash: a 400 naming the field
        return hashes

    def hashes(self) -> list[bytes]:
        return [bytes.fromhex(h) for h in self.block_hashes]


class KVTransferError(RuntimeError):
    """A KV transfer could not be set up or failed (the caller recomputes and records why)."""


class KVIncompatibleError(KVTransferError):
    """Two engines whose KV blocks mean different things refused to exchange them at handshake."""

    def __init__(self, fields: dict[str, tuple[object, object]], peer: str = "peer") -> None:
        self.fields = fields
        detail = "; ".join(
            f"{name}: local={mine!r} remote={theirs!r}" for name, (mine, theirs) in fields.items()
        )
        super().__init__(f"KV cache of {peer} is incompatible ({', '.join(fields)} differ): {detail}")


class KVTransferParams(BaseModel):
    """``kv_transfer_params`` of a request or response: vLLM NixlConnector's shape plus kvferry fields.

    The flow (router -> prefill -> router -> decode):

    1. The router sends the prompt to a prefill engine with ``{"do_remote_decode": true}``.
    2. Prefill computes the prompt, keeps its full blocks under a lease and answers (top-level
       ``kv_transfer_params`` of the response body) with ``do_remote_prefill: true`` and where the
       blocks are: ``remote_engine_id``, ``remote_host``/``remote_port`` (its HTTP side channel, which
       serves the NIXL handshake), ``remote_block_ids``, ``block_hashes``, ``num_tokens``,
       ``remote_request_id`` and ``lease_expires``.
    3. The router forwards those params unchanged to a decode engine, which READs the blocks into its
       own block ids and notifies prefill (the notification carries ``remote_request_id``), freeing
       the lease. A decode that sees an expired lease, an unknown engine or any transfer error
       recomputes the prompt instead.

    Unknown keys (e.g. vLLM's ``tp_size``) are ignored so vLLM-shaped clients interoperate.
    """

    model_config = ConfigDict(extra="ignore")

    do_remote_decode: bool = Field(
        False, description="Request to prefill: decode happens elsewhere; keep the KV."
    )
    do_remote_prefill: bool = Field(
        False, description="Request to decode: the prompt's KV is on a remote engine."
    )
    remote_engine_id: str | None = Field(
        None, description="Engine id of the prefill engine (changes when it restarts; NIXL agent name)."
    )
    remote_block_ids: list[NonNegativeInt] = Field(
        default_factory=list,
        description="Prefill's block ids holding the prompt's full blocks, in prompt order.",
    )
    remote_host: str | None = Field(
        None, description="Host of prefill's HTTP side channel (serves the handshake)."
    )
    remote_port: int | None = Field(None, ge=1, le=65535, description="Port of prefill's HTTP side channel.")
    remote_request_id: str | None = Field(
        None,
        description="Prefill's request id; decode sends it back as the NIXL notification to end the lease.",
    )
    block_hashes: list[str] = Field(
        default_factory=list,
        description="Hex chained block hashes (services.common.kv.hashing), one per block id.",
    )
    num_tokens: NonNegativeInt = Field(
        0,
        description="Prompt tokens whose KV the blocks hold: len(remote_block_ids) * block_size (full blocks only).",
    )
    lease_expires: float | None = Field(
        None,
        description="Unix time (s) after which prefill may free the blocks; decode must not read after it.",
    )
    lora_name: str | None = Field(
        None, description="The LoRA adapter the KV was computed under (None: the base model)."
    )
    migrate_on_drain: bool = Field(
        False,
        description="Request to decode (the router sets it): when this engine drains, lease the request's KV "
        "and end its stream with do_remote_prefill params, so another decode continues it without recompute.",
    )
    remote_handshake: str | None = Field(
        None,
        description="The source's handshake body, inline: a draining engine's side channel may already be "
        "closed when the next decode admits the request.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill are mutually exclusive")
        if self.block_hashes and len(self.block_hashes) != len(self.remote_block_ids):
            raise ValueError(
                f"block_hashes has {len(self.block_hashes)} entries but remote_block_ids has {len(self.remote_block_ids)}"
            )
        for h in self.block_hashes:
            bytes.fromhex(h)  # raises ValueError on a malformed hash
        if self.do_remote_prefill and self.remote_block_ids:
            missing = [
                f for f in ("remote_engine_id", "remote_host", "remote_port") if getattr(self, f) is None
            ]
            if missing:
                raise ValueError(f"do_remote_prefill with blocks needs {', '.join(missing)}")
        return self

    @property
    def address(self) -> str:
        """``host:port`` of the remote side channel."""
        return f"{self.remote_host}:{self.remote_port}"

    def hashes(self) -> list[bytes]:
        """The block hashes as bytes."""
        return [bytes.fromhex(h) for h in self.block_hashes]

    def lease_expired(self, now: float | None = None) -> bool:
        """True when the prefill lease is over (no lease means no expiry)."""
        return self.lease_expires is not None and (time.time() if now is None else now) >= self.lease_expires

    @classmethod
    def for_remote_decode(
        cls,
        *,
        engine_id: str,
        host: str,
        port: int,
        request_id: str,
        block_ids: list[int],
        block_hashes: list[bytes],
        block_size: int,
        lease_s: float = DEFAULT_LEASE_S,
        lora_name: str | None = None,
        handshake: str | None = None,
    ) -> KVTransferParams:
        """What prefill (or a draining decode) answers: where the full blocks are and until when they are kept."""
        return cls(
            do_remote_prefill=True,
            remote_engine_id=engine_id,
            remote_host=host,
            remote_port=port,
            remote_request_id=request_id,
            remote_block_ids=block_ids,
            block_hashes=[h.hex() for h in block_hashes],
            num_tokens=len(block_ids) * block_size,
            lease_expires=time.time() + lease_s,
            lora_name=lora_name,
            remote_handshake=handshake,
        )


class KVCompat(BaseModel):
    """What two engines must agree on before one may use the other's KV blocks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str
    block_size: PositiveInt
    hash_version: int
    dtype: str = Field(description="torch dtype name of the KV cache, e.g. 'bfloat16'.")
    bytes_per_block: PositiveInt = Field(description="Bytes of one block of all layers (K and V).")
    kv_layout: str = Field(description="Block layout, see block_major_layout().")
    weights: str = Field(
        "none", description="How the weights are held (quantization): KV of different weights differs."
    )
    tensor_parallel_size: PositiveInt = Field(
        1,
        description="KV shards, one per tensor-parallel rank (each holds its KV heads); decode rank r reads "
        "prefill rank r, so both must use the same size (heterogeneous TP is future work).",
    )
    pipeline_parallel_size: PositiveInt = Field(
        1,
        description="Pipeline stages, each holding its layers' part of every block; rank r (stage and "
        "tensor shard) reads rank r of prefill, so both must split the layers alike.",
    )

    def check(self, remote: KVCompat, peer: str = "peer") -> None:
        """Raise KVIncompatibleError naming every field on which ``remote`` differs from us."""
        diff = {
            name: (getattr(self, name), getattr(remote, name))
            for name in type(self).model_fields
            if getattr(self, name) != getattr(remote, name)
        }
        if diff:
            raise KVIncompatibleError(diff, peer)


def block_major_layout(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> str:
    """Layout name of the engine's cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
    return f"block_major(layers={num_layers},kv=2,tokens={block_size},heads={num_kv_heads},dim={head_dim})"


class KVAgent(BaseModel):
    """One NIXL agent over one registered KV cache (of an engine, or of one tensor-parallel rank).

    The registered KV cache is one region of ``num_blocks`` blocks of ``compat.bytes_per_block`` bytes
    starting at ``base_addr``; block ``i`` is the descriptor ``(base_addr + i * bytes_per_block,
    bytes_per_block, device_id)``. Plain numbers, not pickled NIXL objects: never unpickle peer data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    engine_id: str
    agent_metadata: bytes = Field(description="nixl getLocalMD() of the agent.")
    base_addr: NonNegativeInt
    num_blocks: PositiveInt
    device_id: NonNegativeInt = 0
    mem_type: str = Field("DRAM", pattern="^(DRAM|VRAM)$")


class KVHandshake(KVAgent):
    """Body of an engine's NIXL handshake on the HTTP side channel (JSON; bytes are base64): its
    (tensor-parallel rank 0's) agent, the KV compatibility, and the agents of ranks 1..tp-1, whose KV
    shards have the same block ids (the block tables are identical across ranks)."""

    compat: KVCompat
    tp_ranks: list[KVAgent] = Field(
        default_factory=list,
        description="Agents of ranks 1..tp*pp-1 (tensor shards within a stage, then stages), in rank order.",
    )

    @model_validator(mode="after")
    def _one_agent_per_rank(self) -> Self:
        c = self.compat
        ranks = c.tensor_parallel_size * c.pipeline_parallel_size
        if len(self.tp_ranks) != ranks - 1:
            raise ValueError(
                f"tensor_parallel_size={c.tensor_parallel_size} x pipeline_parallel_size="
                f"{c.pipeline_parallel_size} needs {ranks - 1} tp_ranks agents, got {len(self.tp_ranks)}"
            )
        return self
