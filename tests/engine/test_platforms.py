"""Platform detection: this machine's facts, and the decision for CUDA, ROCm, XPU and CPUs of every ISA."""

from __future__ import annotations

import pytest

from services.engine import LLM
from services.engine.platforms.detect import cpu_has_native_bf16, current_platform, device_facts
from services.engine.platforms.platform import DeviceFacts, decide

H200 = DeviceFacts(
    cuda_devices=1, gpu_name="NVIDIA H200", compute_capability=(9, 0), gpu_memory_bytes=141 * 2**30
)


def test_this_machine() -> None:
    facts = device_facts()
    platform = current_platform()
    if facts.cuda_devices:
        assert platform.kind in ("cuda", "rocm") and platform.ops_backend == "triton"
        return
    assert platform.kind == "cpu" and platform.device == "cpu" and platform.dist_backend == "gloo"
    assert platform.native_bf16 == cpu_has_native_bf16()
    assert platform.ops_backend == ("cpu" if facts.cpu_kernels else "torch")
    assert "avx2" in platform.cpu_isa or "avx2" not in facts.cpu_flags
    assert "no accelerator found" in platform.describe()


def test_gpus() -> None:
    cuda = decide(H200)
    assert (cuda.kind, cuda.ops_backend, cuda.dist_backend, cuda.compute_capability) == (
        "cuda",
        "triton",
        "nccl",
        "9.0",
    )
    assert "sm_90" in cuda.describe() and "141 GiB" in cuda.describe()
    assert not decide(H200.model_copy(update={"compute_capability": (7, 5)})).native_bf16  # Turing
    rocm = decide(H200.model_copy(update={"hip": True, "gpu_name": "AMD Instinct MI300X"}))
    assert rocm.kind == "rocm" and "RCCL" in rocm.reason
    xpu = decide(DeviceFacts(xpu_devices=1, gpu_name="Intel Data Center GPU Max"))
    assert (xpu.kind, xpu.ops_backend, xpu.device) == ("xpu", "torch", "xpu")
    assert decide(H200.model_copy(update={"requested": "cpu"})).kind == "cpu"  # --device cpu wins


def test_cpus_of_each_isa() -> None:
    amx = decide(
        DeviceFacts(cpu_flags=frozenset({"avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16"}))
    )
    assert amx.native_bf16 and amx.cpu_isa == ("avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16")
    avx2 = decide(DeviceFacts(cpu_flags=frozenset({"avx2"}), cpu_kernels=False))
    assert not avx2.native_bf16 and avx2.ops_backend == "torch" and "did not build" in avx2.reason


def test_a_requested_device_that_is_missing_is_a_clear_error(llama_dir) -> None:
    with pytest.raises(ValueError, match="'cuda:1' requested but torch sees no CUDA"):
        decide(DeviceFacts(requested="cuda:1"))
    with pytest.raises(ValueError, match="no Intel XPU"):
        decide(DeviceFacts(requested="xpu"))
    with pytest.raises(ValueError, match="choose auto, cpu, cuda"):
        decide(DeviceFacts(requested="tpu"))
    if not device_facts().cuda_devices:
        with pytest.raises(ValueError, match="sees no CUDA"):
            LLM(model=str(llama_dir), device="cuda")
