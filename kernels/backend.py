"""The ``backend`` argument of the kernel ops, shared by the packages that have a Triton twin.

``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` elsewhere; ``"torch"``: the reference;
``"triton"``: the fused op, on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1``).
A backend that cannot run the inputs is an error, never a silent fallback.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

BACKENDS = ("torch", "triton")


def resolve_backend(backend: str, x: Tensor, op: str) -> str:
    """The backend ``op`` runs for input ``x``; ValueError naming the choices for an unknown one."""
    return backend_on(backend, x.device, op)


def backend_on(backend: str, device: torch.device | str, op: str) -> str:
    """The backend ``op`` runs for inputs on ``device`` (only its type is read: no such device is needed), before
    any input exists; ValueError naming the choices for an unknown one."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"{op}: unknown backend {backend!r}; choices: auto, {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return backend


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(x: Tensor, op: str) -> None:
    """RuntimeError unless the fused kernels can run on ``x``'s device (CUDA, or the interpreter)."""
    if not x.is_cuda and not interpreting():
        raise RuntimeError(f"{op}: backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                           f"is imported to run on {x.device.type}; use backend='torch' or backend='auto'")


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU, queried once per device (a per-backward query is host time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
