"""The committed gRPC stubs are exactly what the .proto generates (regenerate: python -m services.common.kv.proto.gen)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.kv.proto import gen

pytest.importorskip("grpc_tools")


def test_generated_stubs_match_proto(tmp_path: Path) -> None:
    fresh = gen.generate(tmp_path)
    assert {p.name for p in fresh} == {"kvstore_pb2.py", "kvstore_pb2_grpc.py"}
    for path in fresh:
        committed = gen.PROTO_DIR / path.name
        assert committed.exists(), (
            f"{path.name} is not committed; run `python -m services.common.kv.proto.gen`"
        )
        assert committed.read_text() == path.read_text(), (
            f"{committed} drifted from kvstore.proto; run `python -m services.common.kv.proto.gen`"
        )
