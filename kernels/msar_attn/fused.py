"""MSAR fused in Triton: conv views, key RMSNorm, online softmax over sources and the H^pre mixer.

Same semantics as ``reference.py`` (SPEC §4). PyTorch only packs the taps, folds the key gains
into the queries, and sums per-program partial gradients (deterministic: no atomics).

Data flow of the forward, ``_fwd_kernel``: one program per (block of BT tokens, row b), all m views
at once. Per source s and channel tile, the program loads the K_MAX shifted, document-masked tiles
x_s[t-τ] (BT tokens plus a halo of K_MAX-1 earlier ones; the halo comes from L1/L2, so HBM sees
each source tile once) and accumulates all m views in one (m, BT, BD) register tile; the view
taps are packed (m, K_MAX, d) with zero rows past k_j (view 0 is the Dirac). Then, per view: key
RMSNorm (gain folded into the query), logit, online softmax over sources (fp32), weighted sum.

- d fits one channel tile (``SINGLE``): one pass over the sources; the streams R (m, BT, d) stay
  in registers and the mixer runs in the epilogue: ‖R‖², R·φ, z = α·ρ_R·(R·φ) + b, g = σ(z) (or
  softmax over m), h = Σ_j g_j r^{(j)}. Only h (B, T, d) and lse (m, B, T) are written.
- d larger than a tile: pass 1 over (source, channel tile) for the logits (their d-reductions:
  q·E and ‖E‖²; written to a (m, S, B, T) fp32 buffer, 4·m·S bytes a token) and the lse;
  pass 2 per channel tile recomputes the views and weighted sums for ‖R‖² and R·φ; pass 3
  recomputes them once more and writes h. Recomputing costs S·d reads (mostly L2 hits) and the
  conv arithmetic; storing R would cost 2·m·d·4 bytes a token of HBM traffic instead.

``WRITE_R`` makes the same kernel write the streams R (m, B, T, d) fp32 instead of h: the public
``msar_attn`` (streams only) and the backward's recomputation.

Backward (``MsarFunction.backward``): recompute R (``WRITE_R``); the mixer's backward on R gives
dR, dφ, dα, db (PyTorch, fp32, (m, B, T, d)-sized); then per source s (so the transient is
(m, B, T, d), never (m, S, B, T, d)):
- ``_de_kernel``: pass 1 over channel tiles: q·E, ‖E‖², dR·E per (view, token); then
  w = exp(logit - lse), dlogit = w (dR·E - dR·R), and pass 2 writes
  dE_j(x_s) = w dR_j + κ qg_j - μ E_j(x_s), κ = dlogit ρ, μ = dlogit · logit · ρ² / d (ρ the key
  RMS reciprocal), and the partial sums of dL/d(q ⊙ g) = Σ κ E.
- ``_dx_kernel``: dx_s[t] = Σ_j Σ_τ c_τ^{(j)} ⊙ dE_j(x_s)[t+τ] · [same doc] (the conv adjoint).
- ``_dtap_kernel``: dc_τ^{(j)} += Σ_{b,t} dE_j(x_s)[t] ⊙ x_s[t-τ] · [same doc], partial per chunk.

All math is fp32 whatever x's dtype (bf16 on the GPU).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _views(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d, row0, D, K_MAX,
           M_PAD: tl.constexpr, K_LOOP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """All m views of one source tile: E (M_PAD, BT, BD) fp32,
    E[j, t] = Σ_{τ<K_MAX} c_τ^{(j)} ⊙ x[t-τ] · [doc(t-τ) = doc(t)] (taps zero past k_j)."""
    jv = tl.arange(0, M_PAD)
    e = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    for tau in tl.static_range(K_LOOP):
        src_t = offs_t - tau
        ok = mask_t & (src_t >= 0)
        doc_src = tl.load(doc_row_ptr + src_t, mask=ok, other=-1)
        ok = ok & (doc_src == doc_t)  # never read another document
        xv = tl.load(x_ptr + (row0 + src_t)[:, None] * D + offs_d[None, :],
                     mask=ok[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # (BT, BD)
        c = tl.load(taps_ptr + (jv[:, None] * K_MAX + tau) * D + offs_d[None, :],
                    mask=mask_d[None, :], other=0.0)  # (M_PAD, BD)
        e += c[:, None, :] * xv[None, :, :]
    return e


@triton.jit
def _weighted(x_ptr, taps_ptr, logits_ptr, lse, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d,
              b, S, B, T, D, K_MAX,
              M_PAD: tl.constexpr, K_LOOP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Streams of one channel tile from stored logits: R[j, t] = Σ_s exp(logit - lse) E_j(x_s)[t]."""
    jv = tl.arange(0, M_PAD)
    acc = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    s = b * 0  # while loops: Triton 3.6's interpreter cannot take a tensor as a range bound
    while s < S:
        row0 = (s * B + b).to(tl.int64) * T
        e = _views(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d, row0, D, K_MAX,
                   M_PAD, K_LOOP, BT, BD)
        lg = tl.load(logits_ptr + ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :],
                     mask=mask_t[None, :], other=0.0)
        acc += tl.exp(lg - lse)[:, :, None] * e
        s += 1
    return acc


@triton.jit
def _gate(z, rr, alpha, bias, mask_j, M, D, eps, SIGMOID: tl.constexpr):
    """g (M_PAD, BT) from z = R·φ (M_PAD, BT) and ‖R‖² (BT,): σ or softmax of α·ρ_R·z + b."""
    rho = tl.rsqrt(rr / (M * D) + eps)
    zz = alpha * z * rho[None, :] + bias[:, None]
    if SIGMOID:
        g = 1.0 / (1.0 + tl.exp(-zz))
    else:
        zz = tl.where(mask_j[:, None], zz, float("-inf"))
        p = tl.exp(zz - tl.max(zz, axis=0)[None, :])
        g = p / tl.sum(p, axis=0)[None, :]
    return tl.where(mask_j[:, None], g, 0.0)


@triton.jit
def _mixer_stats(r, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD: tl.constexpr, BT: tl.constexpr):
    """Partial ‖R‖² (BT,) and R·φ (M_PAD, BT) of one channel tile of the streams r (M_PAD, BT, BD)."""
    jv = tl.arange(0, M_PAD)
    rr = tl.sum(tl.sum(r * r, axis=2), axis=0)
    z = tl.zeros((M_PAD, BT), dtype=tl.float32)
    for i in tl.static_range(M_PAD):
        ph = tl.load(phi_ptr + (jv[:, None] * D + offs_d[None, :]) * M + i,
                     mask=mask_j[:, None] & mask_d[None, :] & (i < M), other=0.0)  # φ[j·d + c, i]
        val = tl.sum(tl.sum(r * ph[:, None, :], axis=2), axis=0)  # (BT,)
        z = tl.where(jv[:, None] == i, val[None, :], z)
    return rr, z


@triton.jit
def _fwd_kernel(
    x_ptr,  # sources (S, B, T, d), contiguous, any float dtype
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32, zero past k_j and for padded views; view 0 Dirac
    qg_ptr,  # gain-folded queries q_j ⊙ g_j (m, d) fp32
    phi_ptr,  # mixer projection φ (m·d, m) fp32
    alpha_ptr,  # mixer scale α (1,) fp32
    bias_ptr,  # mixer bias b (m,) fp32
    doc_ptr,  # document ids (B, T) int64
    out_ptr,  # h (B, T, d) in x's dtype, or with WRITE_R the streams R (m, B, T, d) fp32
    lse_ptr,  # log-sum-exp over sources of the logits (m, B, T) fp32
    logits_ptr,  # logits (m, S, B, T) fp32: written when STORE_LOGITS or not SINGLE
    S, B, T, D, M, K_MAX, eps, n_dt,
    KEY_NORM: tl.constexpr, SIGMOID: tl.constexpr, WRITE_R: tl.constexpr, STORE_LOGITS: tl.constexpr,
    SINGLE: tl.constexpr, M_PAD: tl.constexpr, K_LOOP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    tb = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tb * BT + tl.arange(0, BT)
    mask_t = offs_t < T
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    doc_t = tl.load(doc_row_ptr + offs_t, mask=mask_t, other=-1)
    stat = (jv[:, None] * B + b).to(tl.int64) * T + offs_t[None, :]  # (M_PAD, BT) index into (m, B, T)
    stat_mask = mask_j[:, None] & mask_t[None, :]
    alpha = tl.load(alpha_ptr)  # (with WRITE_R these point at a dummy buffer, unused)
    bias = tl.load(bias_ptr + jv, mask=mask_j, other=0.0)

    m_i = tl.full((M_PAD, BT), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((M_PAD, BT), dtype=tl.float32)
    if SINGLE:
        # one pass: logits, online softmax and weighted sums together; R stays in registers
        offs_d = tl.arange(0, BD)
        mask_d = offs_d < D
        qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=mask_j[:, None] & mask_d[None, :], other=0.0)
        acc = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
        s = b * 0
        while s < S:
            row0 = (s * B + b).to(tl.int64) * T
            e = _views(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d, row0, D, K_MAX,
                       M_PAD, K_LOOP, BT, BD)
            logit = tl.sum(e * qg[:, None, :], axis=2)  # (M_PAD, BT): (q ⊙ g)·E
            if KEY_NORM:
                logit = logit * tl.rsqrt(tl.sum(e * e, axis=2) / D + eps)
            if STORE_LOGITS:
                tl.store(logits_ptr + ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :],
                         logit, mask=stat_mask)
            m_new = tl.maximum(m_i, logit)
            scale = tl.exp(m_i - m_new)
            p = tl.exp(logit - m_new)
            l_i = l_i * scale + p
            acc = acc * scale[:, :, None] + p[:, :, None] * e
            m_i = m_new
            s += 1
        lse = m_i + tl.log(l_i)
        tl.store(lse_ptr + stat, lse, mask=stat_mask)
        r = acc / l_i[:, :, None]  # (M_PAD, BT, BD)
        if WRITE_R:
            tl.store(out_ptr + stat[:, :, None] * D + offs_d[None, None, :], r,
                     mask=stat_mask[:, :, None] & mask_d[None, None, :])
        else:
            rr, z = _mixer_stats(r, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD, BT)
            g = _gate(z, rr, alpha, bias, mask_j, M, D, eps, SIGMOID)
            h = tl.sum(g[:, :, None] * r, axis=0)  # (BT, BD)
            rows = (b * T + offs_t).to(tl.int64)
            tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], h.to(out_ptr.dtype.element_ty),
                     mask=mask_t[:, None] & mask_d[None, :])
    else:
        # pass 1: logits (reductions over all channel tiles) and their log-sum-exp over sources
        s = b * 0
        while s < S:
            row0 = (s * B + b).to(tl.int64) * T
            dot = tl.zeros((M_PAD, BT), dtype=tl.float32)
            ss = tl.zeros((M_PAD, BT), dtype=tl.float32)
            dt = b * 0
            while dt < n_dt:
                offs_d = dt * BD + tl.arange(0, BD)
                mask_d = offs_d < D
                qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=mask_j[:, None] & mask_d[None, :],
                             other=0.0)
                e = _views(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d, row0, D, K_MAX,
                           M_PAD, K_LOOP, BT, BD)
                dot += tl.sum(e * qg[:, None, :], axis=2)
                ss += tl.sum(e * e, axis=2)
                dt += 1
            logit = dot
            if KEY_NORM:
                logit = dot * tl.rsqrt(ss / D + eps)
            tl.store(logits_ptr + ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :],
                     logit, mask=mask_t[None, :])  # padded views too: pass 2 reads them back
            m_new = tl.maximum(m_i, logit)
            l_i = l_i * tl.exp(m_i - m_new) + tl.exp(logit - m_new)
            m_i = m_new
            s += 1
        lse = m_i + tl.log(l_i)
        tl.store(lse_ptr + stat, lse, mask=stat_mask)
        tl.debug_barrier()  # the logits written above are read back below by other threads
        if WRITE_R:
            dt = b * 0
            while dt < n_dt:
                offs_d = dt * BD + tl.arange(0, BD)
                mask_d = offs_d < D
                r = _weighted(x_ptr, taps_ptr, logits_ptr, lse, doc_row_ptr, doc_t, offs_t, mask_t, offs_d,
                              mask_d, b, S, B, T, D, K_MAX, M_PAD, K_LOOP, BT, BD)
                tl.store(out_ptr + stat[:, :, None] * D + offs_d[None, None, :], r,
                         mask=stat_mask[:, :, None] & mask_d[None, None, :])
                dt += 1
        else:
            # pass 2: the mixer's reductions over all of vec R
            rr = tl.zeros((BT,), dtype=tl.float32)
            z = tl.zeros((M_PAD, BT), dtype=tl.float32)
            dt = b * 0
            while dt < n_dt:
                offs_d = dt * BD + tl.arange(0, BD)
                mask_d = offs_d < D
                r = _weighted(x_ptr, taps_ptr, logits_ptr, lse, doc_row_ptr, doc_t, offs_t, mask_t, offs_d,
                              mask_d, b, S, B, T, D, K_MAX, M_PAD, K_LOOP, BT, BD)
                rr_part, z_part = _mixer_stats(r, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD, BT)
                rr += rr_part
                z += z_part
                dt += 1
            g = _gate(z, rr, alpha, bias, mask_j, M, D, eps, SIGMOID)
            # pass 3: recompute the streams tile by tile and write h
            rows = (b * T + offs_t).to(tl.int64)
            dt = b * 0
            while dt < n_dt:
                offs_d = dt * BD + tl.arange(0, BD)
                mask_d = offs_d < D
                r = _weighted(x_ptr, taps_ptr, logits_ptr, lse, doc_row_ptr, doc_t, offs_t, mask_t, offs_d,
                              mask_d, b, S, B, T, D, K_MAX, M_PAD, K_LOOP, BT, BD)
                h = tl.sum(g[:, :, None] * r, axis=0)
                tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], h.to(out_ptr.dtype.element_ty),
                         mask=mask_t[:, None] & mask_d[None, :])
                dt += 1


@triton.jit
def _de_kernel(
    x_ptr,  # sources (S, B, T, d)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    qg_ptr,  # gain-folded queries (m, d) fp32
    doc_ptr,  # document ids (B, T) int64
    dr_ptr,  # dL/dR (m, B, T, d) fp32
    delta_ptr,  # dR_j · R_j (m, B, T) fp32
    lse_ptr,  # log-sum-exp of the logits (m, B, T) fp32
    de_ptr,  # result: dL/dE_j(x_s) (m, B, T, d) fp32 for this source
    dqg_ptr,  # per-program partial dL/d(q ⊙ g) (n_tb·B, M_PAD, d) fp32, accumulated over sources
    s, B, T, D, M, K_MAX, eps, n_dt,
    KEY_NORM: tl.constexpr, M_PAD: tl.constexpr, K_LOOP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    tb = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tb * BT + tl.arange(0, BT)
    mask_t = offs_t < T
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    doc_t = tl.load(doc_row_ptr + offs_t, mask=mask_t, other=-1)
    stat = (jv[:, None] * B + b).to(tl.int64) * T + offs_t[None, :]
    stat_mask = mask_j[:, None] & mask_t[None, :]
    row0 = (s * B + b).to(tl.int64) * T

    # pass 1: per (view, token) reductions over all channels
    dot_q = tl.zeros((M_PAD, BT), dtype=tl.float32)
    ss = tl.zeros((M_PAD, BT), dtype=tl.float32)
    dot_r = tl.zeros((M_PAD, BT), dtype=tl.float32)
    dt = b * 0
    while dt < n_dt:
        offs_d = dt * BD + tl.arange(0, BD)
        mask_d = offs_d < D
        m2 = mask_j[:, None] & mask_d[None, :]
        qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        e = _views(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d, row0, D, K_MAX,
                   M_PAD, K_LOOP, BT, BD)
        dr = tl.load(dr_ptr + stat[:, :, None] * D + offs_d[None, None, :],
                     mask=stat_mask[:, :, None] & mask_d[None, None, :], other=0.0)
        dot_q += tl.sum(e * qg[:, None, :], axis=2)
        ss += tl.sum(e * e, axis=2)
        dot_r += tl.sum(e * dr, axis=2)
        dt += 1
    lse = tl.load(lse_ptr + stat, mask=stat_mask, other=0.0)
    delta = tl.load(delta_ptr + stat, mask=stat_mask, other=0.0)
    if KEY_NORM:
        rho = tl.rsqrt(ss / D + eps)
        logit = dot_q * rho
    else:
        logit = dot_q
    w = tl.where(stat_mask, tl.exp(logit - lse), 0.0)
    dlogit = w * (dot_r - delta)  # softmax backward: dR·E - Σ_s w dR·E
    if KEY_NORM:
        # logit = qg·E ρ, ρ = (‖E‖²/d + eps)^-½  =>  ∂logit/∂E = ρ qg - logit ρ² E / d
        kappa = dlogit * rho
        mu = kappa * rho * logit / D
    else:
        kappa = dlogit
        mu = tl.zeros((M_PAD, BT), dtype=tl.float32)

    # pass 2: dE = w dR + κ qg - μ E, and Σ_t κ E for the query gradient
    part = ((tb * B + b).to(tl.int64) * M_PAD + jv[:, None]) * D  # (M_PAD, 1)
    dt = b * 0
    while dt < n_dt:
        offs_d = dt * BD + tl.arange(0, BD)
        mask_d = offs_d < D
        m2 = mask_j[:, None] & mask_d[None, :]
        m3 = stat_mask[:, :, None] & mask_d[None, None, :]
        qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        e = _views(x_ptr, taps_ptr, doc_row_ptr, doc_t, offs_t, mask_t, offs_d, mask_d, row0, D, K_MAX,
                   M_PAD, K_LOOP, BT, BD)
        tile = stat[:, :, None] * D + offs_d[None, None, :]
        dr = tl.load(dr_ptr + tile, mask=m3, other=0.0)
        de = w[:, :, None] * dr + kappa[:, :, None] * qg[:, None, :] - mu[:, :, None] * e
        tl.store(de_ptr + tile, de, mask=m3)
        dq_ptrs = dqg_ptr + part + offs_d[None, :]
        dq = tl.load(dq_ptrs, mask=m2, other=0.0) + tl.sum(kappa[:, :, None] * e, axis=1)
        tl.store(dq_ptrs, dq, mask=m2)
        dt += 1


@triton.jit
def _dx_kernel(
    de_ptr,  # dL/dE_j(x_s) (m, B, T, d) fp32
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    doc_ptr,  # document ids (B, T) int64
    dx_ptr,  # result: dL/dx_s (B, T, d), x's dtype
    B, T, D, M, K_MAX,
    M_PAD: tl.constexpr, K_LOOP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """dx_s[t] = Σ_j Σ_τ c_τ^{(j)} ⊙ dE_j(x_s)[t+τ] · [doc(t+τ) = doc(t)]: the adjoint of the
    causal conv reads the later tokens of the same document."""
    tb = tl.program_id(0)
    b = tl.program_id(1)
    dt = tl.program_id(2)
    offs_t = tb * BT + tl.arange(0, BT)
    offs_d = dt * BD + tl.arange(0, BD)
    mask_t = offs_t < T
    mask_d = offs_d < D
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    doc_t = tl.load(doc_row_ptr + offs_t, mask=mask_t, other=-1)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for tau in tl.static_range(K_LOOP):
        dst_t = offs_t + tau
        ok = mask_t & (dst_t < T)
        doc_dst = tl.load(doc_row_ptr + dst_t, mask=ok, other=-1)
        ok = ok & (doc_dst == doc_t)
        c = tl.load(taps_ptr + (jv[:, None] * K_MAX + tau) * D + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        rows = (jv[:, None] * B + b).to(tl.int64) * T + dst_t[None, :]  # (M_PAD, BT)
        dv = tl.load(de_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                     mask=(mask_j[:, None] & ok[None, :])[:, :, None] & mask_d[None, None, :], other=0.0)
        acc += tl.sum(c[:, None, :] * dv, axis=0)
    rows = (b * T + offs_t).to(tl.int64)
    tl.store(dx_ptr + rows[:, None] * D + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _dtap_kernel(
    de_ptr,  # dL/dE_j(x_s) (m, B, T, d) fp32
    x_ptr,  # source s (B, T, d)
    doc_ptr,  # document ids (B, T) int64
    dtaps_ptr,  # per-program partial dL/dc (K_MAX, n_chunks·B, M_PAD, d) fp32, accumulated over sources
    B, T, D, M, n_chunks, SUB,
    M_PAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """dc_τ^{(j)} += Σ_t dE_j(x_s)[t] ⊙ x_s[t-τ] · [doc(t-τ) = doc(t)] over SUB token blocks.
    τ is the fastest grid axis: the programs reading the same chunk run together and share it in L2."""
    tau = tl.program_id(0)
    chunk = tl.program_id(1)
    bd = tl.program_id(2)
    n_dt = tl.cdiv(D, BD)
    b = bd // n_dt
    dt = bd % n_dt
    offs_d = dt * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    doc_row_ptr = doc_ptr + b.to(tl.int64) * T
    acc = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    i = b * 0
    while i < SUB:
        offs_t = (chunk * SUB + i) * BT + tl.arange(0, BT)
        src_t = offs_t - tau
        ok = (offs_t < T) & (src_t >= 0)
        doc_t = tl.load(doc_row_ptr + offs_t, mask=ok, other=-1)
        doc_src = tl.load(doc_row_ptr + src_t, mask=ok, other=-2)
        ok = ok & (doc_src == doc_t)
        xv = tl.load(x_ptr + (b.to(tl.int64) * T + src_t)[:, None] * D + offs_d[None, :],
                     mask=ok[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        rows = (jv[:, None] * B + b).to(tl.int64) * T + offs_t[None, :]
        dv = tl.load(de_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                     mask=(mask_j[:, None] & ok[None, :])[:, :, None] & mask_d[None, None, :], other=0.0)
        acc += dv * xv[None, :, :]
        i += 1
    part = ((tau * n_chunks + chunk) * B + b).to(tl.int64) * M_PAD
    ptrs = dtaps_ptr + (part + jv[:, None]) * D + offs_d[None, :]
    m2 = mask_j[:, None] & mask_d[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=m2, other=0.0) + tl.sum(acc, axis=1), mask=m2)


# --- launchers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Blocks:
    bt: int  # tokens per program
    bd: int  # channels per tile
    single: bool  # d fits one tile: the one-pass forward
    warps: int
    sub: int  # token blocks per tap-gradient program


def _blocks(T: int, d: int, m_pad: int) -> Blocks:
    """Tile sizes. GPU: about 8192 fp32 elements of the (m, BT, BD) view tile per program
    (32 per thread at 8 warps, plus as many for the accumulator), channels in one tile up to
    8192 / m_pad, so d ≤ 2048 at m = 4 runs the one-pass forward. Under the interpreter each
    program costs milliseconds: big blocks."""
    if interpreting():
        bd = triton.next_power_of_2(d) if d <= 1024 else 512
        return Blocks(min(triton.next_power_of_2(T), 16), bd, bd >= d, 4, 4)
    elems = 8192
    bd_full = triton.next_power_of_2(d)
    if m_pad * bd_full <= elems:
        bd = bd_full
    else:
        bd = max(64, elems // (m_pad * 4))  # 4 tokens per block at least
    bt = max(1, min(triton.next_power_of_2(T), elems // (m_pad * bd), 16))
    return Blocks(bt, bd, bd >= d, 8 if m_pad * bt * bd >= 4096 else 4, 16)


def pack_taps(taps: Sequence[Tensor], d: int, device) -> tuple[Tensor, int, int]:
    """All views' taps as one (M_PAD, K_MAX, d) fp32 tensor (view 0 the Dirac, zero rows past k_j
    and for padded views), K_MAX and M_PAD."""
    ks = [1, *(c.shape[0] for c in taps)]
    k_max, m_pad = max(ks), triton.next_power_of_2(len(ks))
    packed = torch.zeros(m_pad, k_max, d, device=device, dtype=torch.float32)
    packed[0, 0] = 1.0
    for j, c in enumerate(taps, start=1):
        packed[j, : c.shape[0]] = c.detach().float()
    return packed, k_max, m_pad


def folded_queries(queries: Tensor, key_gains: Tensor | None) -> Tensor:
    q = queries.detach().float()
    return (q if key_gains is None else q * key_gains.detach().float()).contiguous()  # (m, d)


def forward(x, packed, k_max, m, qg, doc_ids, *, key_norm, eps, phi=None, alpha=None, bias=None,
            sigmoid=True, write_r=False, store_logits=False, blocks=None):
    """h (B, T, d) in x's dtype (or with ``write_r`` R (m, B, T, d) fp32), lse (m, B, T) fp32, and
    the logits (m, S, B, T) fp32 when ``store_logits`` (else None)."""
    S, B, T, d = x.shape
    m_pad = packed.shape[0]
    blk = blocks or _blocks(T, d, m_pad)
    out = (torch.empty(m, B, T, d, device=x.device, dtype=torch.float32) if write_r
           else torch.empty(B, T, d, device=x.device, dtype=x.dtype))
    lse = torch.empty(m, B, T, device=x.device, dtype=torch.float32)
    need_logits = store_logits or not blk.single
    logits = torch.empty(m_pad if not blk.single else m, S, B, T, device=x.device, dtype=torch.float32) \
        if need_logits else lse
    if write_r:
        phi = alpha = bias = lse  # unused by the kernel
    grid = (triton.cdiv(T, blk.bt), B)
    _fwd_kernel[grid](x, packed, qg, phi, alpha, bias, doc_ids, out, lse, logits,
                      S, B, T, d, m, k_max, eps, triton.cdiv(d, blk.bd),
                      KEY_NORM=key_norm, SIGMOID=sigmoid, WRITE_R=write_r, STORE_LOGITS=store_logits,
                      SINGLE=blk.single, M_PAD=m_pad, K_LOOP=k_max, BT=blk.bt, BD=blk.bd, num_warps=blk.warps)
    return out, lse, (logits[:m] if store_logits else None)


def streams_backward(dr, r, lse, x, taps, packed, k_max, qg, doc_ids, *, key_norm, eps, blocks=None):
    """Gradients of the streams R w.r.t. x, the taps and q ⊙ g, given dR (m, B, T, d) fp32:
    dx (S, B, T, d) in x's dtype, [dtaps_j (k_j, d) fp32], dqg (m, d) fp32."""
    S, B, T, d = x.shape
    m, m_pad = dr.shape[0], packed.shape[0]
    blk = blocks or _blocks(T, d, m_pad)
    n_tb, n_dt = triton.cdiv(T, blk.bt), triton.cdiv(d, blk.bd)
    sub = min(blk.sub, n_tb)
    n_chunks = triton.cdiv(n_tb, sub)
    delta = (dr * r).sum(-1).contiguous()  # (m, B, T): dR_j · R_j
    de = torch.empty(m, B, T, d, device=x.device, dtype=torch.float32)  # one source at a time
    dqg_part = torch.zeros(n_tb * B, m_pad, d, device=x.device, dtype=torch.float32)
    dtap_part = torch.zeros(k_max, n_chunks * B, m_pad, d, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    for s in range(S):
        _de_kernel[(n_tb, B)](x, packed, qg, doc_ids, dr, delta, lse, de, dqg_part,
                              s, B, T, d, m, k_max, eps, n_dt,
                              KEY_NORM=key_norm, M_PAD=m_pad, K_LOOP=k_max, BT=blk.bt, BD=blk.bd,
                              num_warps=blk.warps)
        _dx_kernel[(n_tb, B, n_dt)](de, packed, doc_ids, dx[s], B, T, d, m, k_max,
                                    M_PAD=m_pad, K_LOOP=k_max, BT=blk.bt, BD=blk.bd, num_warps=blk.warps)
        if taps:
            _dtap_kernel[(k_max, n_chunks, B * n_dt)](de, x[s], doc_ids, dtap_part, B, T, d, m, n_chunks, sub,
                                                      M_PAD=m_pad, BT=blk.bt, BD=blk.bd, num_warps=blk.warps)
    dqg = dqg_part.sum(0)[:m]
    dtaps_all = dtap_part.sum(1)  # (K_MAX, M_PAD, d)
    dtaps = [dtaps_all[: c.shape[0], j] for j, c in enumerate(taps, start=1)]
    return dx, dtaps, dqg


def _query_grads(dqg, queries, key_gains):
    if key_gains is None:
        return dqg.to(queries.dtype), None
    return (dqg * key_gains.float()).to(queries.dtype), (dqg * queries.float()).to(key_gains.dtype)


class MsarFunction(torch.autograd.Function):
    """The whole MSAR read. Inputs: x, queries, key_gains (or None), doc_ids, φ, α, b, flags, *taps.
    Outputs: h (differentiable), lse and logits (diagnostics, not differentiable)."""

    @staticmethod
    def forward(ctx, x, queries, key_gains, doc_ids, phi, alpha, bias, key_norm, eps, fusion, store_logits,
                *taps):
        d, m = x.shape[-1], queries.shape[0]
        packed, k_max, _ = pack_taps(taps, d, x.device)
        qg = folded_queries(queries, key_gains)
        h, lse, logits = forward(x, packed, k_max, m, qg, doc_ids, key_norm=key_norm, eps=eps,
                                 phi=phi.detach().float().contiguous(),
                                 alpha=alpha.detach().float().reshape(1).contiguous(),
                                 bias=bias.detach().float().contiguous(), sigmoid=fusion == "sigmoid",
                                 store_logits=store_logits)
        ctx.save_for_backward(x, queries, key_gains, doc_ids, phi, alpha, bias, *taps)
        ctx.key_norm, ctx.eps, ctx.fusion = key_norm, eps, fusion
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(lse, logits)
        return h, lse, logits

    @staticmethod
    def backward(ctx, dh, _dlse, _dlogits):
        x, queries, key_gains, doc_ids, phi, alpha, bias, *taps = ctx.saved_tensors
        d, m = x.shape[-1], queries.shape[0]
        packed, k_max, _ = pack_taps(taps, d, x.device)
        qg = folded_queries(queries, key_gains)
        with torch.autocast(device_type=x.device.type, enabled=False):
            r, lse, _ = forward(x, packed, k_max, m, qg, doc_ids, key_norm=ctx.key_norm, eps=ctx.eps,
                                write_r=True)  # (m, B, T, d) fp32: recomputed, never saved
            with torch.enable_grad():
                leaves = [r.requires_grad_(), phi.detach().float().requires_grad_(),
                          alpha.detach().float().requires_grad_(), bias.detach().float().requires_grad_()]
                h = reference.mix(*leaves, fusion=ctx.fusion, eps=ctx.eps)
                dr, dphi, dalpha, dbias = torch.autograd.grad(h, leaves, dh.float())
            dx, dtaps, dqg = streams_backward(dr.contiguous(), r.detach(), lse, x, taps, packed, k_max, qg, doc_ids,
                                              key_norm=ctx.key_norm, eps=ctx.eps)
            dq, dg = _query_grads(dqg, queries, key_gains)
        return (dx, dq, dg, None, dphi.to(phi.dtype), dalpha.to(alpha.dtype), dbias.to(bias.dtype),
                None, None, None, None, *(dc.to(c.dtype) for dc, c in zip(dtaps, taps)))


class StreamsFunction(torch.autograd.Function):
    """The streams R (m, B, T, d) without the mixer (``msar_attn``). Inputs: x, queries, key_gains,
    doc_ids, flags, *taps. Outputs: R in x's dtype, lse, logits."""

    @staticmethod
    def forward(ctx, x, queries, key_gains, doc_ids, key_norm, eps, store_logits, *taps):
        d, m = x.shape[-1], queries.shape[0]
        packed, k_max, _ = pack_taps(taps, d, x.device)
        qg = folded_queries(queries, key_gains)
        r, lse, logits = forward(x, packed, k_max, m, qg, doc_ids, key_norm=key_norm, eps=eps, write_r=True,
                                 store_logits=store_logits)
        ctx.save_for_backward(x, queries, key_gains, doc_ids, r, lse, *taps)
        ctx.key_norm, ctx.eps = key_norm, eps
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(lse, logits)
        return r.to(x.dtype), lse, logits

    @staticmethod
    def backward(ctx, dr, _dlse, _dlogits):
        x, queries, key_gains, doc_ids, r, lse, *taps = ctx.saved_tensors
        d = x.shape[-1]
        packed, k_max, _ = pack_taps(taps, d, x.device)
        qg = folded_queries(queries, key_gains)
        with torch.autocast(device_type=x.device.type, enabled=False):
            dx, dtaps, dqg = streams_backward(dr.float().contiguous(), r, lse, x, taps, packed, k_max, qg, doc_ids,
                                              key_norm=ctx.key_norm, eps=ctx.eps)
            dq, dg = _query_grads(dqg, queries, key_gains)
        return (dx, dq, dg, None, None, None, None, *(dc.to(c.dtype) for dc, c in zip(dtaps, taps)))


def _prepare(x, taps, queries, key_gains, doc_ids):
    return (x.contiguous(), [c.contiguous() for c in taps], queries.contiguous(),
            None if key_gains is None else key_gains.contiguous(), doc_ids.to(torch.int64).contiguous())


@torch.compiler.disable  # under torch.compile: a graph break, the kernels run as they are
def msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, *, key_norm=True, fusion="sigmoid",
         eps=1e-6, return_weights=False):
    """The fused MSAR read; inputs already validated by ``kernels.msar_attn.msar``. Weights are
    returned detached (diagnostics)."""
    x, taps, queries, key_gains, doc_ids = _prepare(x, taps, queries, key_gains, doc_ids)
    h, lse, logits = MsarFunction.apply(x, queries, key_gains, doc_ids, phi, alpha, bias, bool(key_norm),
                                        float(eps), fusion, bool(return_weights), *taps)
    if not return_weights:
        return h
    return h, torch.exp(logits - lse[:, None])  # (m, S, B, T) fp32


@torch.compiler.disable
def msar_attn(x, taps, queries, key_gains, doc_ids, *, key_norm=True, eps=1e-6, return_weights=False):
    """The fused streams (no mixer); inputs already validated by ``kernels.msar_attn.msar_attn``."""
    x, taps, queries, key_gains, doc_ids = _prepare(x, taps, queries, key_gains, doc_ids)
    r, lse, logits = StreamsFunction.apply(x, queries, key_gains, doc_ids, bool(key_norm), float(eps),
                                           bool(return_weights), *taps)
    if not return_weights:
        return r
    return r, torch.exp(logits - lse[:, None])
