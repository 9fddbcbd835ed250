"""device_facts / current_platform: ask torch (and /proc/cpuinfo) what this machine has."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.platforms.platform import DeviceFacts, Platform, decide


def device_facts(requested: str = "auto", check_cpu_kernels: bool = True) -> DeviceFacts:
    """The facts ``decide`` needs; GPU facts of device 0 (or the requested index)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    xpu_mod = getattr(torch, "xpu", None)
    xpu = xpu_mod.device_count() if xpu_mod is not None and xpu_mod.is_available() else 0
    facts: dict = {"requested": requested, "cuda_devices": cuda, "xpu_devices": xpu,
                   "hip": torch.version.hip is not None}  # fmt: skip
    index = int(requested.split(":")[1]) if ":" in requested else 0
    if cuda and not requested.startswith(("cpu", "xpu")):
        props = torch.cuda.get_device_properties(min(index, cuda - 1))
        facts.update(gpu_name=props.name, compute_capability=(props.major, props.minor),
                     gpu_memory_bytes=props.total_memory)  # fmt: skip
    elif xpu and xpu_mod is not None and not requested.startswith("cpu"):
        props = xpu_mod.get_device_properties(min(index, xpu - 1))
        facts.update(gpu_name=props.name, gpu_memory_bytes=getattr(props, "total_memory", 0))
    facts.update(
        cpu_name=_cpu_name(),
        cpu_flags=cpu_flags(),
        # a GPU pod never builds the C++ CPU kernels (minutes of g++ at start-up for nothing)
        cpu_kernels=_kernels() if check_cpu_kernels and not _gpu_bound(requested, cuda, xpu) else False,
    )
    return DeviceFacts(**facts)


def current_platform(requested: str = "auto") -> Platform:
    """This machine's platform for ``--device requested`` (ValueError when it is not there)."""
    return decide(device_facts(requested))


def cpu_flags() -> frozenset[str]:
    """The CPU's ISA flags as torch detects them (its capability table, which cpuinfo agrees with)."""
    caps = torch.cpu.get_capabilities()
    return frozenset(name for name, present in caps.items() if present is True)


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 dot products (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cpu_name() -> str:
    name = torch.cpu.get_capabilities().get("cpu_name")
    if isinstance(name, str) and name:
        return name
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _gpu_bound(requested: str, cuda: int, xpu: int) -> bool:
    """Whether ``--device requested`` lands on a GPU of this machine."""
    if requested.startswith("cpu"):
        return False
    return bool(cuda or xpu) or requested.startswith(("cuda", "xpu"))


def _kernels() -> bool:
    import kvkernels.cpu

    return kvkernels.cpu.available()
