"""Depth attention, the specification (docs/method.md §3-§4): softmax retrieval over a stack of sources.

For every view j, token (b, t) and source s:

    key_s    = RMSNorm(key_source_s) * gain_j          (raw key_source_s when key_norm=False)
    logit_s  = q_j · key_s                              (no 1/sqrt(d) temperature: AttnRes §3)
    alpha    = softmax_s(logit)                         (fp32)
    out_j    = Σ_s alpha_s · source_s                   (values are the un-normalised sources)

Plain PyTorch, fp32 math (fp64 when any input is fp64, so gradcheck means something); the output
is cast back to the sources' dtype. Later fused kernels are tested against this file.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _stacked(sources: Tensor | Sequence[Tensor]) -> Tensor:
    return sources if isinstance(sources, Tensor) else torch.stack(list(sources))


def _subscript(x: Tensor, per_view: str, shared: str, what: str) -> str:
    """einsum subscript of ``x``: with or without a leading view axis."""
    if x.dim() == len(per_view):
        return per_view
    if x.dim() == len(shared):
        return shared
    raise ValueError(f"depth_attn: {what} must have {len(shared)} or {len(per_view)} dims "
                     f"({shared} or {per_view}), got shape {tuple(x.shape)}")


def depth_attn(
    sources: Tensor | Sequence[Tensor],
    queries: Tensor,
    key_gains: Tensor | None = None,
    *,
    key_sources: Tensor | Sequence[Tensor] | None = None,
    key_norm: bool = True,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-view depth attention.

    Args:
        sources: values, ``(S, B, T, d)`` shared by every view, ``(m, S, B, T, d)`` one stack per
            view, or a list of ``S`` tensors ``(B, T, d)``.
        queries: pseudo-queries, ``(m, d)`` (input-independent) or ``(m, B, T, d)`` (per token).
        key_gains: key-RMSNorm gains ``(m, d)``; ``None`` means gain 1.
        key_sources: what the keys are made from, same layouts as ``sources`` (default: the
            sources themselves). Lets keys and values differ (expanded keys, identity values).
        key_norm: RMSNorm the keys (over d); when False the keys are the raw key sources.
        eps: RMSNorm epsilon.
        return_weights: also return the softmax weights.

    Returns:
        ``(m, B, T, d)`` in the sources' dtype, and with ``return_weights`` the weights
        ``(m, S, B, T)`` in the compute dtype (fp32, or fp64).
    """
    values = _stacked(sources)
    keys = values if key_sources is None else _stacked(key_sources)
    if keys.shape[-4:] != values.shape[-4:]:
        raise ValueError(f"depth_attn: key sources {tuple(keys.shape)} and sources "
                         f"{tuple(values.shape)} disagree on (S, B, T, d)")
    m, d = queries.shape[0], queries.shape[-1]
    if d != values.shape[-1] or (key_gains is not None and key_gains.shape != (m, d)):
        raise ValueError(f"depth_attn: queries {tuple(queries.shape)}, key gains "
                         f"{None if key_gains is None else tuple(key_gains.shape)} and sources "
                         f"{tuple(values.shape)} must share d and the view count m")
    v_sub = _subscript(values, "msbtd", "sbtd", "sources")
    k_sub = _subscript(keys, "msbtd", "sbtd", "key sources")
    q_sub = _subscript(queries, "mbtd", "md", "queries")
    ct = _compute_dtype(values, keys, queries, key_gains)
    # Autocast would run the einsums in bf16; this op is specified in fp32.
    with torch.autocast(device_type=values.device.type, enabled=False):
        k = keys.to(ct)
        if key_norm:
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
        q = queries.to(ct)
        if key_gains is not None:
            # q · (gain ⊙ n) = (q ⊙ gain) · n: fold the gain into the query, keys stay shared.
            g = key_gains.to(ct)
            q = q * (g if q.dim() == 2 else g[:, None, None, :])
        logits = torch.einsum(f"{k_sub},{q_sub}->msbt", k, q)  # (m, S, B, T)
        weights = torch.softmax(logits, dim=1)  # over sources
        out = torch.einsum(f"msbt,{v_sub}->mbtd", weights, values.to(ct))  # (m, B, T, d)
    out = out.to(values.dtype)
    return (out, weights) if return_weights else out


# --- the two-phase schedule (docs/method.md §3, Block AttnRes), as a composition of the spec --------------
def summaries(
    sources: Tensor | Sequence[Tensor],
    queries: Tensor,
    key_gains: Tensor | None = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Phase 1: C static queries (C, d) attend the same sources (S, B, T, d) at once.

    Returns the normalised outputs ``(C, B, T, d)`` (sources' dtype, as :func:`depth_attn`) and the
    log-sum-exp of the logits over sources ``(C, B, T)`` (fp32, fp64 for fp64 inputs)."""
    values = _stacked(sources)
    out, weights = depth_attn(values, queries, key_gains, key_norm=key_norm, eps=eps, return_weights=True)
    ct = _compute_dtype(values, queries, key_gains)
    with torch.autocast(device_type=values.device.type, enabled=False):
        k = values.to(ct)
        if key_norm:
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
        q = queries.to(ct) * (1 if key_gains is None else key_gains.to(ct))
        logits = torch.einsum("sbtd,md->msbt", k, q)  # (C, S, B, T)
        lse = torch.logsumexp(logits, dim=1)
    return out, lse


def merge(
    out: Tensor,
    lse: Tensor,
    partial: Tensor,
    query: Tensor,
    key_gain: Tensor | None = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Phase 2: fold one more source (the intra-block partial, (B, T, d)) into a phase-1 result by
    an online-softmax merge. ``out`` (B, T, d) and ``lse`` (B, T) come from :func:`summaries` for
    one query (d,). With z = (q ⊙ g)·RMSNorm(partial) and w = σ(z − lse), the partial's share,

        h = (1 − w)·out + w·partial  ==  depth_attn([sources..., partial], q, g)

    Returns h in the promoted dtype of ``out`` and ``partial``, and w (B, T) in the compute dtype."""
    ct = _compute_dtype(out, partial, query, key_gain)
    with torch.autocast(device_type=out.device.type, enabled=False):
        p = partial.to(ct)
        k = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps) if key_norm else p
        q = query.to(ct) * (1 if key_gain is None else key_gain.to(ct))
        z = k @ q  # (B, T)
        w = torch.sigmoid(z - lse.to(ct))
        o = out.to(ct)
        h = o + w[..., None] * (p - o)
    return h.to(torch.promote_types(out.dtype, partial.dtype)), w
