"""Compile every kernel launch of the public wrappers for sm_90 (H100) with no GPU: catches GPU-only errors.

Run as a script WITHOUT TRITON_INTERPRET; each launch is intercepted, compiled to a cubin by the real
NVIDIA backend (bundled ptxas) instead of being run, and reported. Used by test_kernels_sm90_compile.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
OPTION_NAMES = ("num_warps", "num_stages")


def _usage(kernel: Any) -> str:
    """Registers and spill bytes that ptxas reports for the kernel's PTX."""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx) + ".o"],
            capture_output=True,
            text=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores", done.stderr)
    return f"regs={regs.group(1) if regs else '?'} spill_stores={spills.group(1) if spills else '?'}"


def compile_instead_of_run(compiled: list[str]) -> Callable:
    """A JITFunction.run replacement that compiles the launch for TARGET and records its name."""

    def run(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        backend = make_backend(TARGET)  # the JIT's own argument specialization (==1, %16, alignment)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        kernel = triton.compile(
            ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__
        )
        assert kernel.asm.get("cubin"), f"{self.__name__}: no cubin"
        constexprs = {self.arg_names[k[0]]: v for k, v in constexprs.items()}
        options = {k: getattr(options, k) for k in OPTION_NAMES}
        shown = {k: v for k, v in constexprs.items() if k not in ("UPCAST", "PRECISION")}
        compiled.append(f"{self.__name__} {shown} {options} smem={kernel.metadata.shared} {_usage(kernel)}")

    return run


def launch_all(quick: bool) -> None:
    """Call every public wrapper per kernel configuration the engine uses (CPU tensors); quick: bf16, D=128."""
    from kvkernels.activation import silu_and_mul
    from kvkernels.dequant_matmul import dequant_matmul
    from kvkernels.fused_moe import CONFIGS, choose_config, fused_moe
    from kvkernels.paged_decode_attention import paged_decode_attention
    from kvkernels.paged_prefill_attention import paged_prefill_attention
    from kvkernels.reshape_and_cache import reshape_and_cache
    from kvkernels.rms_norm import rms_norm
    from kvkernels.rotary import rotary_embedding

    for dtype in (torch.bfloat16,) if quick else (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (128,) if quick else (64, 80, 128, 256):
            cache = torch.zeros(4, 2, 2, 16, 2, head_dim, dtype=dtype)
            k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
            q = torch.zeros(3, 8, head_dim, dtype=dtype)
            tables = torch.zeros(3, 4, dtype=torch.int32)
            lens = torch.full((3,), 40, dtype=torch.int32)
            starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
            paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=1)
            paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=4)
            paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.1, max_query_len=1)
            reshape_and_cache(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(3, dtype=torch.int64))
        x = torch.zeros(4, 4096, dtype=dtype)
        rms_norm(x, x[0], 1e-6)
        rms_norm(x, x[0], 1e-6, x)
        silu_and_mul(x)
        if dtype != torch.float32:
            for bits, group in ((4, 128), (8, 32)):
                q = torch.zeros(256, 4096 // (8 // bits), dtype=torch.uint8)
                s = torch.zeros(256, 4096 // group, dtype=dtype)
                dequant_matmul(x, q, s, s, bits, group)
        # fused MoE: one T per tile config the chooser can pick (E=4, K=2: T / 2 rows per expert).
        moe_tokens = (2, 40, 100, 512)
        assert [choose_config(t, 2, 4) for t in moe_tokens] == list(CONFIGS)
        w13, w2 = torch.zeros(4, 512, 512, dtype=dtype), torch.zeros(4, 512, 256, dtype=dtype)
        for t in moe_tokens:
            ids = torch.arange(2 * t).reshape(t, 2) % 4
            fused_moe(torch.zeros(t, 512, dtype=dtype), w13, w2, torch.zeros(t, 2), ids)
        q = torch.zeros(4, 8, 128, dtype=dtype)
        for is_neox in (True, False):
            rotary_embedding(
                torch.zeros(4, dtype=torch.int64), q, q[:, :2], torch.zeros(16, 128, dtype=dtype), is_neox
            )


def main() -> int:
    """Compile all launches (--quick: a bf16 subset); print one line each; raise on the first failure."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    compiled: list[str] = []
    JITFunction.run = compile_instead_of_run(compiled)
    launch_all(quick="--quick" in sys.argv)
    print("\n".join(compiled))
    print(f"compiled {len(compiled)} launches for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
