"""MSAR retrieval, the specification (SPEC §4): conv views of the sources, then depth attention.

For views j = 0..m-1 (view 0 the identity, view j >= 1 a causal depthwise conv with taps
``taps[j-1]`` of shape ``(k_j, d)``, reset at document boundaries):

    E_j(x_s)[t] = Σ_{τ<k_j} c_τ^{(j)} ⊙ x_s[t-τ] · [doc(t-τ) = doc(t)]
    out_j       = Σ_s softmax_s( (q_j ⊙ g_j) · RMSNorm(E_j(x_s)) ) · E_j(x_s)

This file is the composition of the two public references (``kernels.causal_conv`` and
``kernels.depth_attn`` with ``backend="torch"``), not a copy of them: the fused kernel is tested
against exactly what ``residuals/msar.py`` computes unfused. It materialises the (m, S, B, T, d)
views; the fused kernel never does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.causal_conv import causal_conv
from kernels.depth_attn import depth_attn


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
