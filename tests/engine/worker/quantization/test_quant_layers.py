"""Each quantized format's matmul equals dequantize-then-matmul; readers equal the formats' own formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.worker.quantization import quantized_linear
from services.engine.worker.quantization.gguf_blocks import gguf_weight
from services.engine.worker.quantization.gptq_awq import awq_weight, gptq_weight
from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight
from services.engine.worker.quantization.quantized_linear import Int4Linear, Int8Linear
from tests.quant_writers import AWQ_PACK_ORDER, _asym, _pack_cols, _pack_rows


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_equal_the_gguf_dequantizer(kind: str) -> None:
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    t = getattr(GGMLQuantizationType, kind)
    raw = quants.quantize(w, t)
    ref = quants.dequantize(raw, t).reshape(w.shape)
    assert np.array_equal(gguf_weight(kind, raw, 48, 256).dequantize().numpy(), ref)


def test_q4_k_super_blocks_equal_the_gguf_dequantizer() -> None:
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    rows, cols = 16, 512
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for lo in (0, 2):  # finite fp16 d and dmin
        half = rng.uniform(0.01, 0.1, (rows, cols // 256)).astype(np.float16)
        raw[..., lo : lo + 2] = half.view(np.uint8).reshape(rows, cols // 256, 2)
    raw = raw.reshape(rows, -1)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(rows, cols)
    assert np.array_equal(gguf_weight("Q4_K", raw, rows, cols).dequantize().numpy(), ref)


@pytest.mark.parametrize(("n", "k", "act_order"), [(64, 128, False), (96, 256, True), (200, 64, False)])
@pytest.mark.parametrize("rows", [1, 3, 40])  # the packed kernel below the crossover, dense above
def test_int4_linear_equals_dequantized_matmul(n: int, k: int, act_order: bool, rows: int) -> None:
    torch.manual_seed(n + k)
    gw = GroupQuantWeight.quantize(torch.randn(n, k), 4, 32)
    if act_order:
        perm = torch.randperm(k)
        gw = GroupQuantWeight(gw.codes, gw.scales, gw.offsets, 4, 32, perm)
    bias = torch.randn(n)
    layer = Int4Linear(gw, bias, torch.float32, min_dense_rows=16)
    x = torch.randn(rows, k)
    ref = x @ gw.dequantize().t() + bias
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-4)
    with pytest.MonkeyPatch.context() as mp:  # without the C++ kernels: torch's packing and kernel
        mp.setattr(quantized_linear, "cpu_ops", lambda: None)
        plain = Int4Linear(gw, bias, torch.float32, min_dense_rows=16)
    assert plain.native
    torch.testing.assert_close(plain(x), ref, rtol=1e-5, atol=1e-4)


def test_int4_linear_in_bfloat16_is_close() -> None:
    torch.manual_seed(3)
    gw = GroupQuantWeight.quantize(torch.randn(128, 256), 4, 64)
    layer = Int4Linear(gw, None, torch.bfloat16)
    x = torch.randn(2, 256)
    ref = x @ gw.dequantize().t()
    err = (layer(x.bfloat16()).float() - ref).abs().max() / ref.abs().max()
    assert err < 0.02


def test_int4_gemv_is_built_exactly_on_cpus_with_avx512_bf16() -> None:
    """bf16 Int4Linear takes kvferry's GEMV exactly where a native AVX-512 build has avx512_bf16."""
    from kvkernels import cpu
    from kvkernels.cpu import build

    if not cpu.available():
        pytest.skip("no C++ kernels here")
    spec = build.build_spec()
    native = spec.capability == "AVX512" and "-march=native" in spec.cflags
    assert cpu.has_bf16_int4_gemv() == (native and "avx512_bf16" in spec.flags)
    gw = GroupQuantWeight.quantize(torch.randn(64, 64), 4, 32)
    assert (Int4Linear(gw, None, torch.bfloat16).gemv is not None) == cpu.has_bf16_int4_gemv()
    assert Int4Linear(gw, None, torch.float32).gemv is None  # fp32 x is never rounded to bf16


def _dequantized(layer: Int4Linear, gw: GroupQuantWeight) -> torch.Tensor:
    """The [N, K] fp32 weight the layer holds: its codes with its own (dtype-rounded) scales and zeros."""
    codes = gw.regroup(layer.group).codes.float()
    n, k = codes.shape
    sz = layer.scales_and_zeros.float()[:, :n]  # [G, N, 2]: (q - 8) * scale + zero
    scales = sz[..., 0].t().repeat_interleave(layer.group, dim=1)[:, :k]
    zeros = sz[..., 1].t().repeat_interleave(layer.group, dim=1)[:, :k]
    return (codes - 8) * scales + zeros


@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (200, 128, 64), (96, 512, 256), (130, 256, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 15])  # 4 x rows per pass, then 3 / 2 / 1 left over
def test_int4_gemv_in_bfloat16_equals_dequantized_matmul(n: int, k: int, group: int, rows: int) -> None:
    from kvkernels import cpu

    if not cpu.has_bf16_int4_gemv():
        pytest.skip("kvferry's int4 GEMV needs a CPU with AVX512_BF16")
    torch.manual_seed(n + k + rows)
    gw = GroupQuantWeight.quantize(torch.randn(n, k), 4, group)
    bias = torch.randn(n)
    layer = Int4Linear(gw, bias, torch.bfloat16, min_dense_rows=16)
    assert layer.gemv is not None
    x = torch.randn(rows, k).bfloat16()
    # reference: the bf16 layer's own dequantized weight (its bf16 scales) in fp32, rounded once at the end
    ref = x.float() @ _dequantized(layer, gw).t() + bias.bfloat16().float()
    out = layer(x)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # bf16 output (and the bf16 bias add): within two bf16 roundings of the largest output
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() / 64)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    layer.gemv = None  # torch's int4pack kernel on the same bytes: no closer to the reference
    torch_err = ((layer(x).float() - ref).norm() / ref.norm()).item()
    assert err <= torch_err * 1.1 + 1e-6


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("k", [96, 72])  # 72: not a multiple of 16, where torch's int8pack kernel crashes
def test_int8_linear_is_the_per_channel_formula(rows: int, k: int) -> None:
    torch.manual_seed(4)
    w, bias = torch.randn(80, k), torch.randn(80)
    scale = w.abs().amax(1, keepdim=True) / 127
    deq = (w / scale).round().clamp(-127, 127) * scale
    x = torch.randn(rows, k)
    ref = x @ deq.t() + bias
    torch.testing.assert_close(Int8Linear(w, bias, torch.float32)(x), ref, rtol=1e-5, atol=1e-4)
    y = Int8Linear(w, bias, torch.bfloat16)(x.bfloat16()).float()
    assert (y - ref).norm() / ref.norm() < 0.02


def _twin(q: np.ndarray, z: np.ndarray, s: np.ndarray, g_idx: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((s[g_idx] * (q - z[g_idx])).T.astype(np.float32))


@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, True)])
def test_gptq_tensors_read_as_the_gptq_formula(bits: int, act_order: bool) -> None:
    rng = np.random.default_rng(bits)
    n, k, group = 64, 128, 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    g_idx = np.arange(k) // group
    if act_order:
        g_idx = g_idx[rng.permutation(k)]
    q, z, s = _asym(w, bits, group, g_idx)
    s16 = s.astype(np.float16)
    parts = {
        "qweight": torch.from_numpy(_pack_rows(q, bits)),
        "qzeros": torch.from_numpy(_pack_cols(z - 1, bits)),
        "scales": torch.from_numpy(s16),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }
    gw = gptq_weight(parts, bits, group)
    assert (gw.perm is not None) == act_order
    torch.testing.assert_close(gw.dequantize(), _twin(q, z, s16.astype(np.float32), g_idx), rtol=0, atol=1e-6)


def test_awq_tensors_read_as_the_awq_formula() -> None:
    rng = np.random.default_rng(5)
    n, k, group = 64, 128, 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    g_idx = np.arange(k) // group
    q, z, s = _asym(w, 4, group, g_idx)
    parts = {
        "qweight": torch.from_numpy(_pack_cols(q, 4, AWQ_PACK_ORDER)),
        "qzeros": torch.from_numpy(_pack_cols(z, 4, AWQ_PACK_ORDER)),
        "scales": torch.from_numpy(s.astype(np.float16)),
    }
    gw = awq_weight(parts, 4, group)
    torch.testing.assert_close(
        gw.dequantize(), _twin(q, z, s.astype(np.float16).astype(np.float32), g_idx), rtol=0, atol=1e-6
    )
