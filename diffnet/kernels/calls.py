"""What the Python sides of the compiled kernels share: the pointers they pass, and when a call
may take a kernel at all."""
from __future__ import annotations

import torch


def address(t: torch.Tensor | None) -> int | None:
    """The tensor's data pointer for ctypes (None for a missing output)."""
    return None if t is None else t.data_ptr()


def check(status: int, kernel: str) -> None:
    """Raise MemoryError if a kernel returned non-zero: it could not allocate its work buffers."""
    if status:
        raise MemoryError(f"the {kernel} kernel could not allocate its work buffers")


def eager_only() -> bool:
    """Not under autocast and not traced, scripted or compiled: those see the eager modules
    (autocast computes in bf16, and an exported or compiled graph cannot call into ctypes)."""
    return (not torch.is_autocast_enabled("cpu") and not torch.jit.is_tracing()
            and not torch.jit.is_scripting() and not torch.compiler.is_compiling())
