"""FakeCuda: run engine code as if on a GPU, on the CPU, and fail on the first CPU tensor that meets a GPU one.

Why this mechanism: a device mix-up is a property of which tensors meet in one op, not of the values, so
it can be caught without a GPU. Tensors "on the GPU" are wrapper subclasses (``OnDevice``) that hold
their data in a CPU tensor and report ``device == cuda:0`` to Python (C++ sees the meta device, so no
CUDA guard is ever built). A TorchDispatchMode sees every aten op: it runs the op on the CPU payloads,
wraps the results of ops on GPU inputs (and of factories asked for ``device='cuda'``), and raises
``DeviceMixup`` when a GPU tensor meets a CPU tensor of one or more dimensions in any op other than a
copy between devices (real CUDA raises there too, or silently syncs, for indices). Unlike the meta
device, the values are real, so the engine's data-dependent code (``.tolist()``, argmax, grammar
masks) runs exactly as it would on the GPU path, and the step's output can be checked too.
``torch.cuda``'s queries are answered as one 1 GiB device with 64 MiB in use; the Triton backend cannot run here
(the tests use the plain torch backend, the GPU path's reference).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_TRANSFERS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten._has_compatible_shallow_copy_type.default,  # nn.Module.to(device) asks it
}
_GIB = 2**30


class DeviceMixup(RuntimeError):
    """A tensor on the GPU met a CPU tensor in one op."""


class OnDevice(torch.Tensor):
    """A tensor that is 'on cuda:0': its data lives in ``payload`` (a CPU tensor)."""

    payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor) -> OnDevice:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            payload.shape,
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=payload.dtype,
            device="meta",
            requires_grad=False,
        )
        r.payload = payload
        return r

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return CUDA

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True

    @property  # type: ignore[override]
    def is_meta(self) -> bool:
        return False

    def tolist(self) -> Any:  # type: ignore[override]
        return self.payload.tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")

    def get_device(self) -> int:  # type: ignore[override]
        return 0

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"OnDevice({self.payload!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise DeviceMixup(f"{func} ran outside FakeCuda")


def _unwrap(t: Any) -> Any:
    return t.payload if isinstance(t, OnDevice) else t


def _wrap(t: Any) -> Any:
    return OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t


def _where() -> str:
    """The innermost project frame of the current stack (where the mixed op was written)."""
    frames = [
        f for f in traceback.extract_stack() if "/services/" in f.filename or "/kvkernels/" in f.filename
    ]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('/services/')[-1]}:{f.lineno} ({f.line})"


class FakeCuda(TorchDispatchMode):
    """The dispatch mode (see the module docstring); ``mixups`` lists every mix-up seen, even if caught."""

    def __init__(self) -> None:
        super().__init__()
        # the FAKE key: torch skips CUDA's lazy init for factories while such a mode is active
        self._mode_key = torch._C._TorchDispatchModeKey.FAKE
        self.mixups: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._has_compatible_shallow_copy_type.default:
            return not any(isinstance(a, OnDevice) for a in args)  # nn.Module.to: a new (wrapped) parameter
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_gpu = any(isinstance(t, OnDevice) for t in tensors)
        host = [tuple(t.shape) for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
        if on_gpu and host and func not in _TRANSFERS:
            msg = f"{func} mixes cuda:0 with cpu tensors of shapes {host} at {_where()}"
            self.mixups.append(msg)
            raise DeviceMixup(msg)
        device = kwargs.get("device")
        to_gpu = device is not None and torch.device(device).type == "cuda"
        to_cpu = device is not None and torch.device(device).type == "cpu"
        if device is not None:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.ops.aten.copy_.default:
            return args[0]
        if to_gpu or (on_gpu and not to_cpu):
            return tree_map(_wrap, out)
        return out


def _fake_props() -> Any:
    class Props:
        name, major, minor, total_memory, multi_processor_count = "FakeCuda", 9, 0, _GIB, 132

    return Props()


@contextlib.contextmanager
def fake_cuda(monkeypatch: Any) -> Iterator[FakeCuda]:
    """Inside: ``torch.cuda`` reports one device, ``device='cuda'`` tensors are ``OnDevice``; yields the
    mode (its ``mixups``). ``monkeypatch`` is pytest's; the patches are undone with it."""
    real_tensor, real_as_tensor = torch.tensor, torch.as_tensor

    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = real_tensor(data, *args, **kwargs)
        return t.to(device) if device is not None else t

    def as_tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = real_as_tensor(data, *args, **kwargs)
        return t.to(device) if device is not None else t

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: False)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "get_device_properties", lambda *a: _fake_props())
    monkeypatch.setattr(cuda, "get_device_name", lambda *a: "FakeCuda")
    monkeypatch.setattr(cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (_GIB - 64 * 2**20, _GIB))
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "set_device"):
        monkeypatch.setattr(cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        monkeypatch.setattr(cuda, name, lambda *a, **k: 0)
    mode = FakeCuda()
    with mode, torch.inference_mode():
        yield mode


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer of ``module`` wrapped as 'on cuda:0' (call inside ``fake_cuda``)."""
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is not None and not isinstance(t, OnDevice):
                    store[name] = OnDevice(t.detach())  # type: ignore[assignment]
    return module
