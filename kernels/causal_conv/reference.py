"""Causal depthwise convolution along the token axis, reset at document boundaries (docs/method.md §4).

    y[t] = Σ_{τ<k} c_τ ⊙ x[t-τ]

with per-channel taps ``c`` of shape ``(k, d)``, left zero-padded; in a packed batch ``x[t-τ]``
contributes only when ``doc_ids[t-τ] == doc_ids[t]``, so no token reads another document or a later
token. Plain PyTorch, fp32 math (fp64 when given fp64), output in ``x``'s dtype. Vectorised over
tokens; the loop is over the k taps only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv(x: Tensor, taps: Tensor, doc_ids: Tensor | None = None) -> Tensor:
    """Causal depthwise conv.

    Args:
        x: ``(..., T, d)``, e.g. ``(B, T, d)`` or a stack of sources ``(S, B, T, d)``.
        taps: ``(k, d)``; ``taps[τ]`` multiplies the token τ steps back.
        doc_ids: document id of every token, broadcastable to ``x.shape[:-1]`` (e.g. ``(B, T)``);
            ``None``: one document per row.

    Returns:
        ``y`` with ``x``'s shape and dtype.
    """
    if taps.dim() != 2 or taps.shape[-1] != x.shape[-1]:
        raise ValueError(f"causal_conv: taps must be (k, d) with d={x.shape[-1]}, got {tuple(taps.shape)}")
    ct = torch.float64 if torch.float64 in (x.dtype, taps.dtype) else torch.float32
    xf, c = x.to(ct), taps.to(ct)
    T = x.shape[-2]
    y = xf * c[0]
    for tau in range(1, min(taps.shape[0], T)):
        shifted = F.pad(xf[..., :-tau, :], (0, 0, tau, 0))  # x[t-τ], zero for t < τ
        if doc_ids is not None:
            same_doc = doc_ids[..., tau:] == doc_ids[..., :-tau]  # (..., T-τ): x[t-τ] is in t's document
            shifted = shifted * F.pad(same_doc, (tau, 0), value=False).unsqueeze(-1).to(ct)
        y = y + c[tau] * shifted
    return y.to(x.dtype)
