"""P/D between parallel engines (tensor or pipeline): the prefill/decode/aggregated trio both test modules
start, and the check that disaggregated text equals aggregated with every block moved over NIXL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.engine.entrypoints.helpers import EngineEndpoint
from tests.engine_harness import start_in_process
from tests.pd.test_pd_flow import complete, disaggregated, prompts

COMMON = ("--block-size", "16", "--num-kv-blocks", "128", "--max-model-len", "512")
RECEIVED = 'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'


@contextmanager
def pd_trio(model: Path, parallel: tuple[str, ...]) -> Iterator[tuple[EngineEndpoint, ...]]:
    """A prefill and a decode engine with the ``parallel`` flags, and an aggregated one-rank engine."""
    servers = []
    try:
        for args in (
            ("--role", "prefill", "--kv-lease", "20", *parallel),
            ("--role", "decode", *parallel),
            (),
        ):
            servers.append(start_in_process(model, *args, *COMMON))
        yield tuple(servers)
    finally:
        for s in servers:
            s.stop()


def check_pd_equals_aggregated(trio: tuple[EngineEndpoint, ...], n: int, seed: int) -> None:
    """``n`` prompts: disaggregated text == aggregated, decode cached what it read, every block came over
    NIXL with no failure, and prefill freed every lease (decode told it once every rank's read was done)."""
    prefill, decode, aggregated = trio
    before = decode.metrics().get(RECEIVED, 0)
    moved = 0
    for i, prompt in enumerate(prompts(n, seed=seed)):
        params, out = disaggregated(prefill, decode, prompt)
        assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"], f"prompt {i}"
        moved += len(params["remote_block_ids"])
        if params["remote_block_ids"]:
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= min(len(params["remote_block_ids"]) * 16, len(prompt) - 1)
    m = decode.metrics()
    assert m[RECEIVED] - before == moved > 0
    assert not any(k.startswith("kvferry_kv_transfer_failures_total") and v for k, v in m.items())
    prefill.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)
