"""MSAR retrieval fused in Triton: conv views made on the fly inside the depth attention.

Same semantics as ``reference.py`` (SPEC §4). Everything below runs in Triton; PyTorch only packs
the taps, folds the gains into the queries and sums per-program partial gradients.

Forward, ``_msar_fwd_kernel``, one program per (view j, block of BLOCK_T tokens of row b), all d
channels: for every source s, build the view tile E_j(x_s) from k_j shifted, document-masked loads
of x, key RMSNorm per token, logit = (q_j ⊙ g_j) · key, online softmax over s (running max and sum,
fp32), out_j += w_s · E_j(x_s). Stores the streams (m, B, T, d) in x's dtype, the log-sum-exp of
the logits (m, B, T) fp32, and for 16-bit x an fp32 copy of the streams when a gradient is needed.
The (m, S, B, T, d) views never exist in memory.

Backward, three kernels:
- ``_msar_bwd_kernel`` (per view, chunk of tokens, row) recomputes E_j(x_s) and the weights
  w_s = exp(logit_s - lse) and writes
      dE_j(x_s) = w_s · dOut_j + dlogit_s · ∂logit_s/∂E,  dlogit_s = w_s (dOut_j · E_j(x_s) - dOut_j · out_j)
  (value path; key path through the softmax, the RMSNorm and the gain-folded query), plus partial
  sums of dL/d(q_j ⊙ g_j). dE (m, S, B, T, d) in x's dtype is transient and backward-only: it is the one
  large buffer of this op, freed when the backward returns.
- ``_conv_adjoint_kernel``: dx_s[t] = Σ_j Σ_τ c_τ^{(j)} ⊙ dE_j(x_s)[t+τ] · [same doc] (view 0: +dE_0).
- ``_tap_grad_kernel``: dc_τ^{(j)} = Σ_{s,b,t} dE_j(x_s)[t] ⊙ x_s[t-τ] · [same doc], partial per chunk.
Partial sums are reduced with ``torch.sum``: the result is deterministic (no atomics).

All math is fp32 whatever x's dtype (bf16 on the GPU). Inputs are made contiguous by the caller.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _view_tile(
    x_ptr,  # sources (S, B, T, d), contiguous
    taps_ptr,  # packed taps (m, K_MAX, d) fp32
    doc_row_ptr,  # doc ids of row b: (T,) int64
    doc_t,  # doc ids of this block's tokens (BLOCK_T,)
    offs_t, offs_d, mask_t, mask_d,
    j, k, s, b, B, T, D, K_MAX,
    K_LOOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """E_j(x_s)[t] = Σ_{τ<k} c_τ ⊙ x_s[t-τ] · [doc(t-τ) = doc(t)], zero left padding; fp32.

    The tap loop is unrolled to K_LOOP >= k with a runtime guard: Triton 3.6's interpreter cannot
    take a tensor as a ``range`` bound under NumPy 2.4, and unrolling lets the loads overlap."""
    row0 = (s * B + b).to(tl.int64) * T  # first token of (s, b) in the flattened (S·B·T) axis
    e = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for tau in tl.static_range(K_LOOP):
        if tau < k:
            src_t = offs_t - tau
            ok = mask_t & (src_t >= 0)
            doc_src = tl.load(doc_row_ptr + src_t, mask=ok, other=-1)
            ok = ok & (doc_src == doc_t)  # never read another document
            c = tl.load(taps_ptr + (j * K_MAX + tau) * D + offs_d, mask=mask_d, other=0.0)
            ptrs = x_ptr + (row0 + src_t)[:, None] * D + offs_d[None, :]
            xv = tl.load(ptrs, mask=ok[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            e += c[None, :] * xv
    return e


@triton.jit
def _msar_fwd_kernel(
    x_ptr,  # sources (S, B, T, d), contiguous, any float dtype
    taps_ptr,  # packed taps (m, K_MAX, d) fp32; view 0 is the Dirac [1, 0, ...]
    ks_ptr,  # kernel size of every view (m,) int32; view 0 has k = 1
    qg_ptr,  # gain-folded queries q_j ⊙ g_j (m, d) fp32
    doc_ptr,  # document ids (B, T) int64
    out_ptr,  # streams (m, B, T, d), x's dtype
    lse_ptr,  # log-sum-exp over sources of the logits (m, B, T) fp32
    logits_ptr,  # raw logits (m, S, B, T) fp32; written only when STORE_LOGITS
    out32_ptr,  # fp32 copy of the streams (m, B, T, d); written only when STORE_OUT32
    S, B, T, D, K_MAX, eps,
    KEY_NORM: tl.constexpr, STORE_LOGITS: tl.constexpr, STORE_OUT32: tl.constexpr,
    K_LOOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0)  # view: the fastest grid axis, so the m programs of a tile share x in L2
    tb = tl.program_id(1)
    b = tl.program_id(2)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    doc_t = tl.load(doc_row_ptr + offs_t, mask=mask_t, other=-1)
    k = tl.load(ks_ptr + j)
    qg = tl.load(qg_ptr + j * D + offs_d, mask=mask_d, other=0.0)

    # online softmax over sources, fp32 (AttnRes §3: the softmax is specified in fp32)
    m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    s = b * 0  # a while loop: see _view_tile about tensor range bounds under the interpreter
    while s < S:
        e = _view_tile(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, offs_d, mask_t, mask_d,
                       j, k, s, b, B, T, D, K_MAX, K_LOOP, BLOCK_T, BLOCK_D)
        logit = tl.sum(e * qg[None, :], axis=1)  # q·(g ⊙ n) = (q ⊙ g)·n
        if KEY_NORM:
            logit = logit * tl.rsqrt(tl.sum(e * e, axis=1) / D + eps)
        if STORE_LOGITS:
            tl.store(logits_ptr + ((j * S + s) * B + b).to(tl.int64) * T + offs_t, logit, mask=mask_t)
        m_new = tl.maximum(m_i, logit)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logit - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * e
        m_i = m_new
        s += 1
    out = acc / l_i[:, None]
    rows = (j * B + b).to(tl.int64) * T + offs_t  # (m, B, T) flat index
    tile = rows[:, None] * D + offs_d[None, :]
    mask = mask_t[:, None] & mask_d[None, :]
    tl.store(out_ptr + tile, out.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_OUT32:
        tl.store(out32_ptr + tile, out, mask=mask)
    tl.store(lse_ptr + rows, m_i + tl.log(l_i), mask=mask_t)


@triton.jit
def _msar_bwd_kernel(
    x_ptr,  # sources (S, B, T, d), contiguous
    taps_ptr,  # packed taps (m, K_MAX, d) fp32
    ks_ptr,  # kernel size of every view (m,) int32
    qg_ptr,  # gain-folded queries (m, d) fp32
    doc_ptr,  # document ids (B, T) int64
    out_ptr,  # forward streams in fp32 (m, B, T, d)
    dout_ptr,  # upstream gradient of the streams (m, B, T, d), contiguous
    lse_ptr,  # forward log-sum-exp (m, B, T) fp32
    de_ptr,  # result: dL/dE_j(x_s) (m, S, B, T, d), x's dtype (fp32 for fp32 x), transient
    dqg_ptr,  # result: per-program partial dL/d(q_j ⊙ g_j) (m, B, n_chunks, d) fp32
    S, B, T, D, K_MAX, eps, n_chunks, SUB,
    KEY_NORM: tl.constexpr, K_LOOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0)  # view
    chunk = tl.program_id(1)  # SUB consecutive blocks of BLOCK_T tokens
    b = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    k = tl.load(ks_ptr + j)
    qg = tl.load(qg_ptr + j * D + offs_d, mask=mask_d, other=0.0)

    dqg = tl.zeros((BLOCK_D,), dtype=tl.float32)
    i = b * 0  # while loops: see _view_tile about tensor range bounds under the interpreter
    while i < SUB:
        offs_t = (chunk * SUB + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        mask = mask_t[:, None] & mask_d[None, :]
        doc_t = tl.load(doc_row_ptr + offs_t, mask=mask_t, other=-1)
        rows = (j * B + b).to(tl.int64) * T + offs_t
        tile = rows[:, None] * D + offs_d[None, :]
        do = tl.load(dout_ptr + tile, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + tile, mask=mask, other=0.0)
        # dOut_j · out_j = Σ_s w_s (dOut_j · E_j(x_s)); from the fp32 output: with peaked weights the
        # softmax backward subtracts two nearly equal numbers, and a bf16 output would dominate it
        delta = tl.sum(do * o, axis=1)
        lse = tl.load(lse_ptr + rows, mask=mask_t, other=0.0)
        s = b * 0
        while s < S:
            e = _view_tile(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, offs_d, mask_t, mask_d,
                           j, k, s, b, B, T, D, K_MAX, K_LOOP, BLOCK_T, BLOCK_D)
            dot = tl.sum(e * qg[None, :], axis=1)
            if KEY_NORM:
                r = tl.rsqrt(tl.sum(e * e, axis=1) / D + eps)
                logit = dot * r
            else:
                logit = dot
            w = tl.exp(logit - lse)  # the forward weights, from the saved lse
            dlogit = w * (tl.sum(do * e, axis=1) - delta)  # softmax backward
            if KEY_NORM:
                # logit = qg·(e r), r = (mean e² + eps)^-½  =>  ∂logit/∂e = r (qg - logit · e r / d)
                n = e * r[:, None]
                dkey = (dlogit * r)[:, None] * (qg[None, :] - n * (logit / D)[:, None])
                dqg += tl.sum(dlogit[:, None] * n, axis=0)
            else:
                dkey = dlogit[:, None] * qg[None, :]
                dqg += tl.sum(dlogit[:, None] * e, axis=0)
            src_rows = ((j * S + s) * B + b).to(tl.int64) * T + offs_t
            tl.store(de_ptr + src_rows[:, None] * D + offs_d[None, :],
                     (w[:, None] * do + dkey).to(de_ptr.dtype.element_ty), mask=mask)
            s += 1
        i += 1
    part = (j * B + b).to(tl.int64) * n_chunks + chunk
    tl.store(dqg_ptr + part * D + offs_d, dqg, mask=mask_d)


@triton.jit
def _tap_grad_kernel(
    de_ptr,  # dL/dE_j(x_s) (m, S, B, T, d)
    x_ptr,  # sources (S, B, T, d), contiguous
    ks_ptr,  # kernel size of every view (m,) int32
    doc_ptr,  # document ids (B, T) int64
    dtaps_ptr,  # result: per-program partial dL/dc_τ^{(j)} (m-1, K_MAX, S·B, n_chunks, d) fp32
    S, B, T, D, K_MAX, n_chunks, SUB,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dc_τ^{(j)} = Σ_{s,b,t} dE_j(x_s)[t] ⊙ x_s[t-τ] · [doc(t-τ) = doc(t)], one (view, tap) per
    program. The (view, tap) pair is the fastest grid axis, so the programs that read the same
    chunk of dE and x run together and share it in L2."""
    jt = tl.program_id(0)  # (j - 1) · K_MAX + τ
    chunk = tl.program_id(1)
    sb = tl.program_id(2)  # s · B + b
    j = 1 + jt // K_MAX
    tau = jt % K_MAX
    k = tl.load(ks_ptr + j)
    if tau < k:
        b = sb % B
        s = sb // B
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        doc_row_ptr = doc_ptr + b.to(tl.int64) * T
        x_row0 = sb.to(tl.int64) * T
        de_row0 = (j * S * B + sb).to(tl.int64) * T
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        i = b * 0
        while i < SUB:
            offs_t = (chunk * SUB + i) * BLOCK_T + tl.arange(0, BLOCK_T)
            src_t = offs_t - tau
            ok = (offs_t < T) & (src_t >= 0)
            doc_t = tl.load(doc_row_ptr + offs_t, mask=ok, other=-1)
            doc_src = tl.load(doc_row_ptr + src_t, mask=ok, other=-2)
            ok = ok & (doc_src == doc_t)
            m2 = ok[:, None] & mask_d[None, :]
            dv = tl.load(de_ptr + (de_row0 + offs_t)[:, None] * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + (x_row0 + src_t)[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
            acc += dv * xv.to(tl.float32)
            i += 1
        part = (jt * S * B + sb).to(tl.int64) * n_chunks + chunk
        tl.store(dtaps_ptr + part * D + offs_d, tl.sum(acc, axis=0), mask=mask_d)


@triton.jit
def _conv_adjoint_kernel(
    de_ptr,  # dL/dE_j(x_s) (m, S, B, T, d)
    taps_ptr,  # packed taps (m, K_MAX, d) fp32; view 0 is the Dirac
    ks_ptr,  # kernel size of every view (m,) int32
    doc_ptr,  # document ids (B, T) int64
    dx_ptr,  # result: dL/dx (S, B, T, d), x's dtype
    m, S, B, T, D, K_MAX,
    K_LOOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dx_s[t] = Σ_j Σ_{τ<k_j} c_τ^{(j)} ⊙ dE_j(x_s)[t+τ] · [doc(t+τ) = doc(t)]: the adjoint of the
    causal conv reads the later tokens of the same document."""
    tb = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    doc_t = tl.load(doc_row_ptr + offs_t, mask=mask_t, other=-1)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    j = b * 0
    while j < m:
        k = tl.load(ks_ptr + j)
        row0 = ((j * S + s) * B + b).to(tl.int64) * T
        for tau in tl.static_range(K_LOOP):
            if tau < k:
                dst_t = offs_t + tau
                ok = mask_t & (dst_t < T)
                doc_dst = tl.load(doc_row_ptr + dst_t, mask=ok, other=-1)
                ok = ok & (doc_dst == doc_t)
                c = tl.load(taps_ptr + (j * K_MAX + tau) * D + offs_d, mask=mask_d, other=0.0)
                dv = tl.load(de_ptr + (row0 + dst_t)[:, None] * D + offs_d[None, :],
                             mask=ok[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
                acc += c[None, :] * dv
        j += 1
    rows = (s * B + b).to(tl.int64) * T + offs_t
    tl.store(dx_ptr + rows[:, None] * D + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


# --- launchers -----------------------------------------------------------------------------------
def _blocks(T: int, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps, SUB): token block, channel block, warps, and token blocks per
    backward program (more blocks per program, fewer partial sums of the query and tap gradients).

    GPU: 4 tokens per block (more for d < 512) and ~32 fp32 elements of a tile per thread; on an
    H200 this beat 2, 8, 16 and 32 tokens with 2, 4 or 8 warps at d = 512 and d = 1024 (forward
    and backward). Under the interpreter each program costs milliseconds: big blocks."""
    block_d = triton.next_power_of_2(d)
    if interpreting():
        return min(triton.next_power_of_2(T), 64), block_d, 4, 1
    block_t = min(triton.next_power_of_2(T), max(4, min(16, 2048 // block_d)))
    warps = max(1, min(8, block_t * block_d // 1024))
    return block_t, block_d, warps, 8


def _pack_taps(taps: Sequence[Tensor], d: int, device) -> tuple[Tensor, Tensor, int]:
    """All views' taps as one (m, K_MAX, d) fp32 tensor (view 0: the Dirac) and their sizes (m,)."""
    ks = [1, *(c.shape[0] for c in taps)]
    k_max = max(ks)
    packed = torch.zeros(len(ks), k_max, d, device=device, dtype=torch.float32)
    packed[0, 0] = 1.0
    for j, c in enumerate(taps, start=1):
        packed[j, : c.shape[0]] = c.detach().float()
    return packed, torch.tensor(ks, device=device, dtype=torch.int32), k_max


def _folded_queries(queries: Tensor, key_gains: Tensor | None) -> Tensor:
    q = queries.detach().float()
    return (q if key_gains is None else q * key_gains.detach().float()).contiguous()  # (m, d)


def msar_attn_fwd(x, packed, ks, k_max, qg, doc_ids, *, key_norm, eps, store_logits, need_out32=True):
    S, B, T, d = x.shape
    m = packed.shape[0]
    out = torch.empty(m, B, T, d, device=x.device, dtype=x.dtype)
    lse = torch.empty(m, B, T, device=x.device, dtype=torch.float32)
    logits = torch.empty(m, S, B, T, device=x.device, dtype=torch.float32) if store_logits else lse
    # the backward needs the streams in fp32 (see _msar_bwd_kernel): a separate copy for 16-bit x
    if x.dtype == torch.float32 or not need_out32:
        out32 = out
    else:
        out32 = torch.empty(out.shape, device=x.device, dtype=torch.float32)
    block_t, block_d, warps, _ = _blocks(T, d)
    grid = (m, triton.cdiv(T, block_t), B)
    _msar_fwd_kernel[grid](x, packed, ks, qg, doc_ids, out, lse, logits, out32, S, B, T, d, k_max, eps,
                           KEY_NORM=key_norm, STORE_LOGITS=store_logits, STORE_OUT32=out32 is not out,
                           K_LOOP=k_max,
                           BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    return out, out32, lse, (logits if store_logits else None)


def msar_attn_bwd(dout, x, taps, packed, ks, k_max, qg, doc_ids, out32, lse, *, key_norm, eps):
    """Gradients of (x, taps_j, q ⊙ g): dx (S, B, T, d) in x's dtype, [dtaps_j (k_j, d) fp32],
    dqg (m, d) fp32. ``out32``: the forward streams in fp32."""
    S, B, T, d = x.shape
    m = packed.shape[0]
    block_t, block_d, warps, sub = _blocks(T, d)
    n_chunks = triton.cdiv(triton.cdiv(T, block_t), sub)
    # transient, backward-only; in x's dtype like the gradient of unfused bf16 views (autograd's),
    # which halves the op's one large buffer; the sums that read it accumulate in fp32
    de = torch.empty(m, S, B, T, d, device=x.device, dtype=x.dtype)
    dqg_partial = torch.empty(m, B, n_chunks, d, device=x.device, dtype=torch.float32)
    _msar_bwd_kernel[(m, n_chunks, B)](
        x, packed, ks, qg, doc_ids, out32, dout, lse, de, dqg_partial,
        S, B, T, d, k_max, eps, n_chunks, sub,
        KEY_NORM=key_norm, K_LOOP=k_max, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    dx = torch.empty_like(x)
    _conv_adjoint_kernel[(triton.cdiv(T, block_t), B, S)](
        de, packed, ks, doc_ids, dx, m, S, B, T, d, k_max,
        K_LOOP=k_max, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    # 8x the backward chunk per tap-gradient program (256 tokens on the GPU): few partial sums,
    # still thousands of programs
    tap_sub = min(8 * sub, triton.cdiv(T, block_t))
    tap_chunks = triton.cdiv(triton.cdiv(T, block_t), tap_sub)
    dtaps_partial = torch.zeros(m - 1, k_max, S * B, tap_chunks, d, device=x.device, dtype=torch.float32)
    _tap_grad_kernel[((m - 1) * k_max, tap_chunks, S * B)](
        de, x, ks, doc_ids, dtaps_partial, S, B, T, d, k_max, tap_chunks, tap_sub,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    dqg = dqg_partial.sum((1, 2))
    dtaps_all = dtaps_partial.sum((2, 3))  # (m-1, K_MAX, d); rows τ >= k_j stay zero
    dtaps = [dtaps_all[j - 1, : c.shape[0]] for j, c in enumerate(taps, start=1)]
    return dx, dtaps, dqg


class MsarAttnFunction(torch.autograd.Function):
    """Autograd for the fused op. Inputs: x, queries, key_gains (or None), doc_ids, flags, *taps.
    Outputs: streams (differentiable), lse and logits (not differentiable: diagnostics only).
    ``need_grad``: keep an fp32 copy of 16-bit streams for the backward."""

    @staticmethod
    def forward(ctx, x, queries, key_gains, doc_ids, key_norm, eps, store_logits, need_grad, *taps):
        d = x.shape[-1]
        packed, ks, k_max = _pack_taps(taps, d, x.device)
        qg = _folded_queries(queries, key_gains)
        out, out32, lse, logits = msar_attn_fwd(x, packed, ks, k_max, qg, doc_ids,
                                                key_norm=key_norm, eps=eps, store_logits=store_logits,
                                                need_out32=need_grad)
        ctx.save_for_backward(x, queries, key_gains, doc_ids, out32, lse, *taps)
        ctx.key_norm, ctx.eps = key_norm, eps
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(lse, logits)
        return out, lse, logits

    @staticmethod
    def backward(ctx, dout, _dlse, _dlogits):
        x, queries, key_gains, doc_ids, out32, lse, *taps = ctx.saved_tensors
        d = x.shape[-1]
        packed, ks, k_max = _pack_taps(taps, d, x.device)
        qg = _folded_queries(queries, key_gains)
        with torch.autocast(device_type=x.device.type, enabled=False):
            dx, dtaps, dqg = msar_attn_bwd(dout.contiguous(), x, taps, packed, ks, k_max, qg, doc_ids,
                                           out32, lse, key_norm=ctx.key_norm, eps=ctx.eps)
            if key_gains is None:
                dq, dg = dqg, None
            else:
                dq = dqg * key_gains.float()  # qg = q ⊙ g
                dg = dqg * queries.float()
        grads_taps = [dc.to(c.dtype) for dc, c in zip(dtaps, taps)]
        return (dx, dq.to(queries.dtype), None if dg is None else dg.to(key_gains.dtype),
                None, None, None, None, None, *grads_taps)


@torch.compiler.disable  # under torch.compile: a graph break, the kernels run as they are
def msar_attn(x: Tensor, taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None,
              doc_ids: Tensor, *, key_norm: bool = True, eps: float = 1e-6,
              return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The fused op; inputs already validated by ``kernels.msar_attn.msar_attn``. Weights are
    returned detached (they are diagnostics; no gradient flows through them)."""
    x = x.contiguous()
    taps = [c.contiguous() for c in taps]
    queries = queries.contiguous()
    key_gains = None if key_gains is None else key_gains.contiguous()
    doc_ids = doc_ids.to(torch.int64).contiguous()
    # (Function.forward runs with grad mode off: decide here whether a backward can follow)
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, queries, key_gains, *taps))
    out, lse, logits = MsarAttnFunction.apply(x, queries, key_gains, doc_ids, bool(key_norm), float(eps),
                                              bool(return_weights), need_grad, *taps)
    if not return_weights:
        return out
    return out, torch.exp(logits - lse[:, None])  # (m, S, B, T) fp32
