"""CPU benchmark: the C++ kernels (kvkernels.cpu) vs the engine's plain-torch path, 2 threads, medians."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/cpu_kernels.py`: this file's folder must not shadow the `kernels` package (Hugging Face's, which transformers imports).
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvkernels.cpu as kc  # noqa: E402
from benchmarks.cpu_pointwise import pointwise_rows  # noqa: E402
from benchmarks.timing import median_ms  # noqa: E402
from kvkernels.cpu import build  # noqa: E402

BLOCK = 16
MODELS = {"h768-llama": (12, 12, 64), "smollm2": (9, 3, 64)}  # (Hq, Hkv, D)


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
    their first shared_tokens positions' blocks (0: all blocks distinct); shared rows also time the
    kernel with cascade=False (per_row_ms: each row attends the prefix alone). baseline: another build of the
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

    def run_kernel() -> torch.Tensor:  # cascade forced on (the default is on only with AMX)
        return kc.paged_attention(out, q, key_cache, value_cache, tables, qsl, lens, scale, cascade=True)

    fns.append(run_kernel)
    out_rows = torch.empty_like(q)

    def run_per_row() -> torch.Tensor:  # the same build with the shared prefix attended row by row
        return kc.paged_attention(
            out_rows, q, key_cache, value_cache, tables, qsl, lens, scale, cascade=False
        )

    if shared_tokens > 0:
        fns.append(run_per_row)
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
    if shared_tokens > 0:  # cascade vs per-row attention of the shared prefix
        row["per_row_ms"] = times[fns.index(run_per_row)]
        row["vs_per_row"] = row["per_row_ms"] / kernel_ms
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
        if "per_row_ms" in r:
            line += f"  per-row {r['per_row_ms']:.3f} ms ({r['vs_per_row']:.2f}x)"
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
        print(f"kvkernels.cpu unavailable: {kc.unavailable_reason()}")
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
            rows.extend(pointwise_rows(dtype, tokens, BLOCK))
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
