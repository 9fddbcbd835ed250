"""CPU benchmark: the C++ kernels (kernels.cpu) vs the engine's plain-torch path, 2 threads, medians."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/cpu_kernels.py`: this file's folder must not shadow the `kernels` package.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels.cpu as kc  # noqa: E402
from kernels.cpu import build  # noqa: E402
from kernels.reference import build_cos_sin_cache  # noqa: E402

BLOCK = 16
MODELS = {"h768-llama": (12, 12, 64), "smollm2": (9, 3, 64)}  # (Hq, Hkv, D)


def median_ms(
    fns: list[Callable[[], object]],
    min_reps: int = 7,
    budget_s: float = 1.0,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Median wall time (ms) of each fn after a warm-up; the fns take turns, so a noisy neighbour on a
    shared machine slows them alike. At least min_reps rounds, more while under ~budget_s (max 50).
    before (untimed) runs ahead of every timed call, e.g. to evict the caches."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_reps or (time.perf_counter() - start < budget_s and len(times[0]) < 50):
        for fn, ts in zip(fns, times, strict=True):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


class TorchPath:
    """The engine's torch attention today: gather whole block rows with index_select, then SDPA."""

    def __init__(self) -> None:
        self.scratch: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}

    def _gather(self, rows: torch.Tensor, index: torch.Tensor, slot: str) -> torch.Tensor:
        key = (slot, rows.shape[1], rows.dtype)
        buf = self.scratch.get(key)
        if buf is None or buf.shape[0] < index.numel():
            buf = self.scratch[key] = torch.empty((max(index.numel(), 64), rows.shape[1]), dtype=rows.dtype)
        out = buf[: index.numel()]
        torch.index_select(rows, 0, index, out=out)
        return out

    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        tables: torch.Tensor,
        bias: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query row per sequence; tables [B, max_blocks] int64; bias [B, 1, 1, max_blocks*bs]."""
        nb, nl, _, bs, hkv, d = kv.shape
        rows = kv.view(nb * nl * 2, bs * hkv * d)
        base = (tables.flatten() * nl + layer) * 2
        b, mb = tables.shape
        keys = self._gather(rows, base, "k").view(b, mb * bs, hkv, d)
        values = self._gather(rows, base + 1, "v").view(b, mb * bs, hkv, d)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=bias,
            scale=scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: int, seqs: list[tuple], scale: float
    ) -> torch.Tensor:
        """seqs: (token_start, token_end, seq_len, block_ids int64, causal bool mask [q_len, seq_len])."""
        nb, nl, _, bs, hkv, d = kv.shape
        rows = kv.view(nb * nl * 2, bs * hkv * d)
        out = torch.empty_like(q)
        for start, end, seq_len, block_ids, mask in seqs:
            base = (block_ids * nl + layer) * 2
            keys = self._gather(rows, base, "k").view(-1, hkv, d)[:seq_len]
            values = self._gather(rows, base + 1, "v").view(-1, hkv, d)[:seq_len]
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)
        return out


def paged(seq_lens: list[int], hkv: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-layer 6-d cache [blocks, 1, 2, bs, Hkv, D] holding the sequences in shuffled blocks + tables."""
    blocks = [-(-n // BLOCK) for n in seq_lens]
    kv = torch.randn(sum(blocks), 1, 2, BLOCK, hkv, d, dtype=dtype)
    order = torch.randperm(sum(blocks), dtype=torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start : start + n]
        start += n
    return kv, tables


def attention_row(kind: str, model: str, dtype: torch.dtype, batch: int, prefix: int, q_len: int) -> dict:
    """One attention problem: `batch` sequences, each q_len new tokens after `prefix` cached ones."""
    hq, hkv, d = MODELS[model]
    seq_len = prefix + q_len
    kv, tables = paged([seq_len] * batch, hkv, d, dtype)
    key_cache, value_cache = kv[:, 0, 0], kv[:, 0, 1]
    q = torch.randn(batch * q_len, hq, d, dtype=dtype)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((batch,), seq_len, dtype=torch.int32)
    scale = d**-0.5
    torch_path = TorchPath()
    if q_len == 1:
        pad = torch.arange(tables.shape[1] * BLOCK)[None, :] >= lens.long()[:, None]
        bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :].to(dtype)
        tl = tables.long()

        def run_torch() -> torch.Tensor:
            return torch_path.decode(q, kv, 0, tl, bias, scale)
    else:
        mask = torch.arange(seq_len)[None, :] <= torch.arange(prefix, seq_len)[:, None]
        nblk = -(-seq_len // BLOCK)
        seqs = [(b * q_len, (b + 1) * q_len, seq_len, tables[b, :nblk].long(), mask) for b in range(batch)]

        def run_torch() -> torch.Tensor:
            return torch_path.prefill(q, kv, 0, seqs, scale)

    out = torch.empty_like(q)

    def run_kernel() -> torch.Tensor:
        return kc.paged_attention(out, q, key_cache, value_cache, tables, qsl, lens, scale)

    diff = (run_kernel().float() - run_torch().float()).abs().max().item()
    t_ms, k_ms = median_ms([run_torch, run_kernel])
    return {
        "kind": kind,
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "prefix": prefix,
        "q_len": q_len,
        "torch_ms": t_ms,
        "kernel_ms": k_ms,
        "speedup": t_ms / k_ms,
        "max_abs_diff": diff,
    }


def shared_prefix_tables(batch: int, seq_len: int, shared_tokens: int) -> tuple[torch.Tensor, int]:
    """Block tables where every row starts with the SAME ceil(shared_tokens / BLOCK) block ids (a common
    prompt prefix under prefix caching) and then owns its remaining blocks; ids are shuffled."""
    per_seq = -(-seq_len // BLOCK)
    shared = min(-(-shared_tokens // BLOCK), per_seq) if shared_tokens > 0 else 0
    num_blocks = shared + batch * (per_seq - shared)
    order = torch.randperm(num_blocks, dtype=torch.int32)
    tables = torch.empty(batch, per_seq, dtype=torch.int32)
    tables[:, :shared] = order[:shared]
    tables[:, shared:] = order[shared:].view(batch, per_seq - shared)
    return tables, num_blocks


def paged_decode_row(
    model: str,
    dtype: torch.dtype,
    batch: int,
    ctx: int,
    shared_tokens: int,
    baseline: ModuleType | None = None,
    with_torch: bool = True,
    cold: bool = False,
) -> dict:
    """Decode (one query row per sequence) over a [blocks, 1, 2, bs, Hkv, D] cache whose sequences share
    their first shared_tokens positions' blocks (0: all blocks distinct). baseline: another build of the
    extension, timed interleaved with this one (before/after). cold: caches are evicted before every
    call (256 MB written), as in the engine, where the other layers' K/V and all weights pass through the
    caches between two calls for one layer; warm rows rerun on the same K/V, shared blocks stay cached
    (with the torch path in the rotation, its gathers evict much of them: use --no-torch for A/B)."""
    hq, hkv, d = MODELS[model]
    tables, num_blocks = shared_prefix_tables(batch, ctx, shared_tokens)
    kv = torch.randn(num_blocks, 1, 2, BLOCK, hkv, d, dtype=dtype)
    key_cache, value_cache = kv[:, 0, 0], kv[:, 0, 1]
    q = torch.randn(batch, hq, d, dtype=dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    scale = d**-0.5
    out, out_base = torch.empty_like(q), torch.empty_like(q)
    fns: list[Callable[[], object]] = []
    if with_torch:
        torch_path = TorchPath()
        pad = torch.arange(tables.shape[1] * BLOCK)[None, :] >= lens.long()[:, None]
        bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :].to(dtype)
        tl = tables.long()
        fns.append(lambda: torch_path.decode(q, kv, 0, tl, bias, scale))

    def run_kernel() -> torch.Tensor:
        return kc.paged_attention(out, q, key_cache, value_cache, tables, qsl, lens, scale)

    fns.append(run_kernel)
    if baseline is not None:

        def run_baseline() -> torch.Tensor:
            baseline.paged_attention(out_base, q, key_cache, value_cache, tables, qsl, lens, scale, 0)
            return out_base

        fns.append(run_baseline)
    flush = torch.empty(64 << 20, dtype=torch.int32) if cold else None
    times = median_ms(fns, before=None if flush is None else lambda: flush.add_(1))
    kernel_ms = times[1 if with_torch else 0]
    row = {
        "kind": "decode-shared" if shared_tokens > 0 else "decode-distinct",
        "cache": "cold" if cold else "warm",
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "prefix": ctx - 1,
        "q_len": 1,
        "shared_tokens": shared_tokens,
        "kv_bytes": num_blocks * 2 * BLOCK * hkv * d * kv.element_size(),
        "torch_ms": times[0] if with_torch else float("nan"),
        "kernel_ms": kernel_ms,
        "speedup": times[0] / kernel_ms if with_torch else float("nan"),
    }
    if with_torch:
        row["max_abs_diff"] = (run_kernel().float() - fns[0]().float()).abs().max().item()
    if baseline is not None:
        row["baseline_ms"] = times[-1]
        row["vs_baseline"] = times[-1] / kernel_ms
        row["baseline_max_abs_diff"] = (run_kernel().float() - fns[-1]().float()).abs().max().item()
    return row


# (model, batch, context, shared prefix tokens, cold caches) of the paged-decode rows: the engine's
# prefix-cached decode (64 prompts sharing a 512-token prefix) and the same shapes over distinct blocks.
PAGED_DECODE_CASES = [
    ("h768-llama", 64, 544, 512, False),
    ("h768-llama", 64, 544, 512, True),
    ("h768-llama", 64, 2048, 512, False),
    ("h768-llama", 64, 544, 0, False),
    ("h768-llama", 64, 544, 0, True),
    ("h768-llama", 64, 2048, 0, False),
    ("smollm2", 64, 544, 512, False),
    ("smollm2", 64, 544, 512, True),
]


def pointwise_rows(dtype: torch.dtype, tokens: int) -> list[dict]:
    """RMSNorm (plain and fused add), rotary, SiLU-and-mul and the cache write vs their torch versions."""
    hidden, inter, hq, hkv, d = 768, 2048, 12, 12, 64
    dt = str(dtype).removeprefix("torch.")
    rows = []

    def row(name: str, torch_fn: Callable, kernel_fn: Callable) -> None:
        t_ms, k_ms = median_ms([torch_fn, kernel_fn])
        rows.append(
            {
                "kind": "pointwise",
                "op": name,
                "dtype": dt,
                "tokens": tokens,
                "torch_ms": t_ms,
                "kernel_ms": k_ms,
                "speedup": t_ms / k_ms,
            }
        )

    x = torch.randn(tokens, hidden, dtype=dtype)
    res = torch.randn(tokens, hidden, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)

    def torch_norm(x: torch.Tensor, r: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if r is not None:
            x = x + r
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * h.to(x.dtype), x

    row("rms_norm", lambda: torch_norm(x), lambda: kc.rms_norm(x, w, 1e-5))
    row("fused_add_rms_norm", lambda: torch_norm(x, res), lambda: kc.fused_add_rms_norm(x, res, w, 1e-5))

    qkv = torch.randn(tokens, hq + 2 * hkv, d, dtype=dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    cache = build_cos_sin_cache(d, 8192, 10000.0, None, dtype)
    pos = torch.randint(0, 8192, (tokens,))

    def torch_rope() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cache.index_select(0, pos).chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

        def rot(t: torch.Tensor) -> torch.Tensor:
            rotated = torch.cat((-t[..., d // 2 :], t[..., : d // 2]), dim=-1)
            return t * cos + rotated * sin

        return rot(q), rot(k)

    row("rotary", torch_rope, lambda: kc.rotary_embedding(pos, q, k, cache, True))

    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype)

    def torch_silu() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    row("silu_and_mul", torch_silu, lambda: kc.silu_and_mul(gate_up))

    blocks = -(-tokens // BLOCK) + 8
    kv = torch.zeros(blocks, 3, 2, BLOCK, hkv, d, dtype=dtype)
    key, value = torch.randn(tokens, hkv, d, dtype=dtype), torch.randn(tokens, hkv, d, dtype=dtype)
    slots = torch.randperm(blocks * BLOCK)[:tokens]

    def torch_write() -> None:
        token_rows = kv.view(-1, hkv * d)
        b, o = slots // BLOCK, slots % BLOCK
        r = ((b * 3 + 1) * 2) * BLOCK + o
        token_rows.index_copy_(0, r, key.reshape(-1, hkv * d))
        token_rows.index_copy_(0, r + BLOCK, value.reshape(-1, hkv * d))

    row(
        "reshape_and_cache",
        torch_write,
        lambda: kc.reshape_and_cache(key, value, kv[:, 1, 0], kv[:, 1, 1], slots),
    )
    return rows


def attention_cases(quick: bool) -> list[tuple[str, int, int, int]]:
    """(kind, batch, cached prefix, q_len) of every attention row."""
    if quick:
        return [("decode", 64, 543, 1), ("prefill", 1, 0, 512), ("chunk", 4, 512, 32)]
    cases = [("decode", b, ctx - 1, 1) for b in (1, 16, 64) for ctx in (128, 544, 2048)]
    return cases + [("prefill", 64, 0, 128), ("prefill", 1, 0, 512), ("chunk", 8, 512, 32)]


def print_table(rows: list[dict], header: bool = True) -> None:
    """One line per row: the case, torch and kernel medians, speedup."""
    if header:
        print(f"{'case':<44}{'dtype':>10}{'torch ms':>11}{'kernel ms':>11}{'speedup':>9}")
    for r in rows:
        if r["kind"] == "pointwise":
            case = f"{r['op']} T={r['tokens']}"
        elif r["kind"].startswith("decode-"):
            case = f"{r['kind']} {r['model']} B={r['batch']} ctx={r['prefix'] + 1} {r['cache']}"
        else:
            case = f"{r['kind']} {r['model']} B={r['batch']} ctx={r['prefix'] + r['q_len']} q={r['q_len']}"
        line = f"{case:<44}{r['dtype']:>10}{r['torch_ms']:>11.3f}{r['kernel_ms']:>11.3f}{r['speedup']:>8.2f}x"
        if "baseline_ms" in r:
            line += f"  baseline {r['baseline_ms']:.3f} ms ({r['vs_baseline']:.2f}x)"
        print(line)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else the platform's machine name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> int:
    """Run every row, print the table, write benchmarks/results/cpu_kernels.json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="three attention rows, one dtype")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/cpu_kernels.json")
    parser.add_argument(
        "--decode-only", action="store_true", help="only the paged-decode rows (no file unless --out)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another build's .so (e.g. of the committed sources), timed interleaved on the paged-decode rows",
    )
    parser.add_argument("--no-torch", action="store_true", help="paged-decode rows without the torch path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if kc.load() is None:
        print(f"kernels.cpu unavailable: {kc.unavailable_reason()}")
        return 1
    baseline = build._import_binary(args.baseline.stem, args.baseline) if args.baseline else None
    rows: list[dict] = []
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    for dtype in [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]:
        for model, batch, ctx, shared, cold in PAGED_DECODE_CASES[:1] if args.quick else PAGED_DECODE_CASES:
            with_torch = not (args.no_torch or cold)
            rows.append(paged_decode_row(model, dtype, batch, ctx, shared, baseline, with_torch, cold))
            print_table(rows[-1:], header=len(rows) == 1)
    if args.decode_only:
        dtypes = []
    for dtype in dtypes:
        for model in MODELS:
            for kind, batch, prefix, q_len in attention_cases(args.quick):
                rows.append(attention_row(kind, model, dtype, batch, prefix, q_len))
                print_table(rows[-1:], header=len(rows) == 1)
        for tokens in (64, 512):
            rows.extend(pointwise_rows(dtype, tokens))
            print_table(rows[-5:], header=False)
    print()
    print_table(rows)
    meta = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "torch": torch.__version__,
        "capability": kc.load().capability,
        "block_size": BLOCK,
        "bf16_decode": "amx (GQA) + avx512_bf16"
        if kc.load().has_amx_decode
        else "avx512_bf16"
        if kc.load().has_bf16_dot_decode
        else "generic",
        "baseline": str(args.baseline) if args.baseline else None,
    }
    if args.decode_only and args.out is None:
        return 0
    out_path = args.out or ROOT / "benchmarks" / "results" / "cpu_kernels.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
