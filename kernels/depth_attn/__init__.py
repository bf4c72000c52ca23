"""Depth attention: softmax retrieval over a stack of sources (docs/method.md §3, see ``reference.py``).

Two entry points, each with an explicit ``backend``:

- :func:`depth_attn`: one pass over all sources (the specification's signature).
- :func:`depth_attn_summaries` + :func:`depth_attn_merge`: the two-phase schedule of Block AttnRes.
  Phase 1: the C static queries of a block attend the completed sources at once (one read of each
  source for all consumers); phase 2: each consumer folds its intra-block partial in by an
  online-softmax merge. Sources live in a :class:`SourceBuffer` and are never re-stacked.

``backend``: ``"auto"`` (``"triton"`` for CUDA tensors, else ``"torch"``), ``"triton"`` (``fused.py``;
on CPU tensors only under ``TRITON_INTERPRET=1``), ``"torch"`` (the reference). Inputs the fused op
does not compute are an error naming the value, never a silent fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import BACKENDS, check_triton_device, resolve_backend
from . import reference
from .buffer import SourceBuffer

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TILE = 32768  # next_pow2(C) · next_pow2(d): a program keeps a (C, d) accumulator per token


def _check_triton(op: str, C: int, d: int, **tensors: Tensor | None) -> None:
    """The fused kernels' limits: fp32/bf16/fp16 inputs, next_pow2(C)·next_pow2(d) <= MAX_TILE."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in TRITON_DTYPES:
            raise ValueError(f"{op}: backend 'triton' computes in fp32 and takes "
                             f"{[str(dt) for dt in TRITON_DTYPES]}; {name} is {t.dtype} (use backend='torch')")
    tile = (1 << max(C - 1, 0).bit_length()) * (1 << max(d - 1, 0).bit_length())
    if tile > MAX_TILE:
        raise ValueError(f"{op}: backend 'triton' needs next_pow2(queries)·next_pow2(d) <= {MAX_TILE}, "
                         f"got {C} queries and d={d}; use fewer queries per call or backend='torch'")


def _check_queries(op: str, queries: Tensor, key_gains: Tensor | None, d: int) -> None:
    if queries.dim() != 2 or queries.shape[-1] != d:
        raise ValueError(f"{op}: queries must be static (C, d) with d={d}, got shape {tuple(queries.shape)}")
    if key_gains is not None and key_gains.shape != queries.shape:
        raise ValueError(f"{op}: key_gains must be {tuple(queries.shape)} like the queries, "
                         f"got {tuple(key_gains.shape)}")


def fold_key_gains(queries: Tensor, key_gains: Tensor | None) -> Tensor:
    """q ⊙ g in fp32, contiguous, with autograd: q·(g ⊙ n) = (q ⊙ g)·n, the keys stay shared. The ops take the result
    as queries with no gain of their own (a residual folds every consumer's at once: ``FusedState.queries``)."""
    q = queries.float()
    return (q if key_gains is None else q * key_gains.float()).contiguous()


def depth_attn(sources, queries, key_gains=None, *, key_sources=None, key_norm=True, eps=1e-6,
               return_weights=False, backend="auto"):
    """Depth attention; same signature as :func:`reference.depth_attn` plus ``backend``.

    The triton backend covers shared sources ``(S, B, T, d)`` (or a list of S ``(B, T, d)``), static
    queries ``(m, d)``, optional key gains, key RMSNorm on or off, keys = values (``key_sources``
    None). It returns the weights detached (diagnostics)."""
    x = sources if isinstance(sources, Tensor) else sources[0]
    backend = resolve_backend(backend, x, "depth_attn")
    if backend == "torch":
        return reference.depth_attn(sources, queries, key_gains, key_sources=key_sources,
                                    key_norm=key_norm, eps=eps, return_weights=return_weights)
    values = reference._stacked(sources)
    if key_sources is not None:
        raise ValueError("depth_attn: backend 'triton' takes keys = values (key_sources=None), "
                         "got key_sources; use backend='torch'")
    if values.dim() != 4:
        raise ValueError(f"depth_attn: backend 'triton' takes shared sources (S, B, T, d), "
                         f"got shape {tuple(values.shape)}; use backend='torch'")
    _check_queries("depth_attn", queries, key_gains, values.shape[-1])
    _check_triton("depth_attn", queries.shape[0], values.shape[-1], sources=values, queries=queries,
                  key_gains=key_gains)
    check_triton_device(values, "depth_attn")
    from . import fused  # imports triton: only when asked for

    out, lse, logits = fused.summaries(values.contiguous(), values.shape[0], False, bool(key_norm), float(eps),
                                       bool(return_weights), fold_key_gains(queries, key_gains))
    return (out, torch.exp(logits - lse.detach()[:, None])) if return_weights else out


def depth_attn_summaries(sources: SourceBuffer | Tensor, queries: Tensor, key_gains: Tensor | None = None, *,
                         key_norm: bool = True, eps: float = 1e-6, return_weights: bool = False,
                         out_dtype: torch.dtype | None = None, backend: str = "auto"):
    """Phase 1 of the two-phase schedule: C static queries attend the same n sources at once.

    Args:
        sources: a :class:`SourceBuffer` (its rows written so far; read in place by the fused
            kernel) or a tensor ``(n, B, T, d)``.
        queries: ``(C, d)``, one per consumer; key_gains ``(C, d)`` or None.

    Returns:
        ``outs``, a tuple of C ``(B, T, d)`` normalised outputs (in ``out_dtype``, default the sources'
        dtype: bf16 halves the bytes of the outputs and of their gradients, at one rounding), ``lses``, a tuple
        of C ``(B, T)`` log-sum-exps of the logits over sources (fp32), and with ``return_weights``
        the weights ``(C, n, B, T)`` (detached from the triton backend).
    """
    buffered = isinstance(sources, SourceBuffer)
    if buffered and not sources.rows:
        raise ValueError("depth_attn_summaries: the SourceBuffer has no source yet")
    x = sources.data if buffered else sources
    if x.dim() != 4:
        raise ValueError(f"depth_attn_summaries: sources must be (n, B, T, d), got shape {tuple(x.shape)}")
    _check_queries("depth_attn_summaries", queries, key_gains, x.shape[-1])
    backend = resolve_backend(backend, x, "depth_attn_summaries")
    if backend == "torch":
        values = torch.stack(sources.rows) if buffered else sources
        out, lse = reference.summaries(values, queries, key_gains, key_norm=key_norm, eps=eps)
        if out_dtype is not None:
            out = out.to(out_dtype)
        res = (tuple(out.unbind(0)), tuple(lse.unbind(0)))
        if return_weights:
            with torch.no_grad():
                _, weights = reference.depth_attn(values, queries, key_gains, key_norm=key_norm, eps=eps,
                                                  return_weights=True)
            res += (weights,)
        return res
    _check_triton("depth_attn_summaries", queries.shape[0], x.shape[-1], sources=x, queries=queries,
                  key_gains=key_gains)
    check_triton_device(x, "depth_attn_summaries")
    from . import fused

    C, n = queries.shape[0], len(sources) if buffered else x.shape[0]
    rows = sources.rows if buffered else ()
    res = fused.summaries(x if buffered else x.contiguous(), n, True, bool(key_norm), float(eps),
                          bool(return_weights), fold_key_gains(queries, key_gains), tuple(rows),
                          sources.grads if buffered else None, out_dtype)
    outs, lses, logits = res[:C], res[C: 2 * C], res[-1]
    if return_weights:
        return outs, lses, torch.exp(logits - torch.stack(lses).detach()[:, None])
    return outs, lses


def summaries_keep_outputs(sources: SourceBuffer | Tensor, C: int, out_dtype: torch.dtype | None,
                           backend: str = "auto") -> bool:
    """Whether :func:`depth_attn_summaries` over ``sources`` with C queries and ``out_dtype`` keeps its outputs for
    its backward (the fused op, with outputs narrower than the sources: ``fused.DELTA_FROM_OUTPUTS``). Where it does,
    a merge of one of them can keep it in place of its own result (``depth_attn_merge(keep_out=True)``)."""
    x = sources.data if isinstance(sources, SourceBuffer) else sources
    if resolve_backend(backend, x, "depth_attn_summaries") == "torch":
        return False
    from . import fused

    n = len(sources) if isinstance(sources, SourceBuffer) else x.shape[0]  # the rows a call reads now
    return fused.keeps_outputs(x.dtype, out_dtype, n, C, x.shape[-1])


def depth_attn_merge(out: Tensor, lse: Tensor, partial: Tensor | None, query: Tensor, key_gain: Tensor | None = None, *,
                     new: Tensor | None = None, key_norm: bool = True, eps: float = 1e-6, keep_out: bool = False,
                     backend: str = "auto"):
    """Phase 2: fold the intra-block partial ``(B, T, d)`` into one consumer's phase-1 result
    (``out`` (B, T, d), ``lse`` (B, T)) by an online-softmax merge; query ``(d,)``, key_gain ``(d,)``
    or None. Returns h ``(B, T, d)`` and the partial's weight w ``(B, T)`` (w is not differentiable
    from the triton backend); the summaries' weights are their phase-1 weights times (1 − w).

    ``new`` ``(B, T, d)``: the block's newest output, summed into the partial inside the op (the partial
    merged is ``partial + new``, or ``new`` alone with ``partial=None``) and returned third, so a residual
    keeps its running partial sum without a separate add forward or backward (``fused.MergeSumFunction``).

    ``keep_out``: the fused op keeps ``out`` for its backward instead of h (the same (B, T, d) bytes), for a caller
    that holds ``out`` anyway (``summaries_keep_outputs``), so h lives no longer than its reader needs it; not for
    a non-contiguous ``out``, whose contiguous copy would be one tensor more. The result and the gradients are the
    same either way; the reference keeps what its autograd keeps."""
    d = out.shape[-1]
    merged = partial if new is None else new
    if merged is None:
        raise ValueError("depth_attn_merge: partial is None and no new output to merge; pass at least one")
    for name, t in (("partial", partial), ("new", new)):
        if t is not None and (t.shape != out.shape or lse.shape != out.shape[:-1]):
            raise ValueError(f"depth_attn_merge: out {tuple(out.shape)}, lse {tuple(lse.shape)} and {name} "
                             f"{tuple(t.shape)} must be (..., d), (...) and (..., d) alike")
    if query.shape != (d,) or (key_gain is not None and key_gain.shape != (d,)):
        raise ValueError(f"depth_attn_merge: query and key_gain must be ({d},), got {tuple(query.shape)} and "
                         f"{None if key_gain is None else tuple(key_gain.shape)}")
    backend = resolve_backend(backend, out, "depth_attn_merge")
    if backend == "torch":
        if new is None:
            return reference.merge(out, lse, partial, query, key_gain, key_norm=key_norm, eps=eps)
        p = new if partial is None else partial + new  # (B, T, d): the running partial sum
        return (*reference.merge(out, lse, p, query, key_gain, key_norm=key_norm, eps=eps), p)
    _check_triton("depth_attn_merge", 1, d, out=out, partial=partial, new=new, query=query, key_gain=key_gain)
    check_triton_device(out, "depth_attn_merge")
    from . import fused

    qg = fold_key_gains(query, key_gain)  # (d,): one autograd node per merge (host time counts at small d)
    keep_out = bool(keep_out) and out.is_contiguous()
    if new is None:
        return fused.merge(out.contiguous(), lse.float().contiguous(), partial.contiguous(), qg, bool(key_norm),
                           float(eps), keep_out)
    return fused.merge_sum(out.contiguous(), lse.float().contiguous(), None if partial is None else partial.contiguous(),
                           new.contiguous(), qg, bool(key_norm), float(eps), keep_out)


__all__ = ["BACKENDS", "SourceBuffer", "depth_attn", "depth_attn_merge", "depth_attn_summaries", "fold_key_gains",
           "summaries_keep_outputs"]
