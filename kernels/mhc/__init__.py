"""mHC read (coefficients + h) and write (stream mixing) as ops (mHC, arXiv 2512.24880; docs/method.md §2).

Three public functions (the first two with the same signature as their twins in ``reference.py``), plus ``backend``:

- ``mhc_pre(x, φ, α, b_pre, b_post, b_res, norm_gain)`` -> ``(h, H^pre, H^post, H^res)``: the RMSNorm over
  n·d, the projection z = x'φ, the gates, Sinkhorn-Knopp, and the read h = H^pre X.
- ``mhc_post(x, out, H^post, H^res)`` -> ``X' = H^res X + H^postᵀ out``.
- ``mhc_post_pre(x, out, H^post, H^res, φ, α, b_pre, b_post, b_res, norm_gain)`` -> ``(X', h, H^pre, H^post,
  H^res)``: a write and the next sublayer's read, one pass over the streams on triton.

The writes take an optional ``recompute`` (``StreamRecompute(every=L_r)``, ``recompute.py``, fused backend only):
the streams are kept for backward only every L_r sublayers and rebuilt in backward (the paper's §4.3 recomputation).

``backend="triton"`` runs ``fused.py`` (one pass over the streams each, backward by recomputation);
``backend="torch"`` runs the reference; ``backend="auto"`` picks triton for CUDA tensors and torch
otherwise. An unavailable backend is an error, never a silent fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import BACKENDS, check_triton_device, resolve_backend
from . import reference
from .recompute import StreamRecompute, optimal_every

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_triton(x: Tensor, *others: Tensor | None) -> None:
    """Raise if the fused kernels cannot run these inputs (never fall back silently)."""
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"mhc: backend 'triton' computes in fp32 and takes streams in "
                         f"{[str(dt) for dt in TRITON_DTYPES]}; got {x.dtype} (use backend='torch' for fp64)")
    devices = {t.device for t in (x, *others) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"mhc: all inputs must be on one device, got {sorted(map(str, devices))}")
    check_triton_device(x, "mhc")


def _check_pre(x, phi, alpha, b_pre, b_post, b_res, norm_gain, sinkhorn_iters) -> None:
    if x.dim() < 2:
        raise ValueError(f"mhc_pre: x must be (..., n, d), got shape {tuple(x.shape)}")
    n, d = x.shape[-2:]
    k = n * n + 2 * n
    for name, t, shape in (("phi", phi, (n * d, k)), ("alpha", alpha, (3,)), ("b_pre", b_pre, (n,)),
                           ("b_post", b_post, (n,)), ("b_res", b_res, (n, n)),
                           ("norm_gain", norm_gain, (n * d,))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"mhc_pre: {name} must have shape {shape} for n={n}, d={d}, got {tuple(t.shape)}")
    if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise ValueError(f"mhc_pre: sinkhorn_iters={sinkhorn_iters!r} must be an integer >= 1")


def _check_recompute(backend: str, recompute: StreamRecompute | None, layer: int | None) -> None:
    if recompute is None:
        return
    if backend == "torch":
        raise ValueError("mhc: recompute (the streams kept every L_r sublayers, residual.recompute_every) applies to "
                         "the fused backend ('triton', or 'auto' on CUDA tensors); got backend 'torch'")
    if not isinstance(recompute, StreamRecompute):
        raise TypeError(f"mhc: recompute must be a StreamRecompute, got {type(recompute).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"mhc: with recompute, layer={layer!r} must be the sublayer index (an integer >= 0)")


def _check_post(x, out, h_post, h_res) -> None:
    if x.dim() < 2:
        raise ValueError(f"mhc_post: x must be (..., n, d), got shape {tuple(x.shape)}")
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    for name, t, shape in (("out", out, (*lead, d)), ("h_post", h_post, (*lead, n)), ("h_res", h_res, (*lead, n, n))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"mhc_post: {name} must have shape {tuple(shape)} for x {tuple(x.shape)}, "
                             f"got {tuple(t.shape)}")


def mhc_pre(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    norm_gain: Tensor | None = None,
    *,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The mHC coefficients of every token and the read of one sublayer.

    Args:
        x: streams ``(..., n, d)``; phi ``(n·d, n²+2n)``, columns [pre | post | res row-major];
        alpha ``(3,)`` as [pre, post, res]; b_pre, b_post ``(n,)``; b_res ``(n, n)``; norm_gain ``(n·d,)``
        or None. sinkhorn_iters: Sinkhorn-Knopp iterations (paper: 20). eps: RMSNorm epsilon.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see the module docstring).

    Returns:
        h ``(..., d)`` in x's dtype; H^pre ``(..., n)``, H^post ``(..., n)``, H^res ``(..., n, n)`` in fp32
        (fp64 from the torch backend on fp64 streams).
    """
    backend = resolve_backend(backend, x, "mhc")
    _check_pre(x, phi, alpha, b_pre, b_post, b_res, norm_gain, sinkhorn_iters)
    if backend == "torch":
        return reference.mhc_pre(x, phi, alpha, b_pre, b_post, b_res, norm_gain, sinkhorn_iters=sinkhorn_iters, eps=eps)
    _check_triton(x, phi, alpha, b_pre, b_post, b_res, norm_gain)
    from . import fused  # imports triton: only when asked for

    with torch.autocast(device_type=x.device.type, enabled=False):
        return fused.mhc_pre(x, phi, alpha, b_pre, b_post, b_res, norm_gain, sinkhorn_iters=sinkhorn_iters, eps=eps)


def mhc_post_pre(
    x: Tensor,
    out: Tensor,
    h_post: Tensor,
    h_res: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    norm_gain: Tensor | None = None,
    *,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
    backend: str = "auto",
    recompute: StreamRecompute | None = None,
    layer: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The write of sublayer l followed by the read of sublayer l+1 (the paper's fused write/read):
    ``mhc_pre(mhc_post(x, out, h_post, h_res), phi, ...)`` with one pass over the streams on triton.

    Args: ``x, out, h_post, h_res`` as in ``mhc_post`` (sublayer l); ``phi, alpha, b_pre, b_post, b_res,
    norm_gain, sinkhorn_iters, eps`` as in ``mhc_pre`` (sublayer l+1); backend as both; ``recompute`` and
    ``layer`` (= l) as in ``mhc_post``.

    Returns:
        (X', h, H^pre, H^post, H^res): the new streams ``(..., n, d)`` and the read of them.
    """
    backend = resolve_backend(backend, x, "mhc")
    _check_post(x, out, h_post, h_res)  # both parts checked before either computes (X' has x's shape)
    _check_pre(x, phi, alpha, b_pre, b_post, b_res, norm_gain, sinkhorn_iters)
    _check_recompute(backend, recompute, layer)
    if backend == "torch":
        new = reference.mhc_post(x, out, h_post, h_res)
        return (new, *reference.mhc_pre(new, phi, alpha, b_pre, b_post, b_res, norm_gain,
                                        sinkhorn_iters=sinkhorn_iters, eps=eps))
    _check_triton(x, out, h_post, h_res, phi, alpha, b_pre, b_post, b_res, norm_gain)
    from . import fused

    with torch.autocast(device_type=x.device.type, enabled=False):
        return fused.mhc_post_pre(x, out, h_post, h_res, phi, alpha, b_pre, b_post, b_res, norm_gain,
                                  sinkhorn_iters=sinkhorn_iters, eps=eps, recompute=recompute, layer=layer or 0)


def mhc_post(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor, *, backend: str = "auto",
             recompute: StreamRecompute | None = None, layer: int | None = None) -> Tensor:
    """The write X' = H^res X + H^postᵀ out.

    Args:
        x: streams ``(..., n, d)``; out: the sublayer output ``(..., d)``; h_post ``(..., n)``;
        h_res ``(..., n, n)``; backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        recompute: a ``StreamRecompute`` shared by the writes of one forward (fused backend only): x, which is
        X_layer, is kept for backward only every ``recompute.every`` sublayers and rebuilt otherwise (recompute.py).
        layer: the sublayer index l of this write (needed with ``recompute``).

    Returns:
        X' ``(..., n, d)`` in x's dtype, mixed in fp32 (fp64 for fp64 coefficients on the torch backend).
    """
    backend = resolve_backend(backend, x, "mhc")
    _check_post(x, out, h_post, h_res)
    _check_recompute(backend, recompute, layer)
    if backend == "torch":
        return reference.mhc_post(x, out, h_post, h_res)
    _check_triton(x, out, h_post, h_res)
    from . import fused

    with torch.autocast(device_type=x.device.type, enabled=False):
        return fused.mhc_post(x, out, h_post, h_res, recompute=recompute, layer=layer or 0)


__all__ = ["BACKENDS", "StreamRecompute", "mhc_post", "mhc_post_pre", "mhc_pre", "optimal_every"]
