"""The weight-only quantized GEMM (int4 / int8 codes, per-group scale and offset) vs its reference."""

import pytest
import torch
from kernel_testlib import assert_close, device

from kvkernels.dequant_matmul import dequant_matmul, pack_int4
from kvkernels.reference import ref_dequant_matmul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(m: int, n: int, k: int, bits: int, group: int, dtype: torch.dtype, bias: bool, dev: str) -> None:
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device=dev)
    qweight = pack_int4(codes) if bits == 4 else codes
    scales = (torch.rand(n, k // group, device=dev) * 0.02 + 0.001).to(dtype)
    offsets = (-(2 ** (bits - 1)) * scales.float()).to(dtype)
    x = torch.randn(m, k, dtype=dtype, device=dev)
    b = torch.randn(n, dtype=dtype, device=dev) if bias else None
    out = dequant_matmul(x, qweight, scales, offsets, bits, group, b)
    assert_close(out, ref_dequant_matmul(x, qweight, scales, offsets, bits, group, b), dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 64, 64, 32), (5, 80, 128, 64), (17, 48, 96, 96)])
def test_dequant_matmul_interpreted(m: int, n: int, k: int, group: int, bits: int) -> None:
    check(m, n, k, bits, group, torch.float32, bias=m == 5, dev=device())


@pytest.mark.parametrize("m", [1, 19])
def test_fp8_e4m3_codes_decode_exactly_interpreted(m: int) -> None:
    """Every E4M3 byte but NaN (0x7f, 0xff): normals, subnormals, both zeros, both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)][:224].reshape(7, 32)  # 7 rows x 32 codes
    qweight = codes.repeat(10, 2)[:64]  # [64, 64]
    scales = torch.rand(64, 2) + 0.5
    x = torch.randn(m, 64)
    zeros = torch.zeros_like(scales)
    out = dequant_matmul(x, qweight, scales, zeros, 8, 32, fp8=True)
    assert_close(out, ref_dequant_matmul(x, qweight, scales, zeros, 8, 32, fp8=True), torch.float32)
    eye = torch.eye(64)  # one-hot rows read the dequantized weight itself: bit-exact
    weight = dequant_matmul(eye, qweight, torch.ones_like(scales), zeros, 8, 32, fp8=True).t()
    assert torch.equal(weight, qweight.view(torch.float8_e4m3fn).float())


def test_dequant_matmul_rejects_unsupported_layouts() -> None:
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="bits 3"):
        dequant_matmul(
            x, torch.zeros(64, 24, dtype=torch.uint8), torch.ones(64, 2), torch.zeros(64, 2), 3, 32
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 4096, 4096, 128), (64, 11008, 4096, 128), (256, 4096, 14336, 32)]
)
def test_dequant_matmul_full_shapes(
    m: int, n: int, k: int, group: int, bits: int, dtype: torch.dtype
) -> None:
    check(m, n, k, bits, group, dtype, bias=False, dev="cuda")
