"""mHC coefficients, read and write, the specification (mHC, arXiv 2512.24880, Eq. 3 and 7-9; docs/method.md §2).

Per token, with the n streams X ∈ R^{n×d} flattened to x = vec(X) ∈ R^{nd}:

    x' = RMSNorm(x) (over all nd, optional gain),   z = x' φ ∈ R^{n²+2n}   (φ columns: pre | post | res)
    H^pre  = σ(α_pre · z_pre + b_pre)                       (n,)
    H^post = 2σ(α_post · z_post + b_post)                   (n,)
    H^res  = Sinkhorn-Knopp(α_res · mat(z_res) + b_res)     (n, n), log domain, columns then rows
    read:  h  = H^pre X = Σ_i H^pre_i X_i                   (d,)
    write: X' = H^res X + H^postᵀ f                         (n, d)

The coefficients, the read and the mixing run in fp32 with autocast off (fp64 when the streams are
fp64, so that gradcheck means something); h and X' are returned in the streams' dtype. This is what
``residuals/mhc.py`` computes with ``backend="torch"``; ``fused.py`` computes the same in Triton.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp on exp(logits) over the last two axes, in the log domain (paper Eq. 9).

    Each iteration normalises the columns, then the rows (M^(t) = T_r(T_c(M^(t-1)))), so the rows sum
    to 1 up to rounding and the columns to within the convergence error. The log domain never
    overflows, whatever the logits. Call it in fp32 (or fp64).
    """
    log_m = logits
    for _ in range(iters):
        log_m = log_m - torch.logsumexp(log_m, dim=-2, keepdim=True)  # T_c: columns sum to 1
        log_m = log_m - torch.logsumexp(log_m, dim=-1, keepdim=True)  # T_r: rows sum to 1
    return log_m.exp()


def mhc_coefficients(
    streams: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    *,
    sinkhorn_iters: int,
    norm_gain: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """The mHC coefficients of every token (paper Eq. 7-8), fp32 (fp64 for fp64 streams), autocast off.

    streams (..., n, d); phi (nd, n²+2n), columns [pre | post | res, row-major]; alpha (3,) as
    [pre, post, res]; b_pre, b_post (n,); b_res (n, n); norm_gain (nd,) or None.
    Returns H^pre (..., n), H^post (..., n), H^res (..., n, n).
    """
    n, d = streams.shape[-2:]
    ct = compute_dtype(streams)
    with torch.autocast(device_type=streams.device.type, enabled=False):
        x = streams.reshape(*streams.shape[:-2], n * d).to(ct)  # vec(X_l): (..., nd)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # RMSNorm over all nd
        if norm_gain is not None:
            x = x * norm_gain.to(ct)
        z = x @ phi.to(ct)  # (..., n² + 2n)
        a = alpha.to(ct)
        h_pre = torch.sigmoid(a[0] * z[..., :n] + b_pre.to(ct))
        h_post = 2.0 * torch.sigmoid(a[1] * z[..., n:2 * n] + b_post.to(ct))
        res_logits = a[2] * z[..., 2 * n:].unflatten(-1, (n, n)) + b_res.to(ct)
        if torch.is_grad_enabled() and res_logits.requires_grad:
            # Recompute the iterations in backward rather than keep 2·iters (…, n, n) intermediates
            # per token and sublayer (~20% of the streams' own memory at n = 4; paper §4.3.2).
            h_res = checkpoint(sinkhorn, res_logits, sinkhorn_iters, use_reentrant=False)
        else:
            h_res = sinkhorn(res_logits, sinkhorn_iters)
    return h_pre, h_post, h_res


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Coefficients and the read of one sublayer: (h, H^pre, H^post, H^res).

    x (..., n, d) streams; h (..., d) in x's dtype; the coefficients in fp32 (fp64 for fp64 x).
    """
    h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=sinkhorn_iters,
                                            norm_gain=norm_gain, eps=eps)
    with torch.autocast(device_type=x.device.type, enabled=False):
        h = torch.matmul(h_pre.unsqueeze(-2), x.to(h_pre.dtype)).squeeze(-2)  # H^pre X: (..., d)
    return h.to(x.dtype), h_pre, h_post, h_res


def mhc_post(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """The write: X' = H^res X + H^postᵀ f, mixed in the coefficients' dtype, returned in x's dtype.

    x (..., n, d) streams; out (..., d) the sublayer output f; h_post (..., n); h_res (..., n, n).
    Mixing in fp32: H^res's rows sum to 1, and bf16 coefficients would let the streams drift.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        mixed = torch.matmul(h_res, x.to(h_res.dtype))  # H^res X: (..., n, d)
        new = mixed + h_post.unsqueeze(-1) * out.to(h_post.dtype).unsqueeze(-2)  # + H^postᵀ f
    return new.to(x.dtype)
