"""MSAR as one op: conv views of the sources, per-view depth attention, H^pre mixer (``reference.py``).

Two public functions, each with an explicit ``backend``, and ``pack_reads`` for the first:
- ``msar``: the whole read, h (B, T, d). ``backend="triton"`` runs ``fused.py`` (views made inside
  the kernel, mixer in its epilogue: the forward writes only h and the per-view lse);
  ``backend="torch"`` runs ``reference.msar`` (the composition of ``causal_conv``, ``depth_attn``
  and the mixer).
- ``msar_attn``: the m streams R (m, B, T, d) without the mixer, same backends.

``backend="auto"`` is ``"triton"`` for CUDA tensors, else ``"torch"``. An unavailable backend is
an error, never a silent fallback. The identity views of the ``wo_conv`` ablation are taps of size
1 equal to one (Dirac), so the fused op covers them too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..backend import BACKENDS, check_triton_device, resolve_backend
from . import reference
from .reference import FUSIONS

MAX_K = 16  # longest conv kernel the fused kernel accepts (its tap loop is unrolled)


class BufferedSources(Sequence):
    """S sources that the fused op reads in place, never stacked: the first rows of a ``SourceBuffer``
    (``kernels.depth_attn.buffer``: one preallocated (n_max, B, T, d) tensor, each row written once), given by
    their aliases ``rows`` (``buffer.rows[:n]``, the rows a reader saw, whatever was appended since), then an
    optional ``partial`` (B, T, d), e.g. Block MSAR's running sum of the open block, read through its own
    address. As a sequence it is those S tensors (the rows' differentiable aliases, then the partial): what
    the torch backend stacks, and what the gradients flow to (each row's through the buffer's store)."""

    def __init__(self, buffer, rows: Sequence[Tensor], partial: Tensor | None = None):
        rows = tuple(rows)
        if len(rows) > len(buffer.rows) or any(r is not b for r, b in zip(rows, buffer.rows)):
            raise ValueError(f"BufferedSources: the rows must be the buffer's first rows (its aliases, in order); "
                             f"got {len(rows)} rows for a buffer of {len(buffer.rows)}")
        self.buffer, self.rows, self.partial = buffer, rows, partial
        self._items = (*rows, *(() if partial is None else (partial,)))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _sources(x: Tensor | Sequence[Tensor]) -> tuple[tuple[int, ...], torch.device, set[torch.dtype]]:
    """(shape as stacked, device, dtypes) of x: a tensor (S, B, T, d) or a non-empty sequence of (B, T, d)."""
    if isinstance(x, Tensor):
        return tuple(x.shape), x.device, {x.dtype}
    if not x or any(not isinstance(t, Tensor) or t.dim() != 3 or t.shape != x[0].shape for t in x):
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in x]
        raise ValueError(f"msar: a list of sources must hold S >= 1 tensors (B, T, d) of one shape, got {shapes}")
    devices = {t.device for t in x}
    if len(devices) != 1:
        raise ValueError(f"msar: the sources must be on one device, got {sorted(map(str, devices))}")
    return (len(x), *x[0].shape), x[0].device, {t.dtype for t in x}


def _check_inputs(x, taps, queries, key_gains, doc_ids) -> tuple[tuple[int, ...], torch.device]:
    """Validate the shapes and devices; returns x's shape as stacked (S, B, T, d) and its device."""
    shape, device, _ = _sources(x)
    if len(shape) != 4:
        raise ValueError(f"msar_attn: x must be (S, B, T, d), got shape {shape}")
    S, B, T, d = shape
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
    devices = {device} | {t.device for t in (queries, key_gains, doc_ids, *taps) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"msar_attn: all inputs must be on one device, got {sorted(map(str, devices))}")
    return shape, device


def _check_mixer(m, d, phi, alpha, bias, fusion, device) -> None:
    if phi.shape != (m * d, m):
        raise ValueError(f"msar: phi must be (m·d, m) = ({m * d}, {m}), got {tuple(phi.shape)}")
    if alpha.numel() != 1:
        raise ValueError(f"msar: alpha must be a scalar tensor, got shape {tuple(alpha.shape)}")
    if bias.shape != (m,):
        raise ValueError(f"msar: bias must be (m,) = ({m},), got {tuple(bias.shape)}")
    if fusion not in FUSIONS:
        raise ValueError(f"msar: unknown fusion {fusion!r}; choices: {', '.join(FUSIONS)}")
    if {phi.device, alpha.device, bias.device} != {device}:
        raise ValueError(f"msar: phi, alpha and bias must be on {device}")


def check_triton_supported(x: Tensor, taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None,
                           *extra: Tensor) -> None:
    """Raise if the fused kernel cannot run these inputs (never fall back silently)."""
    ks = [c.shape[0] for c in taps]
    if any(k > MAX_K for k in ks):
        raise ValueError(f"msar_attn: backend 'triton' needs kernel sizes <= {MAX_K}, got {ks}")
    named = [("x", dt) for dt in sorted(_sources(x)[2], key=str)] + [
        (name, t.dtype) for name, t in [("queries", queries), ("key_gains", key_gains), *(("taps", c) for c in taps),
                                        *(("phi/alpha/bias", t) for t in extra)] if t is not None]
    for name, dtype in named:
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"msar_attn: backend 'triton' computes in fp32 and takes "
                             f"{[str(dt) for dt in TRITON_DTYPES]}; {name} is {dtype} "
                             f"(use backend='torch' for fp64)")
    check_triton_device(_first(x), "msar_attn")


def _first(x: Tensor | Sequence[Tensor]) -> Tensor:
    """A tensor that stands for x's device and backend: x itself, or its first source."""
    return x if isinstance(x, Tensor) else x[0]


def _doc_ids(doc_ids, shape, device):
    if doc_ids is None:  # one document per row
        return torch.zeros(shape[1], shape[2], dtype=torch.int64, device=device)
    return doc_ids


def msar(x: Tensor, taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None, doc_ids: Tensor | None,
         phi: Tensor, alpha: Tensor, bias: Tensor, *, key_norm: bool = True, fusion: str = "sigmoid",
         eps: float = 1e-6, return_weights: bool = False, backend: str = "auto",
         recompute_streams: bool = False, packed=None) -> Tensor | tuple[Tensor, Tensor]:
    """The whole MSAR read of one consumer: h = Σ_j g_j r^{(j)} (docs/method.md §4).

    Args:
        x: sources ``(S, B, T, d)``, or a sequence of S tensors ``(B, T, d)`` (the fused backend then
            saves the tensors as they are for its backward, not a stacked copy, but stacks them per call),
            or ``BufferedSources`` (the fused backend reads them in place: no copy at all).
        taps: ``m-1`` tensors ``(k_j, d)``; queries ``(m, d)``;
        key_gains ``(m, d)`` or None; doc_ids ``(B, T)`` integer (None: one document per row).
        phi: ``(m·d, m)``; alpha: scalar tensor; bias: ``(m,)``; fusion: ``"sigmoid"`` or ``"softmax"``.
        backend: ``"auto"`` (``"triton"`` for CUDA tensors, else ``"torch"``), ``"triton"`` (the
            fused kernel; on CPU tensors only under ``TRITON_INTERPRET=1``), ``"torch"``.
        recompute_streams: the fused backend keeps no streams R ``(m, B, T, d)`` for the mixer's backward and
            rebuilds them there (one more pass over the sources): less memory, more time. Fused backend only
            (an error with ``"torch"``, whose autograd keeps what it keeps; ``model.checkpoint_reads`` is its knob).
        packed: this consumer's entry of ``pack_reads`` (made once a step from the same parameters and doc_ids):
            the fused backend then takes its packed taps, folded queries, φᵀ and document window instead of making
            them (about 6 small kernels a read). Fused backend only; it must match taps, queries and doc_ids.

    Returns:
        h ``(B, T, d)`` in x's dtype (``BufferedSources``: the dtype the buffer's sources were given in, its
        ``stream_dtype``, whatever its rows store), and with ``return_weights`` the softmax weights
        ``(m, S, B, T)`` fp32 (fp64 from the torch backend on fp64 inputs; detached from triton).
    """
    shape, device = _check_inputs(x, taps, queries, key_gains, doc_ids)
    backend = resolve_backend(backend, _first(x), "msar_attn")
    _check_mixer(queries.shape[0], shape[-1], phi, alpha, bias, fusion, device)
    doc_ids = _doc_ids(doc_ids, shape, device)
    if packed is not None:
        _check_packed(packed, backend, taps, queries, doc_ids)
    if backend == "torch":
        if recompute_streams:
            raise ValueError("msar: recompute_streams=True applies to the fused backend ('triton', or 'auto' on "
                             "CUDA); the 'torch' backend keeps what autograd keeps (recompute its reads with "
                             "model.checkpoint_reads)")
        stacked = x if isinstance(x, Tensor) else torch.stack(list(x))  # (S, B, T, d)
        return reference.msar(stacked, taps, queries, key_gains, doc_ids, phi, alpha, bias, key_norm=key_norm,
                              fusion=fusion, eps=eps, return_weights=return_weights)
    check_triton_supported(x, taps, queries, key_gains, phi, alpha, bias)
    from . import fused  # imports triton: only when asked for

    return fused.msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, key_norm=key_norm, fusion=fusion,
                      eps=eps, return_weights=return_weights, recompute_streams=recompute_streams, packed=packed)


def pack_reads(taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None, phi: Tensor, alpha: Tensor,
               bias: Tensor, doc_ids: Tensor) -> tuple:
    """What the fused reads of C consumers take besides their sources, made once (a step) for all of them: each
    consumer's packed taps, folded queries and φᵀ, and the document window, in a few kernels instead of about 6
    a read (the fused backend only: it imports Triton). Pass entry c as ``msar(..., packed=...)`` of consumer c's read.

    Args:
        taps: ``m-1`` tensors ``(C, k_j, d)``, consumer c's taps at [c]; queries and key_gains ``(C, m, d)``
            (key_gains or None); phi ``(C, m·d, m)``; alpha ``(C,)``; bias ``(C, m)``; doc_ids ``(B, T)`` integer.
    Returns:
        C ``fused.Packed``, detached (the reads' gradients still reach the parameters they are given).
    """
    if queries.dim() != 3:
        raise ValueError(f"pack_reads: queries must be (C, m, d), got {tuple(queries.shape)}")
    C, m, d = queries.shape
    shapes = {"key_gains": (key_gains, (C, m, d)), "phi": (phi, (C, m * d, m)), "alpha": (alpha, (C,)),
              "bias": (bias, (C, m))}
    for name, (t, want) in shapes.items():
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"pack_reads: {name} must be {want} (C, m, d = {C}, {m}, {d}), got {tuple(t.shape)}")
    if len(taps) != m - 1 or any(c.dim() != 3 or c.shape[0] != C or c.shape[2] != d or not 1 <= c.shape[1] <= MAX_K
                                 for c in taps):
        raise ValueError(f"pack_reads: taps must be m-1 = {m - 1} tensors (C, k, d) = ({C}, k, {d}) with "
                         f"1 <= k <= {MAX_K}, got {[tuple(c.shape) for c in taps]}")
    if doc_ids.dim() != 2 or doc_ids.is_floating_point():
        raise ValueError(f"pack_reads: doc_ids must be integer (B, T), got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    from . import fused  # imports triton: only when asked for

    return fused.pack_reads(taps, queries, key_gains, phi, alpha, bias, doc_ids)


def _check_packed(packed, backend: str, taps, queries, doc_ids) -> None:
    if backend != "triton":
        raise ValueError(f"msar: packed (from pack_reads) applies to the fused backend ('triton', or 'auto' on CUDA), "
                         f"got backend {backend!r}")
    ks = (1, *(c.shape[0] for c in taps))
    if (packed.ks != ks or packed.qg.shape != queries.shape or packed.near.shape != doc_ids.shape
            or packed.taps.device != queries.device):
        raise ValueError(f"msar: packed does not match this read: kernel sizes {packed.ks} against {ks}, queries "
                         f"{tuple(packed.qg.shape)} against {tuple(queries.shape)}, doc_ids {tuple(packed.near.shape)} "
                         f"against {tuple(doc_ids.shape)}, device {packed.taps.device} against {queries.device}")


def msar_attn(x: Tensor, taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None,
              doc_ids: Tensor | None, *, key_norm: bool = True, eps: float = 1e-6,
              return_weights: bool = False, backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """The m streams without the mixer; same arguments as :func:`msar` minus the mixer's (a sequence of
    sources is stacked: this op saves no sources of its own).

    Returns:
        streams ``(m, B, T, d)`` in x's dtype, and with ``return_weights`` the weights ``(m, S, B, T)``.
    """
    shape, device = _check_inputs(x, taps, queries, key_gains, doc_ids)
    x = x if isinstance(x, Tensor) else torch.stack(list(x))  # (S, B, T, d)
    backend = resolve_backend(backend, x, "msar_attn")
    doc_ids = _doc_ids(doc_ids, shape, device)
    if backend == "torch":
        return reference.msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm, eps=eps,
                                   return_weights=return_weights)
    check_triton_supported(x, taps, queries, key_gains)
    from . import fused

    return fused.msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm, eps=eps,
                           return_weights=return_weights)


__all__ = ["BACKENDS", "BufferedSources", "FUSIONS", "MAX_K", "check_triton_supported", "msar", "msar_attn",
           "pack_reads"]
