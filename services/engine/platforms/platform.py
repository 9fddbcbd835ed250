"""Platform: what the engine runs on and what follows from it (ops backend, dtype, collectives), decided
from the facts torch reports (``DeviceFacts``) by one pure function, so every branch is testable."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Kind = Literal["cuda", "rocm", "xpu", "cpu"]
_CPU_ISA = ("avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16")


class DeviceFacts(BaseModel):
    """What torch says about this machine (gathered by ``detect.device_facts``)."""

    model_config = ConfigDict(frozen=True)

    requested: str = "auto"  # the --device flag
    cuda_devices: int = 0
    hip: bool = False  # torch built for ROCm: its CUDA devices are AMD GPUs
    xpu_devices: int = 0
    gpu_name: str = ""
    compute_capability: tuple[int, int] | None = None
    gpu_memory_bytes: int = 0
    cpu_name: str = ""
    cpu_flags: frozenset[str] = frozenset()
    cpu_kernels: bool = True  # kvferry's C++ CPU kernels build here


class Platform(BaseModel):
    """The platform and its defaults (each overridable by a flag)."""

    model_config = ConfigDict(frozen=True)

    kind: Kind
    device: str  # torch device of rank 0
    name: str
    compute_capability: str | None = None
    memory_gib: float | None = None
    cpu_isa: tuple[str, ...] = ()
    ops_backend: Literal["triton", "cpu", "torch"]
    dist_backend: Literal["nccl", "gloo"]
    native_bf16: bool  # bf16 matmuls run natively (GPUs; CPUs with AVX512-BF16 or AMX)
    reason: str

    def describe(self) -> str:
        """One start-up log line."""
        parts = [self.kind, self.name]
        if self.compute_capability:
            parts.append(f"sm_{self.compute_capability.replace('.', '')}")
        if self.memory_gib:
            parts.append(f"{self.memory_gib:.0f} GiB")
        if self.cpu_isa:
            parts.append("/".join(self.cpu_isa))
        return f"{', '.join(parts)}; ops {self.ops_backend}, collectives {self.dist_backend} ({self.reason})"


def decide(facts: DeviceFacts) -> Platform:
    """The platform the facts describe; ValueError for a requested device that is not there."""
    want = facts.requested
    if want.startswith("cuda") and not facts.cuda_devices:
        raise ValueError(f"device={want!r} requested but torch sees no CUDA (or ROCm) device")
    if want.startswith("xpu") and not facts.xpu_devices:
        raise ValueError(f"device={want!r} requested but torch sees no Intel XPU device")
    if want not in ("auto", "cpu") and not want.startswith(("cuda", "xpu")):
        raise ValueError(f"device={want!r}: choose auto, cpu, cuda[:N] or xpu[:N]")
    if want.startswith("cuda") or (want == "auto" and facts.cuda_devices):
        return _gpu(facts, want if want != "auto" else "cuda")
    if want.startswith("xpu") or (want == "auto" and facts.xpu_devices):
        return Platform(
            kind="xpu", device=want if want != "auto" else "xpu", name=facts.gpu_name or "Intel XPU",
            memory_gib=facts.gpu_memory_bytes / 2**30 or None, ops_backend="torch", dist_backend="gloo",
            native_bf16=True, reason="Intel XPU: plain torch ops (kvferry's Triton kernels target CUDA/ROCm)",
        )  # fmt: skip
    return _cpu(facts, "the CPU was requested" if want == "cpu" else "no accelerator found")


def _gpu(facts: DeviceFacts, device: str) -> Platform:
    cc = facts.compute_capability
    rocm = facts.hip
    return Platform(
        kind="rocm" if rocm else "cuda",
        device=device,
        name=facts.gpu_name,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        memory_gib=facts.gpu_memory_bytes / 2**30 or None,
        ops_backend="triton",
        dist_backend="nccl",  # RCCL under the same name on ROCm
        native_bf16=rocm or cc is None or cc >= (8, 0),
        reason=f"{'ROCm (HIP)' if rocm else 'CUDA'} device: Triton kernels, {'RCCL' if rocm else 'NCCL'}",
    )


def _cpu(facts: DeviceFacts, why: str) -> Platform:
    isa = tuple(f for f in _CPU_ISA if f in facts.cpu_flags)
    native = "avx512_bf16" in facts.cpu_flags or "amx_bf16" in facts.cpu_flags
    ops = "cpu" if facts.cpu_kernels else "torch"
    kernels = (
        "kvferry's C++ kernels" if facts.cpu_kernels else "plain torch ops (the C++ kernels did not build)"
    )
    return Platform(
        kind="cpu", device="cpu", name=facts.cpu_name or "CPU", cpu_isa=isa, ops_backend=ops,
        dist_backend="gloo", native_bf16=native,
        reason=f"{why}: {kernels}, {'bf16' if native else 'fp32'} by default",
    )  # fmt: skip
