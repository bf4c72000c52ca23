"""MSAR retrieval: conv views of the sources + per-view depth attention (see ``reference.py``).

``backend="triton"`` runs ``fused.py`` (the views are made inside the kernel, never stored);
``backend="torch"`` runs the reference composition of ``causal_conv`` and ``depth_attn``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from . import reference

BACKENDS = ("torch", "triton")
MAX_D = 1024  # the fused kernel keeps next_pow2(d) channels of a token block in registers
MAX_K = 16  # longest conv kernel the fused kernel accepts
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(x, taps, queries, key_gains, doc_ids) -> None:
    if x.dim() != 4:
        raise ValueError(f"msar_attn: x must be (S, B, T, d), got shape {tuple(x.shape)}")
    S, B, T, d = x.shape
    m = 1 + len(taps)
    if queries.shape != (m, d):
        raise ValueError(f"msar_attn: queries must be (m, d) = ({m}, {d}) (m = 1 + len(taps)), "
                         f"got {tuple(queries.shape)}")
    if key_gains is not None and key_gains.shape != (m, d):
        raise ValueError(f"msar_attn: key_gains must be (m, d) = ({m}, {d}) or None, got {tuple(key_gains.shape)}")
    for j, c in enumerate(taps, start=1):
        if c.dim() != 2 or c.shape[1] != d or c.shape[0] < 1:
            raise ValueError(f"msar_attn: taps[{j - 1}] (view {j}) must be (k, d) with d={d}, got {tuple(c.shape)}")
    if doc_ids is not None and (doc_ids.shape != (B, T) or doc_ids.is_floating_point()):
        raise ValueError(f"msar_attn: doc_ids must be integer (B, T) = ({B}, {T}), "
                         f"got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    devices = {t.device for t in (x, queries, key_gains, doc_ids, *taps) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"msar_attn: all inputs must be on one device, got {sorted(map(str, devices))}")


def check_triton_supported(x: Tensor, taps: Sequence[Tensor], queries: Tensor,
                           key_gains: Tensor | None) -> None:
    """Raise if the fused kernel cannot run these inputs (never fall back silently)."""
    d = x.shape[-1]
    if d > MAX_D:
        raise ValueError(f"msar_attn: backend 'triton' supports d <= {MAX_D}, got d={d}")
    ks = [c.shape[0] for c in taps]
    if any(k < 2 or k > MAX_K for k in ks) or len(set(ks)) != len(ks):
        raise ValueError(f"msar_attn: backend 'triton' needs distinct kernel sizes in 2..{MAX_K}, got {ks}")
    for name, t in (("x", x), ("queries", queries), ("key_gains", key_gains), *(("taps", c) for c in taps)):
        if t is not None and t.dtype not in TRITON_DTYPES:
            raise ValueError(f"msar_attn: backend 'triton' computes in fp32 and takes "
                             f"{[str(dt) for dt in TRITON_DTYPES]}; {name} is {t.dtype} "
                             f"(use backend='torch' for fp64)")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"msar_attn: backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 set "
                           f"before triton is imported to run on {x.device.type}; use backend='torch' "
                           f"or backend='auto'")


def msar_attn(x: Tensor, taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None,
              doc_ids: Tensor | None, *, key_norm: bool = True, eps: float = 1e-6,
              return_weights: bool = False, backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """MSAR retrieval; same signature as :func:`reference.msar_attn` plus ``backend``.

    Args:
        x: sources ``(S, B, T, d)``; taps: ``m-1`` tensors ``(k_j, d)``; queries ``(m, d)``;
        key_gains ``(m, d)`` or None; doc_ids ``(B, T)`` integer (None: one document per row).
        backend: ``"auto"`` (``"triton"`` for CUDA tensors, else ``"torch"``), ``"triton"`` (the
            fused kernel; on CPU tensors only under ``TRITON_INTERPRET=1``), ``"torch"`` (the
            reference). An unavailable backend is an error, never a silent fallback.

    Returns:
        streams ``(m, B, T, d)`` in x's dtype, and with ``return_weights`` the softmax weights
        ``(m, S, B, T)`` fp32 (fp64 from the torch backend on fp64 inputs). The triton backend
        returns them detached.
    """
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"msar_attn: unknown backend {backend!r}; choices: auto, {', '.join(BACKENDS)}")
    _check_inputs(x, taps, queries, key_gains, doc_ids)
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return reference.msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm, eps=eps,
                                   return_weights=return_weights)
    check_triton_supported(x, taps, queries, key_gains)
    from . import fused  # imports triton: only when asked for

    if doc_ids is None:
        doc_ids = torch.zeros(x.shape[1], x.shape[2], dtype=torch.int64, device=x.device)
    return fused.msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm, eps=eps,
                           return_weights=return_weights)


__all__ = ["BACKENDS", "MAX_D", "MAX_K", "check_triton_supported", "msar_attn"]
