"""MSAR, the specification (docs/method.md §4): conv views of the sources, per-view depth attention, H^pre mixer.

For views j = 0..m-1 (view 0 the identity, view j >= 1 a causal depthwise conv with taps
``taps[j-1]`` of shape ``(k_j, d)``, reset at document boundaries):

    E_j(x_s)[t] = Σ_{τ<k_j} c_τ^{(j)} ⊙ x_s[t-τ] · [doc(t-τ) = doc(t)]
    r^{(j)}     = Σ_s softmax_s( (q_j ⊙ g_j) · RMSNorm(E_j(x_s)) ) · E_j(x_s)        (msar_attn)

and the mixer (mHC's H^pre over the m streams, per token):

    R = [r^{(0)}; …; r^{(m-1)}] ∈ R^{m×d},  z = α · (RMSNorm(vec R) φ) + b ∈ R^m,
    g = σ(z) (or softmax over m),           h = Σ_j g_j r^{(j)}                      (mix, msar)

``msar_attn`` is the composition of the two public references (``kernels.causal_conv`` and
``kernels.depth_attn`` with ``backend="torch"``), not a copy of them, so the fused kernel is tested
against what ``residuals/msar.py`` computes unfused. It materialises the (m, S, B, T, d) views; the
fused kernel never does. Math in fp32, or fp64 when given fp64 (so fp64 gradchecks apply).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.causal_conv import causal_conv
from kernels.depth_attn import depth_attn

FUSIONS = ("sigmoid", "softmax")


def expand(x: Tensor, taps: Sequence[Tensor], doc_ids: Tensor) -> Tensor:
    """Views of the sources x (S, B, T, d): (m, S, B, T, d), view 0 the identity."""
    return torch.stack([x, *(causal_conv(x, c, doc_ids, backend="torch") for c in taps)])


def msar_attn(
    x: Tensor,
    taps: Sequence[Tensor],
    queries: Tensor,
    key_gains: Tensor | None,
    doc_ids: Tensor,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Depth attention of m static queries, each over its own conv view of the sources.

    Args:
        x: sources ``(S, B, T, d)``.
        taps: ``m-1`` conv tap tensors ``(k_j, d)``; ``taps[j-1][τ]`` multiplies the token τ back.
        queries: ``(m, d)``, one pseudo-query per view.
        key_gains: key-RMSNorm gains ``(m, d)``, or ``None`` (gain 1).
        doc_ids: ``(B, T)`` document id of every token; convs never cross a document boundary.
        key_norm: RMSNorm the keys (over d).
        eps: RMSNorm epsilon.
        return_weights: also return the softmax weights.

    Returns:
        streams ``(m, B, T, d)`` in x's dtype, and with ``return_weights`` the weights
        ``(m, S, B, T)`` (fp32, or fp64 for fp64 inputs).
    """
    views = expand(x, taps, doc_ids)  # (m, S, B, T, d)
    return depth_attn(views, queries, key_gains, key_norm=key_norm, eps=eps,
                      return_weights=return_weights, backend="torch")


def mix(streams: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, *, fusion: str = "sigmoid",
        eps: float = 1e-6) -> Tensor:
    """The H^pre mixer: h = Σ_j g_j r^{(j)} with g = σ(α·RMSNorm(vec R)·φ + b) (or softmax over m).

    Args:
        streams: R ``(m, B, T, d)``; phi ``(m·d, m)`` (row j·d + c is channel c of stream j);
        alpha: scalar tensor; bias ``(m,)``; fusion: ``"sigmoid"`` or ``"softmax"``.

    Returns:
        h ``(B, T, d)`` in the streams' dtype. Computed in fp32, or fp64 when any input is fp64
        (the RMSNorm here promotes instead of forcing fp32, so fp64 gradchecks hold).
    """
    if fusion not in FUSIONS:
        raise ValueError(f"mix: unknown fusion {fusion!r}; choices: {', '.join(FUSIONS)}")
    ct = torch.float32
    for t in (streams, phi, alpha, bias):
        ct = torch.promote_types(ct, t.dtype)
    with torch.autocast(device_type=streams.device.type, enabled=False):
        r = streams.to(ct)  # (m, B, T, d)
        flat = r.movedim(0, -2).flatten(-2)  # (B, T, m·d)
        normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        z = alpha.to(ct) * (normed @ phi.to(ct)) + bias.to(ct)  # (B, T, m)
        g = torch.sigmoid(z) if fusion == "sigmoid" else torch.softmax(z, dim=-1)
        h = torch.einsum("btm,mbtd->btd", g, r)
    return h.to(streams.dtype)


def msar(
    x: Tensor,
    taps: Sequence[Tensor],
    queries: Tensor,
    key_gains: Tensor | None,
    doc_ids: Tensor,
    phi: Tensor,
    alpha: Tensor,
    bias: Tensor,
    *,
    key_norm: bool = True,
    fusion: str = "sigmoid",
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The whole MSAR read: ``mix(msar_attn(...))``. Returns h ``(B, T, d)`` in x's dtype, and with
    ``return_weights`` the softmax weights ``(m, S, B, T)``. The streams stay in the compute dtype
    between the attention and the mixer."""
    ct = torch.promote_types(x.dtype, torch.float32)
    res = msar_attn(x.to(ct), [c.to(ct) for c in taps], queries.to(ct),
                    None if key_gains is None else key_gains.to(ct), doc_ids, key_norm=key_norm, eps=eps,
                    return_weights=return_weights)
    streams, weights = res if return_weights else (res, None)
    h = mix(streams, phi, alpha, bias, fusion=fusion, eps=eps).to(x.dtype)
    return (h, weights) if return_weights else h
