"""PackedLinear and kvferry's bf16 GEMV: few bf16 rows take the GEMV (where built), more take oneDNN's
packed kernel, fp32 keeps its plain weight for few rows; every path equals the fp32 product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvkernels import cpu
from kvkernels.cpu import build
from services.engine.worker.linear import (
    BF16_GEMV_ROWS,
    PackedLinear,
    bf16_gemv_kernels,
    onednn_available,
    pack_linears,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")


def _linear(n: int, k: int, bias: bool, dtype: torch.dtype, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)


def _close_to_fp32(out: torch.Tensor, x: torch.Tensor, layer: torch.nn.Linear) -> None:
    """Within two bf16 roundings (the output's, the bias's) of the fp32 product of the bf16 inputs."""
    ref = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert (out.float() - ref).abs().max() <= ref.abs().max() * 2**-7, (out.float() - ref).abs().max()


def test_bf16_gemv_is_built_exactly_on_cpus_with_avx512_bf16() -> None:
    if not cpu.available():
        pytest.skip("no C++ kernels here")
    spec = build.build_spec()
    native = spec.capability == "AVX512" and "-march=native" in spec.cflags
    assert cpu.has_bf16_gemv() == (native and "avx512_bf16" in spec.flags)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # a bf16 PackedLinear needs oneDNN's bf16 path
        layer = PackedLinear(_linear(64, 64, False, torch.bfloat16, 0), BF16_GEMV_ROWS, bf16_gemv_kernels())
        assert (layer.gemv is not None) == cpu.has_bf16_gemv()
    fp32 = PackedLinear(_linear(64, 64, False, torch.float32, 0), 8, bf16_gemv_kernels())
    assert fp32.gemv is None and fp32.plain is not None  # fp32 x is never rounded to bf16


@pytest.mark.parametrize(("n", "k"), [(64, 64), (200, 128), (1000, 768), (70, 6), (3, 2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])  # 4 rows per pass, then 3 / 2 / 1 left over
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_gemv_equals_the_fp32_product(n: int, k: int, rows: int, bias: bool) -> None:
    if not cpu.has_bf16_gemv():
        pytest.skip("kvferry's bf16 GEMV needs a CPU with AVX512_BF16")
    layer = _linear(n, k, bias, torch.bfloat16, n + k + rows)
    x = torch.randn(rows, k).bfloat16()
    tiles = cpu.pack_bf16_gemv(layer.weight)
    assert tiles.shape == (-(-n // 64), k // 2, 64, 2)
    _close_to_fp32(cpu.bf16_gemv(x, tiles, n, layer.bias), x, layer)


def test_bf16_gemv_rejects_what_it_cannot_read() -> None:
    if not cpu.has_bf16_gemv():
        pytest.skip("kvferry's bf16 GEMV needs a CPU with AVX512_BF16")
    with pytest.raises(ValueError, match="even number of input features"):
        cpu.pack_bf16_gemv(torch.zeros(8, 5, dtype=torch.bfloat16))
    tiles = cpu.pack_bf16_gemv(torch.zeros(64, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="tiles must be"):
        cpu.bf16_gemv(
            torch.zeros(1, 8, dtype=torch.bfloat16), tiles, 200
        )  # more features than the tiles hold
    with pytest.raises(RuntimeError, match="x must be"):
        cpu.bf16_gemv(torch.zeros(1, 8), tiles, 64)  # fp32 x


ONEDNN_BF16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 path on this CPU"
)


@ONEDNN_BF16
@pytest.mark.parametrize("rows", [1, 3, 4, 11, 12, 17])
def test_packed_linear_in_bf16_takes_the_gemv_below_its_crossover(rows: int) -> None:
    layer = _linear(300, 256, True, torch.bfloat16, rows)
    packed = PackedLinear(layer, BF16_GEMV_ROWS, bf16_gemv_kernels())
    x = torch.randn(rows, 256).bfloat16()
    calls = []
    if packed.gemv is not None:
        real = packed.gemv

        class Spy:  # counts the GEMV calls, passes them on
            def bf16_gemv(self, *args):  # noqa: ANN002, ANN202
                calls.append(args[1].shape[0])
                return real.bf16_gemv(*args)

        packed.gemv = Spy()
    out = packed(x)
    _close_to_fp32(out, x, layer)
    expected = [rows] if cpu.has_bf16_gemv() and rows < BF16_GEMV_ROWS else []
    assert calls == expected
    assert packed(x.view(1, rows, 256)).shape == (1, rows, 300)  # [batch, tokens, features] inputs too


@ONEDNN_BF16
def test_packed_linear_with_odd_input_features_keeps_f_linear() -> None:
    layer = _linear(16, 7, False, torch.bfloat16, 1)
    packed = PackedLinear(layer, BF16_GEMV_ROWS, bf16_gemv_kernels())
    assert packed.gemv is None and packed.tiles is None and packed.plain is not None
    x = torch.randn(2, 7).bfloat16()
    _close_to_fp32(packed(x), x, layer)


@ONEDNN_BF16
def test_the_gemv_can_be_turned_off_by_name_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFERRY_BF16_GEMV=off keeps one copy of each weight (oneDNN's); another value is refused, named."""
    assert bf16_gemv_kernels({"KVFERRY_BF16_GEMV": "off"}) is None
    assert (bf16_gemv_kernels({}) is not None) == cpu.has_bf16_gemv()
    with pytest.raises(ValueError, match="KVFERRY_BF16_GEMV='no'"):
        bf16_gemv_kernels({"KVFERRY_BF16_GEMV": "no"})
    totals = {}
    for choice, gemv in (("off", False), ("auto", cpu.has_bf16_gemv())):
        monkeypatch.setenv("KVFERRY_BF16_GEMV", choice)
        model = torch.nn.Sequential(
            _linear(64, 64, False, torch.bfloat16, 2), _linear(32, 64, True, torch.bfloat16, 3)
        )
        said = pack_linears(model, torch.bfloat16, torch.device("cpu"))
        layers = list(model)
        assert all(isinstance(m, PackedLinear) and m.plain is None for m in layers)
        assert all((m.tiles is not None) == gemv for m in layers)
        assert ("GEMV" in said) == gemv, said
        totals[choice] = sum(m.weight_bytes() for m in layers)
    weights = (64 + 32) * 64 * 2
    assert totals["auto"] >= totals["off"] + (weights if cpu.has_bf16_gemv() else 0)  # the tiles' second copy
