"""KV transfer bandwidth: raw NIXL READ vs NixlTransfer vs the kvstore (NIXL and gRPC) vs an in-process copy.

For prompts of 512-8k tokens (their full blocks, scattered over the source cache and landing in other
block ids) on a tiny layout and SmolLM2-135M's layout, all in one run, between two processes on
127.0.0.1. Also the idle CPU of one agent with nixl's stock Python wrapper (progress delay 0) and with
ours. Prints a table, writes benchmarks/results/kv_transfer.json.

    python benchmarks/kv_transfer.py [--tokens 512,2048,8192] [--layouts tiny,smollm2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.kv.hashing import HASH_VERSION, BlockHasher  # noqa: E402
from services.common.kv.kv_transfer import KVCompat, KVHandshake, block_major_layout  # noqa: E402
from services.common.kv.kvstore_client import KVStoreClient  # noqa: E402
from services.engine.kv_transfer.nixl_transfer import (  # noqa: E402
    NixlConfig,
    NixlTransfer,
    TransferState,
    block_descs,
    make_agent,
    nixl_bindings,
)

BLOCK_SIZE = 16
# name: (layers, kv heads, head dim, dtype)
LAYOUTS = {"tiny": (2, 2, 16, torch.float32), "smollm2": (30, 3, 64, torch.bfloat16)}


def kv_shape(layout: str, num_blocks: int) -> tuple[int, ...]:
    layers, heads, dim, _ = LAYOUTS[layout]
    return (num_blocks, layers, 2, BLOCK_SIZE, heads, dim)


def compat(layout: str) -> KVCompat:
    layers, heads, dim, dtype = LAYOUTS[layout]
    nbytes = layers * 2 * BLOCK_SIZE * heads * dim * torch.empty((), dtype=dtype).element_size()
    return KVCompat(
        model_id=layout,
        block_size=BLOCK_SIZE,
        hash_version=HASH_VERSION,
        dtype=str(dtype).split(".")[-1],
        bytes_per_block=nbytes,
        kv_layout=block_major_layout(layers, BLOCK_SIZE, heads, dim),
    )


def source_cache(layout: str, num_blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.rand(kv_shape(layout, num_blocks), generator=gen).to(LAYOUTS[layout][3])


# -- child processes -------------------------------------------------------------------------------


def run_peer(layout: str, num_blocks: int, delay_us: int) -> int:
    """The prefill side: register a cache, print the handshake, idle until stdin closes."""
    torch.set_num_threads(1)
    with NixlTransfer(
        source_cache(layout, num_blocks), compat(layout), config=NixlConfig(progress_delay_us=delay_us)
    ) as t:
        print(t.handshake_json(), flush=True)
        sys.stdin.read()
    return 0


def run_idle_probe(delay_us: int, seconds: float = 1.5) -> int:
    """CPU seconds per second of one idle agent: delay 0 = nixl's stock Python wrapper."""
    if delay_us == 0:
        from nixl._api import nixl_agent

        agent = nixl_agent("idle-stock")
    else:
        agent = make_agent("idle-ours", NixlConfig(progress_delay_us=delay_us))
    time.sleep(0.3)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    print(json.dumps({"cpu_per_s": (time.process_time() - cpu0) / (time.monotonic() - wall0)}), flush=True)
    del agent
    return 0


def idle_cpu(delay_us: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--idle-probe", str(delay_us)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["cpu_per_s"]


# -- paths -----------------------------------------------------------------------------------------


def timed(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each function; the functions take turns (round-robin) so drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class RawNixl:
    """The minimal nixl call sequence (own agent, prepped lists, spin on status): the ceiling."""

    def __init__(self, local: torch.Tensor, hs: KVHandshake, delay_us: int) -> None:
        nb = self.nb = nixl_bindings()
        self.agent = make_agent("raw-" + hs.engine_id[:8], NixlConfig(progress_delay_us=delay_us))
        bpb = hs.compat.bytes_per_block
        self.reg = nb.nixlRegDList(nb.DRAM_SEG, [(local.data_ptr(), local.shape[0] * bpb, 0, "")])
        self.agent.registerMem(self.reg, [])
        name = self.agent.loadRemoteMD(hs.agent_metadata)
        self.local = self.agent.prepXferDlist(
            nb.NIXL_INIT_AGENT,
            nb.nixlXferDList(nb.DRAM_SEG, block_descs(local.data_ptr(), local.shape[0], bpb, 0)),
            [],
        )
        self.remote = self.agent.prepXferDlist(
            name, nb.nixlXferDList(nb.DRAM_SEG, block_descs(hs.base_addr, hs.num_blocks, bpb, 0)), []
        )

    def read(self, remote_ids: np.ndarray, local_ids: np.ndarray) -> None:
        req = self.agent.makeXferReq(
            self.nb.NIXL_READ, self.local, local_ids, self.remote, remote_ids, "", []
        )
        status = self.agent.postXferReq(req, "")
        while status == self.nb.NIXL_IN_PROG:
            status = self.agent.getXferStatus(req)
        self.agent.releaseXferReq(req)
        if status != self.nb.NIXL_SUCCESS:
            raise RuntimeError(f"raw READ failed: {status}")


def grpc_get(client: KVStoreClient, keys: list, local: torch.Tensor, local_ids: torch.Tensor) -> None:
    datas = client.get(keys)
    if len(datas) != len(keys):
        raise RuntimeError(f"kvstore returned {len(datas)} of {len(keys)} blocks")
    blocks = torch.frombuffer(bytearray().join(datas), dtype=torch.uint8).view(len(datas), -1)
    local.view(local.shape[0], -1).view(torch.uint8).index_copy_(0, local_ids, blocks)


# -- one layout ------------------------------------------------------------------------------------


def bench_layout(layout: str, tokens: list[int], repeats: int, delay_us: int) -> list[dict]:
    num_blocks = max(tokens) // BLOCK_SIZE + 64
    bpb = compat(layout).bytes_per_block
    kvstore, target = start_kvstore(sum(tokens) // BLOCK_SIZE * (bpb + 64) * 1.1 / 1e9, bpb)
    peer = subprocess.Popen(
        [sys.executable, __file__, "--peer", layout, str(num_blocks), str(delay_us)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hs = KVHandshake.model_validate_json(peer.stdout.readline())
        local = torch.zeros(kv_shape(layout, num_blocks), dtype=LAYOUTS[layout][3])
        source = source_cache(layout, num_blocks)
        with (
            NixlTransfer(local, compat(layout), config=NixlConfig(progress_delay_us=delay_us)) as ours,
            KVStoreClient(target) as client,
        ):
            ids = {
                "peer": ours.add_peer(hs),
                "kvstore": ours.add_peer(client.nixl_handshake(compat(layout).model_dump_json())),
            }
            raw = RawNixl(local, hs, delay_us)
            return [bench_prompt(layout, n, repeats, ours, ids, raw, client, local, source) for n in tokens]
    finally:
        peer.stdin.close()
        peer.wait(timeout=30)
        kvstore.terminate()
        kvstore.wait(timeout=10)


def bench_prompt(
    layout: str,
    n_tokens: int,
    repeats: int,
    ours: NixlTransfer,
    ids: dict[str, str],
    raw: RawNixl,
    client: KVStoreClient,
    local: torch.Tensor,
    source: torch.Tensor,
) -> dict:
    n = n_tokens // BLOCK_SIZE
    rng = random.Random(n)
    remote_ids = rng.sample(range(source.shape[0]), n)
    local_ids = rng.sample(range(local.shape[0]), n)
    nbytes = n * ours.compat.bytes_per_block

    def nixl_read(peer: str, src_ids: list[int]) -> None:
        handle = ours.read_blocks(peer, src_ids, local_ids)
        if ours.wait(handle) is not TransferState.DONE:
            raise RuntimeError(handle.error)

    def kvstore_nixl() -> None:  # pin the prefix over gRPC, READ its slots with NIXL
        slots = client.pin_prefix(keys)
        if len(slots) != n:
            raise RuntimeError(f"kvstore pinned {len(slots)} of {n} blocks")
        nixl_read(ids["kvstore"], slots)

    r_arr, l_arr = np.asarray(remote_ids, dtype=np.int32), np.asarray(local_ids, dtype=np.int32)
    src_idx, dst_idx = torch.tensor(remote_ids), torch.tensor(local_ids)

    def copy() -> None:
        local.index_copy_(0, dst_idx, source.index_select(0, src_idx))

    tokens = [rng.randrange(50_000) for _ in range(n_tokens)]
    hashes = BlockHasher(layout, BLOCK_SIZE).hash_tokens(tokens)
    keys = [(h, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) for i, h in enumerate(hashes)]
    flat = source.view(source.shape[0], -1).view(torch.uint8)
    blobs = [flat[r].numpy().tobytes() for r in remote_ids]
    t0 = time.perf_counter()
    client.put((h, t, b) for (h, t), b in zip(keys, blobs, strict=True))
    put_s = time.perf_counter() - t0
    rounds = max(repeats, min(200, (32 << 20) // nbytes))  # small transfers: more rounds, steadier medians
    secs = timed(
        {
            "raw_nixl": lambda: raw.read(r_arr, l_arr),
            "nixl_transfer": lambda: nixl_read(ids["peer"], remote_ids),
            "kvstore_nixl": kvstore_nixl,
            "grpc_kvstore": lambda: grpc_get(client, keys, local, dst_idx),
            "inprocess_copy": copy,
        },
        rounds,
    )
    if not torch.equal(local[local_ids], source[remote_ids]):
        raise RuntimeError("blocks differ after the transfers")
    return {
        "layout": layout,
        "tokens": n_tokens,
        "blocks": n,
        "bytes": nbytes,
        "rounds": rounds,
        "seconds": secs,
        "gbps": {k: nbytes / s / 1e9 for k, s in secs.items()},
        "grpc_put_gbps": nbytes / put_s / 1e9,
        "nixl_vs_raw": secs["raw_nixl"] / secs["nixl_transfer"],
    }


# -- main ------------------------------------------------------------------------------------------


def print_table(rows: list[dict], idle: dict[str, float]) -> None:
    cols = ["raw_nixl", "nixl_transfer", "kvstore_nixl", "grpc_kvstore", "inprocess_copy"]
    print(
        f"{'layout':8} {'tokens':>6} {'MiB':>7} "
        + " ".join(f"{c + ' GB/s':>19}" for c in cols)
        + f" {'ours/raw':>8}"
    )
    for r in rows:
        gb = " ".join(f"{r['gbps'][c]:>8.2f} ({r['seconds'][c] * 1e3:6.2f}ms)" for c in cols)
        print(f"{r['layout']:8} {r['tokens']:>6} {r['bytes'] / 2**20:>7.1f} {gb} {r['nixl_vs_raw']:>8.0%}")
    print("idle agent CPU (cores): " + ", ".join(f"{k}={v:.3f}" for k, v in idle.items()))


def start_kvstore(capacity_gb: float, slot_bytes: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "kvstore",
            "--port",
            "0",
            "--capacity-gb",
            str(capacity_gb),
            "--slot-bytes",
            str(slot_bytes),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().split()[-1]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        return run_peer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    if len(sys.argv) > 1 and sys.argv[1] == "--idle-probe":
        return run_idle_probe(int(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--layouts", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--delay-us", type=int, default=NixlConfig().progress_delay_us, help="agents' progress delay"
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_transfer.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    tokens = [int(t) for t in args.tokens.split(",")]
    idle = {"stock_delay_0us": idle_cpu(0), f"ours_delay_{args.delay_us}us": idle_cpu(args.delay_us)}
    rows = [
        r
        for layout in args.layouts.split(",")
        for r in bench_layout(layout, tokens, args.repeats, args.delay_us)
    ]
    print_table(rows, idle)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "cpus": torch.get_num_threads(),
        "delay_us": args.delay_us,
        "repeats": args.repeats,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "nixl_path_goal": ">= 70% of raw NIXL READ",
    }
    args.out.write_text(json.dumps({"meta": meta, "idle_cpu": idle, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
