"""MSAR fused in Triton: conv views, key RMSNorm, online softmax over sources and the H^pre mixer.

Same semantics as ``reference.py`` (docs/method.md §4). PyTorch only packs the taps, folds the key gains
into the queries, and sums per-program partial gradients (deterministic: no atomics).

Sources: a stacked (S, B, T, d) tensor, or (``BufferedSources``) the first rows of a ``SourceBuffer`` read in
place plus a partial (B, T, d) at its own element offset from them (``_src_off``); then the source-gradient
kernel adds the rows' gradients into the buffer's ``RowGradients`` instead of writing a stacked dx.

Data flow of the forward, ``_fwd_kernel``: one program per (block of BT tokens, row b), all m views
at once. Per source s and channel tile, each view j is built as its own (BT, BD) tile over its own
k_j taps (the kernel sizes are the constexpr tuple ``KS``: unrolled tap loops, Σ_j k_j
multiply-adds an element) from the shifted tiles x_s[t-τ] (BT tokens plus a halo; the halo comes
from L1/L2, so HBM sees each source tile once), then placed in one (m, BT, BD) tile; the taps are
packed (m, K_MAX, d) (view 0 is the Dirac). Document masks are bits of one int32 per token
(``doc_window``), so no load waits on another. Then, per view: key RMSNorm (gain folded into the
query), logit, online softmax over sources (fp32), weighted sum.

- d fits one channel tile (``SINGLE``): one pass over the sources; the streams R (m, BT, d) stay
  in registers and the mixer runs in the epilogue: ‖R‖², R·φ, z = α·ρ_R·(R·φ) + b, g = σ(z) (or
  softmax over m), h = Σ_j g_j r^{(j)}. Only h (B, T, d) and lse (m, B, T) are written.
- d larger than a tile: pass 1 over (source, channel tile) for the logits (their d-reductions:
  q·E and ‖E‖²; written to a (m, S, B, T) fp32 buffer, 4·m·S bytes a token) and the lse;
  pass 2 per channel tile recomputes the views and weighted sums for ‖R‖² and R·φ; pass 3
  recomputes them once more and writes h. Recomputing costs S·d reads (mostly L2 hits) and the
  conv arithmetic; storing R would cost 2·m·d·4 bytes a token of HBM traffic instead.

The default forward is split (``Blocks.fwd_mode="split"``, ``_forward_split``; docs/kernel_msar.md, "The split
forward"): pass 1 is the serial stats kernel (``_stats_serial_kernel`` with QS, two tokens a trip) summing each
(view, source, token)'s logit terms over channel tiles; a small kernel finishes the softmax over the sources; pass 2
(``_streams_split_kernel``, lean, two tokens a trip: a source's K_MAX + 1 shifted rows loaded once for two tokens'
views, ``Blocks.split_trip``) writes R with the mixer's per-tile sums; the gate and h follow. The backward's stats
and source gradients are serial too (``_stats_serial_kernel``, ``_src_serial_kernel``: a program walks its tokens
with a window of the last K_MAX source values in registers). The tile kernels below remain as selectable modes.

``WRITE_R`` makes the same kernel write the streams R (m, B, T, d) fp32 instead of h (the public
``msar_attn``, streams only). ``SAVE`` (when a gradient is wanted) also writes R (in x's dtype, under
autocast in its narrower dtype: ``saved_streams_dtype``) and
two per-token scalars of the mixer (R·φ, ‖vec R‖²) for the backward: 2·m·d bytes a token in bf16,
against rebuilding the views once more (the mixer backward took 3.9 ms at `small` rebuilding them,
0.22 ms reading them).

Backward (``MsarFunction.backward``), three kernels, never an (m, S, B, T, d) buffer:
- ``_mix_bwd_kernel``: the mixer's backward per token from the saved R: dR (m, B, T, d) fp32 and
  per-token scalars for dφ, dα, db (dφ = Σ_t vec R ⊗ α ρ dz, a batched product over token chunks).
- ``_stats_kernel``: per (view, source, token) the scalars of dE_j(x_s) = w dR_j + κ qg_j - μ E_j(x_s):
  w = exp(logit - lse), a = dR·E, dlogit = w (a - Σ_s w a), κ = dlogit ρ, μ = dlogit · logit · ρ² / d
  (ρ the key RMS reciprocal); Σ_s w a = dR·R from the kernel's own fp32 views (not the saved bf16 R:
  the difference a - Σ_s w a cancels); reductions over all channels.
- ``_src_kernel``: dE built on a token block and the next BT tokens, kept in a per-program scratch
  ring of two half-tiles (the next tokens' dE is the next block's own: views built once per
  token); the conv adjoint dx_s[t] = Σ_j Σ_{τ<k_j} c_τ^{(j)} ⊙ dE_j(x_s)[t+τ] ·
  [same doc] from shifted loads of it, and the query and tap gradients, partial per program.
Partial sums are reduced with ``torch.sum``: deterministic, no atomics.

All math is fp32 whatever x's dtype (bf16 on the GPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting, sm_count



@triton.jit
def _views(x_row, tap_row, near_t, offs_t, mask_t, offs_d, mask_d, D, K_MAX,
           M_PAD: tl.constexpr, KS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, V3: tl.constexpr):
    """All m views of one source tile (``x_row``, ``tap_row``: the source's row and the taps, ``_src_row``):
    E (M_PAD, BT, BD) fp32,
    E[j, t] = Σ_{τ<k_j} c_τ^{(j)} ⊙ x[t-τ] · [doc(t-τ) = doc(t)], rows past m zero.
    Per view j a (BT, BD) tile over its own k_j = KS[j] taps (constexpr: Σ_j k_j multiply-adds
    an element, not m·K_MAX), unrolled so that every shifted load of the view is in flight at once;
    the shifted tiles re-read the same rows (L1 hits). Then placed in row j of the view tile."""
    jv = tl.arange(0, M_PAD)
    e = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    if V3:  # every load in the view tile's own 3-d layout: (1, BT, BD) rows, (1, 1, BD) taps
        d3 = offs_d[None, None, :]
        md3 = mask_d[None, None, :]
        for j in tl.static_range(len(KS)):
            ej3 = tl.zeros((1, BT, BD), dtype=tl.float32)
            for tau in tl.static_range(tl.constexpr(KS[j])):
                ok = ((near_t >> tau) & 1) != 0  # t - τ in the row and in t's document: no dependent load
                xv3 = tl.load(x_row + (offs_t - tau)[None, :, None] * D + d3,
                              mask=ok[None, :, None] & md3, other=0.0).to(tl.float32)  # (1, BT, BD)
                c3 = tl.load(tap_row + (j * K_MAX + tau) * D + d3, mask=md3, other=0.0)  # (1, 1, BD)
                ej3 += c3 * xv3
            e = tl.where(jv[:, None, None] == j, ej3, e)
    else:  # (BT, BD) tiles and (BD,) taps, placed into the view tile per view
        for j in tl.static_range(len(KS)):
            ej = tl.zeros((BT, BD), dtype=tl.float32)
            for tau in tl.static_range(tl.constexpr(KS[j])):
                ok = ((near_t >> tau) & 1) != 0  # t - τ in the row and in t's document: no dependent load
                xv = tl.load(x_row + (offs_t - tau)[:, None] * D + offs_d[None, :],
                             mask=ok[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # (BT, BD)
                c = tl.load(tap_row + (j * K_MAX + tau) * D + offs_d, mask=mask_d, other=0.0)  # (BD,)
                ej += c[None, :] * xv
            e = tl.where(jv[:, None, None] == j, ej[None, :, :], e)
    return e


@triton.jit
def _src_off(s, b, B, T, D, n_buf, p_off):
    """Element offset from x where row b of source s starts: rows [0, n_buf) of the stacked (or buffered) x
    (n_buf, B, T, d), then source n_buf (when there is one) the partial, a (B, T, d) tensor at element offset
    p_off - 2**40 from x (``offset_arg``; ``BufferedSources``: the sources are read in place, never stacked).
    int64, maybe negative."""
    return tl.where(s < n_buf, (s * B + b).to(tl.int64) * T * D,
                    p_off.to(tl.int64) - (1 << 40) + b.to(tl.int64) * T * D)


@triton.jit
def _src_row(x_ptr, taps_ptr, s, b, B, T, D, n_buf, p_off):
    """(x_row, tap_row): where row b of source s starts (``_src_off``), once per source, so that the loads
    inside a row take int32 offsets from it (T·d < 2**31, checked at launch); and the taps, offset by a
    zero that is not provably zero, so that their loads stay in the caller's loop over sources instead of
    being hoisted out of it (Σ_j k_j tap vectors held across that loop spill registers)."""
    off = _src_off(s, b, B, T, D, n_buf, p_off)
    return x_ptr + off, taps_ptr + (tl.abs(off) >> 62)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _weighted(x_ptr, taps_ptr, logits_ptr, lse, near_t, offs_t, mask_t, offs_d, mask_d,
              b, S, n_buf, p_off, B, T, D, K_MAX,
              M_PAD: tl.constexpr, KS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, V3: tl.constexpr):
    """Streams of one channel tile from stored logits: R[j, t] = Σ_s exp(logit - lse) E_j(x_s)[t]."""
    jv = tl.arange(0, M_PAD)
    acc = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    s = b * 0  # while loops: Triton 3.6's interpreter cannot take a tensor as a range bound
    while s < S:
        x_row, tap_row = _src_row(x_ptr, taps_ptr, s, b, B, T, D, n_buf, p_off)
        e = _views(x_row, tap_row, near_t, offs_t, mask_t, offs_d, mask_d, D, K_MAX, M_PAD, KS, BT, BD, V3)
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
        ph = tl.load(phi_ptr + i * (M * D) + jv[:, None] * D + offs_d[None, :],
                     mask=mask_j[:, None] & mask_d[None, :] & (i < M), other=0.0)  # φ[j·d + c, i], from φᵀ
        val = tl.sum(tl.sum(r * ph[:, None, :], axis=2), axis=0)  # (BT,)
        z = tl.where(jv[:, None] == i, val[None, :], z)
    return rr, z


@triton.jit
def _one_pass(x_ptr, taps_ptr, qg_ptr, logits_ptr, rho_ptr, near_t, offs_t, mask_t, offs_d, mask_d, mask_j,
              b, S, n_buf, p_off, B, T, D, K_MAX, eps,
              KEY_NORM: tl.constexpr, STORE_LOGITS: tl.constexpr, STORE_RHO: tl.constexpr, M_PAD: tl.constexpr,
              KS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, V3: tl.constexpr):
    """d in one tile: logits, online softmax over sources (fp32) and weighted sums together.
    Returns the streams r (M_PAD, BT, BD) and the lse (M_PAD, BT). With STORE_RHO (and KEY_NORM) also the keys'
    ρ = (‖E‖²/d + eps)^-½ per (view, source, token), which the backward's stats then need not recompute."""
    jv = tl.arange(0, M_PAD)
    qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=mask_j[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full((M_PAD, BT), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((M_PAD, BT), dtype=tl.float32)
    acc = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    s = b * 0
    while s < S:
        x_row, tap_row = _src_row(x_ptr, taps_ptr, s, b, B, T, D, n_buf, p_off)
        e = _views(x_row, tap_row, near_t, offs_t, mask_t, offs_d, mask_d, D, K_MAX, M_PAD, KS, BT, BD, V3)
        stat = ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :]  # (M_PAD, BT) into (m, S, B, T)
        if KEY_NORM:  # (q ⊙ g)·E and ‖E‖² in one reduction over the channels (one round of barriers)
            logit, ss = tl.reduce((e * qg[:, None, :], e * e), 2, _add2)  # (M_PAD, BT) each
            rho = tl.rsqrt(ss / D + eps)
            logit = logit * rho
            if STORE_RHO:
                tl.store(rho_ptr + stat, rho, mask=mask_j[:, None] & mask_t[None, :])
        else:
            logit = tl.sum(e * qg[:, None, :], axis=2)
        if STORE_LOGITS:
            tl.store(logits_ptr + stat, logit, mask=mask_j[:, None] & mask_t[None, :])
        m_new = tl.maximum(m_i, logit)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(logit - m_new)
        l_i = l_i * scale + p
        acc = acc * scale[:, :, None] + p[:, :, None] * e
        m_i = m_new
        s += 1
    return acc / l_i[:, :, None], m_i + tl.log(l_i)


@triton.jit
def _logits_lse(x_ptr, taps_ptr, qg_ptr, logits_ptr, rho_ptr, near_t, offs_t, mask_t, mask_j,
                b, S, n_buf, p_off, B, T, D, K_MAX, eps, n_dt,
                KEY_NORM: tl.constexpr, STORE_RHO: tl.constexpr, M_PAD: tl.constexpr, KS: tl.constexpr,
                BT: tl.constexpr, BD: tl.constexpr, V3: tl.constexpr):
    """d over several tiles, pass 1: the logits (reductions over all channel tiles) of every source,
    written to logits (M_PAD, S, B, T) for the next passes (with STORE_RHO the keys' ρ to rho (m, S, B, T));
    returns their lse (M_PAD, BT)."""
    jv = tl.arange(0, M_PAD)
    m_i = tl.full((M_PAD, BT), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((M_PAD, BT), dtype=tl.float32)
    s = b * 0
    while s < S:
        x_row, tap_row = _src_row(x_ptr, taps_ptr, s, b, B, T, D, n_buf, p_off)
        dot = tl.zeros((M_PAD, BT), dtype=tl.float32)
        ss = tl.zeros((M_PAD, BT), dtype=tl.float32)
        dt = b * 0
        while dt < n_dt:
            offs_d = dt * BD + tl.arange(0, BD)
            mask_d = offs_d < D
            qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=mask_j[:, None] & mask_d[None, :],
                         other=0.0)
            e = _views(x_row, tap_row, near_t, offs_t, mask_t, offs_d, mask_d, D, K_MAX, M_PAD, KS, BT, BD, V3)
            dot_part, ss_part = tl.reduce((e * qg[:, None, :], e * e), 2, _add2)
            dot += dot_part
            ss += ss_part
            dt += 1
        logit = dot
        stat = ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :]  # (M_PAD, BT) into (m, S, B, T)
        if KEY_NORM:
            rho = tl.rsqrt(ss / D + eps)
            logit = dot * rho
            if STORE_RHO:
                tl.store(rho_ptr + stat, rho, mask=mask_j[:, None] & mask_t[None, :])
        tl.store(logits_ptr + stat, logit, mask=mask_t[None, :])  # padded views too: the next passes read them back
        m_new = tl.maximum(m_i, logit)
        l_i = l_i * tl.exp(m_i - m_new) + tl.exp(logit - m_new)
        m_i = m_new
        s += 1
    tl.debug_barrier()  # the logits written here are read back by other threads of the program
    return m_i + tl.log(l_i)


@triton.jit(do_not_specialize=("S", "n_buf"))  # counts of sources: one compile for every count
def _fwd_kernel(
    x_ptr,  # sources (S, B, T, d), contiguous, any float dtype (or n_buf rows of them and the partial: _src_off)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32, zero past k_j and for padded views; view 0 Dirac
    qg_ptr,  # gain-folded queries q_j ⊙ g_j (m, d) fp32
    phi_ptr,  # mixer projection as φᵀ (m, m·d) fp32: row i is φ's column i (contiguous channel loads)
    alpha_ptr,  # mixer scale α (1,) fp32
    bias_ptr,  # mixer bias b (m,) fp32
    near_ptr,  # document window bits (B, T) int32 (``doc_window``)
    out_ptr,  # h (B, T, d) in its own dtype (x's; the stream's for buffered sources), or with WRITE_R the streams R (m, B, T, d) fp32
    lse_ptr,  # log-sum-exp over sources of the logits (m, B, T) fp32
    logits_ptr,  # logits (m, S, B, T) fp32 (M_PAD rows when not SINGLE): written when STORE_LOGITS or not SINGLE
    rho_ptr,  # with STORE_RHO: the keys' ρ (m, S, B, T) fp32, for the backward's stats (``streams_backward``)
    save_r_ptr,  # with SAVE (for the backward): the streams R (m, B, T, d) (``saved_streams_dtype``)
    save_z_ptr,  # with SAVE: R·φ (m, B, T) fp32
    save_rr_ptr,  # with SAVE: ‖vec R‖² (B, T) fp32
    S, n_buf, p_off, B, T, D, M, K_MAX, eps, n_dt,
    KEY_NORM: tl.constexpr, SIGMOID: tl.constexpr, WRITE_R: tl.constexpr, STORE_LOGITS: tl.constexpr,
    STORE_RHO: tl.constexpr, SAVE: tl.constexpr, SINGLE: tl.constexpr, M_PAD: tl.constexpr, KS: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, V3: tl.constexpr,
):
    tb = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tb * BT + tl.arange(0, BT)
    mask_t = offs_t < T
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    near_t = tl.load(near_ptr + b.to(tl.int64) * T + offs_t, mask=mask_t, other=0)  # (BT,) window bits
    stat = (jv[:, None] * B + b).to(tl.int64) * T + offs_t[None, :]  # (M_PAD, BT) index into (m, B, T)
    stat_mask = mask_j[:, None] & mask_t[None, :]
    rows = (b * T + offs_t).to(tl.int64)  # (BT,) index into (B, T)
    alpha = tl.load(alpha_ptr)  # (with WRITE_R these point at a dummy buffer, unused)
    bias = tl.load(bias_ptr + jv, mask=mask_j, other=0.0)

    if SINGLE:  # one pass; R stays in registers
        offs_d = tl.arange(0, BD)
        mask_d = offs_d < D
        r, lse = _one_pass(x_ptr, taps_ptr, qg_ptr, logits_ptr, rho_ptr, near_t, offs_t, mask_t, offs_d, mask_d,
                           mask_j, b, S, n_buf, p_off, B, T, D, K_MAX, eps, KEY_NORM, STORE_LOGITS, STORE_RHO, M_PAD,
                           KS, BT, BD, V3)
        tl.store(lse_ptr + stat, lse, mask=stat_mask)
        if WRITE_R:
            tl.store(out_ptr + stat[:, :, None] * D + offs_d[None, None, :], r,
                     mask=stat_mask[:, :, None] & mask_d[None, None, :])
        else:
            rr, z = _mixer_stats(r, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD, BT)
            if SAVE:  # what the mixer's backward needs, so that it does not rebuild the views
                tl.store(save_r_ptr + stat[:, :, None] * D + offs_d[None, None, :],
                         r.to(save_r_ptr.dtype.element_ty), mask=stat_mask[:, :, None] & mask_d[None, None, :])
                tl.store(save_z_ptr + stat, z, mask=stat_mask)
                tl.store(save_rr_ptr + rows, rr, mask=mask_t)
            g = _gate(z, rr, alpha, bias, mask_j, M, D, eps, SIGMOID)
            h = tl.sum(g[:, :, None] * r, axis=0)  # (BT, BD)
            tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], h.to(out_ptr.dtype.element_ty),
                     mask=mask_t[:, None] & mask_d[None, :])
    else:
        lse = _logits_lse(x_ptr, taps_ptr, qg_ptr, logits_ptr, rho_ptr, near_t, offs_t, mask_t, mask_j,
                          b, S, n_buf, p_off, B, T, D, K_MAX, eps, n_dt, KEY_NORM, STORE_RHO, M_PAD, KS, BT, BD, V3)
        tl.store(lse_ptr + stat, lse, mask=stat_mask)
        if WRITE_R:
            dt = b * 0
            while dt < n_dt:
                offs_d = dt * BD + tl.arange(0, BD)
                mask_d = offs_d < D
                r = _weighted(x_ptr, taps_ptr, logits_ptr, lse, near_t, offs_t, mask_t, offs_d,
                              mask_d, b, S, n_buf, p_off, B, T, D, K_MAX, M_PAD, KS, BT, BD, V3)
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
                r = _weighted(x_ptr, taps_ptr, logits_ptr, lse, near_t, offs_t, mask_t, offs_d,
                              mask_d, b, S, n_buf, p_off, B, T, D, K_MAX, M_PAD, KS, BT, BD, V3)
                rr_part, z_part = _mixer_stats(r, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD, BT)
                rr += rr_part
                z += z_part
                dt += 1
            g = _gate(z, rr, alpha, bias, mask_j, M, D, eps, SIGMOID)
            if SAVE:
                tl.store(save_z_ptr + stat, z, mask=stat_mask)
                tl.store(save_rr_ptr + rows, rr, mask=mask_t)
            # pass 3: recompute the streams tile by tile and write h
            dt = b * 0
            while dt < n_dt:
                offs_d = dt * BD + tl.arange(0, BD)
                mask_d = offs_d < D
                r = _weighted(x_ptr, taps_ptr, logits_ptr, lse, near_t, offs_t, mask_t, offs_d,
                              mask_d, b, S, n_buf, p_off, B, T, D, K_MAX, M_PAD, KS, BT, BD, V3)
                if SAVE:
                    tl.store(save_r_ptr + stat[:, :, None] * D + offs_d[None, None, :],
                             r.to(save_r_ptr.dtype.element_ty), mask=stat_mask[:, :, None] & mask_d[None, None, :])
                h = tl.sum(g[:, :, None] * r, axis=0)
                tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], h.to(out_ptr.dtype.element_ty),
                         mask=mask_t[:, None] & mask_d[None, :])
                dt += 1


@triton.jit
def _mixer_grads(z, rr, dg, alpha, bias, mask_j, M, D, eps, SIGMOID: tl.constexpr):
    """From z = R·φ, ‖R‖² and dg_j = dh·r_j: g, dz (M_PAD, BT), ρ_R (BT,) and Σ_i dz_i y_i (BT,),
    y = ρ_R z the normalised projection (so dα = Σ_t Σ_i dz_i y_i)."""
    g = _gate(z, rr, alpha, bias, mask_j, M, D, eps, SIGMOID)
    if SIGMOID:
        dz = g * (1.0 - g) * dg
    else:
        dz = g * (dg - tl.sum(g * dg, axis=0)[None, :])
    dz = tl.where(mask_j[:, None], dz, 0.0)
    rho = tl.rsqrt(rr / (M * D) + eps)
    return g, dz, rho, tl.sum(dz * z, axis=0) * rho


@triton.jit
def _dr_tile(r, dh, g, dz, rho, alpha, dzy, phi_ptr, offs_d, mask_d, mask_j, M, D,
             M_PAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """dL/dR of one channel tile (M_PAD, BT, BD):
    dR_j = g_j dh + ρ α Σ_i dz_i φ_i[j] - ρ² α (Σ_i dz_i y_i) R_j / (m d)  (RMSNorm backward)."""
    jv = tl.arange(0, M_PAD)
    proj = tl.zeros((M_PAD, BT, BD), dtype=tl.float32)
    for i in tl.static_range(M_PAD):
        ph = tl.load(phi_ptr + i * (M * D) + jv[:, None] * D + offs_d[None, :],
                     mask=mask_j[:, None] & mask_d[None, :] & (i < M), other=0.0)  # φ[j·d + c, i], from φᵀ
        dz_i = tl.sum(tl.where(jv[:, None] == i, dz, 0.0), axis=0)  # (BT,)
        proj += dz_i[None, :, None] * ph[:, None, :]
    return (g[:, :, None] * dh[None, :, :] + (rho * alpha)[None, :, None] * proj
            - (rho * rho * alpha * dzy / (M * D))[None, :, None] * r)


@triton.jit
def _mix_bwd_kernel(
    r_ptr,  # the streams R (m, B, T, d) as the forward saved them (``saved_streams_dtype``)
    z_ptr,  # R·φ (m, B, T) fp32, saved by the forward
    rr_ptr,  # ‖vec R‖² (B, T) fp32, saved by the forward
    phi_ptr, alpha_ptr, bias_ptr,  # the mixer's parameters, as in _fwd_kernel
    dh_ptr,  # upstream gradient (B, T, d), contiguous
    dr_ptr,  # result: dL/dR (m, B, T, d) fp32 (or the kept streams' dtype: Blocks.grad_streams)
    dz_ptr,  # result: dL/dz (B, T, m) fp32 (db = Σ_t dz)
    coef_ptr,  # result: α ρ_R dz (B, T, m) fp32 (dφ = Σ_t vec R ⊗ coef)
    dzy_ptr,  # result: Σ_i dz_i y_i (B, T) fp32 (dα = Σ_t)
    sums_ptr,  # result with SUMS: the program's Σ_t dz_j and Σ_t Σ_i dz_i y_i, one row (n_prog, m + 1) fp32
    B, T, D, M, eps, n_dt,
    SIGMOID: tl.constexpr, M_PAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SUMS: tl.constexpr = False,  # Blocks.mix_sums="kernel": its tokens' sums of dz and dz·y, not dz and dz·y
):
    """Backward of the mixer from the streams the forward saved: two passes over the channel tiles of
    R and dh (dg_j = dh·r_j, then dR tile by tile; the second pass mostly hits L2)."""
    tb = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tb * BT + tl.arange(0, BT)
    mask_t = offs_t < T
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    stat = (jv[:, None] * B + b).to(tl.int64) * T + offs_t[None, :]
    stat_mask = mask_j[:, None] & mask_t[None, :]
    rows = (b * T + offs_t).to(tl.int64)
    alpha = tl.load(alpha_ptr)
    bias = tl.load(bias_ptr + jv, mask=mask_j, other=0.0)
    z = tl.load(z_ptr + stat, mask=stat_mask, other=0.0)
    rr = tl.load(rr_ptr + rows, mask=mask_t, other=0.0)
    # pass 1: dg_j = dh·r_j over all channel tiles
    dg = tl.zeros((M_PAD, BT), dtype=tl.float32)
    dt = b * 0
    while dt < n_dt:
        offs_d = dt * BD + tl.arange(0, BD)
        mask_d = offs_d < D
        r = tl.load(r_ptr + stat[:, :, None] * D + offs_d[None, None, :],
                    mask=stat_mask[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
        dg += tl.sum(r * dh[None, :, :], axis=2)
        dt += 1
    g, dz, rho, dzy = _mixer_grads(z, rr, dg, alpha, bias, mask_j, M, D, eps, SIGMOID)
    # pass 2: dR tile by tile
    dt = b * 0
    while dt < n_dt:
        offs_d = dt * BD + tl.arange(0, BD)
        mask_d = offs_d < D
        tile = stat[:, :, None] * D + offs_d[None, None, :]
        m3 = stat_mask[:, :, None] & mask_d[None, None, :]
        r = tl.load(r_ptr + tile, mask=m3, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
        dr = _dr_tile(r, dh, g, dz, rho, alpha, dzy, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD, BT, BD)
        tl.store(dr_ptr + tile, dr.to(dr_ptr.dtype.element_ty), mask=m3)
        dt += 1
    tok = rows[None, :] * M + jv[:, None]  # (M_PAD, BT) index into (B, T, m)
    tl.store(coef_ptr + tok, (alpha * rho)[None, :] * dz, mask=stat_mask)
    if SUMS:  # one row a program: Σ_t dz_j (m), then Σ_t dz·y
        row = sums_ptr + (b * tl.num_programs(0) + tb).to(tl.int64) * (M + 1)
        tl.store(row + jv, tl.sum(tl.where(stat_mask, dz, 0.0), axis=1), mask=mask_j)
        tl.store(row + M, tl.sum(tl.where(mask_t, dzy, 0.0), axis=0))
    else:
        tl.store(dz_ptr + tok, dz, mask=stat_mask)
        tl.store(dzy_ptr + rows, dzy, mask=mask_t)


@triton.jit
def _mix_bwd_walk_kernel(
    r_ptr, z_ptr, rr_ptr, phi_ptr, alpha_ptr, bias_ptr, dh_ptr, dr_ptr,  # as in _mix_bwd_kernel
    part_ptr,  # result: one row a program, (n_prog, m·d·m + m + 1) fp32: its partial dφ, Σ dz, Σ Σ_i dz_i y_i
    N, D, M, eps, n_walk,
    SIGMOID: tl.constexpr, M_PAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """The mixer's backward with dφ summed inside (``Blocks.mix_dphi="walk"``): one channel tile holds all d, so
    R and dh are read once a token; a program walks n_walk steps of BT tokens of the flattened (B·T) rows and
    keeps its partial dφ[j·d + c, i] = Σ_t R_j[t, c] coef_i[t] (coef = α ρ_R dz), Σ_t dz and Σ_t dz·y in
    registers, written once at the end (deterministic: one sum over the programs' rows, no atomics)."""
    p = tl.program_id(0)
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    alpha = tl.load(alpha_ptr)
    bias = tl.load(bias_ptr + jv, mask=mask_j, other=0.0)
    acc = tl.zeros((M_PAD, M_PAD, BD), dtype=tl.float32)  # [j, i, c]
    dz_sum = tl.zeros((M_PAD, BT), dtype=tl.float32)
    dzy_sum = tl.zeros((BT,), dtype=tl.float32)
    k = p * 0
    while k < n_walk:
        offs_n = (p * n_walk + k) * BT + tl.arange(0, BT)
        mask_n = offs_n < N
        stat = jv[:, None].to(tl.int64) * N + offs_n[None, :]  # (M_PAD, BT) index into (m, B·T)
        stat_mask = mask_j[:, None] & mask_n[None, :]
        tile = stat[:, :, None] * D + offs_d[None, None, :]
        m3 = stat_mask[:, :, None] & mask_d[None, None, :]
        r = tl.load(r_ptr + tile, mask=m3, other=0.0).to(tl.float32)  # (M_PAD, BT, BD)
        dh = tl.load(dh_ptr + offs_n.to(tl.int64)[:, None] * D + offs_d[None, :],
                     mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # (BT, BD)
        z = tl.load(z_ptr + stat, mask=stat_mask, other=0.0)
        rr = tl.load(rr_ptr + offs_n, mask=mask_n, other=0.0)
        g, dz, rho, dzy = _mixer_grads(z, rr, tl.sum(r * dh[None, :, :], axis=2), alpha, bias, mask_j, M, D, eps,
                                       SIGMOID)  # tokens past N: dh = 0, so dz = 0 and dzy = 0
        dr = _dr_tile(r, dh, g, dz, rho, alpha, dzy, phi_ptr, offs_d, mask_d, mask_j, M, D, M_PAD, BT, BD)
        tl.store(dr_ptr + tile, dr.to(dr_ptr.dtype.element_ty), mask=m3)
        coef = (alpha * rho)[None, :] * dz  # (M_PAD, BT)
        for i in tl.static_range(M_PAD):
            ci = tl.sum(tl.where(jv[:, None] == i, coef, 0.0), axis=0)  # (BT,)
            pi = tl.sum(r * ci[None, :, None], axis=1)  # (M_PAD, BD): Σ_t R_j[t, c] coef_i[t]
            acc += tl.where(jv[None, :, None] == i, pi[:, None, :], 0.0)
        dz_sum += dz
        dzy_sum += dzy
        k += 1
    row = part_ptr + p.to(tl.int64) * (M * D * M + M + 1)
    out = (jv[:, None, None] * D + offs_d[None, None, :]) * M + jv[None, :, None]  # dφ[j·d + c, i]
    tl.store(row + out, acc, mask=mask_j[:, None, None] & mask_j[None, :, None] & mask_d[None, None, :])
    tl.store(row + M * D * M + jv, tl.sum(dz_sum, axis=1), mask=mask_j)
    tl.store(row + M * D * M + M, tl.sum(dzy_sum, axis=0))


@triton.jit(do_not_specialize=("N", "chunk"))  # token counts: one compile for every batch shape
def _dphi_kernel(
    r_ptr,  # the streams R (m, B·T, d) as the forward saved them
    coef_ptr,  # α ρ_R dz (B·T, m) fp32, from _mix_bwd_kernel
    dz_ptr,  # dL/dz (B·T, m) fp32
    dzy_ptr,  # Σ_i dz_i y_i (B·T,) fp32
    part_ptr,  # result: one row a token chunk, (n_chunk, m·d·m + m + 1) fp32: partial dφ, Σ dz, Σ dz·y
    N, D, M, chunk,
    M_PAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr, LATE: tl.constexpr,
):
    """The mixer's parameter gradients as one reduction (``Blocks.mix_dphi="reduce"``): program (channel tile, token
    chunk) reads its tile of R over its chunk once, BT tokens a step, and sums dφ[j·d + c, i] = Σ_t R_j[t, c]
    coef_i[t] in fp32 registers (a tuple over i of (M_PAD, BD) tiles), written once into its chunk's row; the
    programs of the first channel tile also sum dz and dz·y over the chunk. One sum over the rows finishes all three
    (deterministic, no atomics). The steps' loop a ``range`` on the GPU (pipelined), a ``while`` under the
    interpreter (whose ``range`` takes no run-time bound): the same steps in the same order. ``LATE``
    (``Blocks.dphi_late``): each i's products kept per token as (M_PAD, BT, BD) tiles, a multiply-add a step, and
    summed over the BT rows once at the end, instead of a sum over the step's tokens every step."""
    dt = tl.program_id(0)
    ck = tl.program_id(1)
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    offs_d = dt * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    first = dt == 0
    lo = ck * chunk
    hi = tl.minimum(lo + chunk, N)
    acc = ()
    for i in tl.static_range(M_PAD):
        if LATE:
            acc = acc + (tl.zeros((M_PAD, BT, BD), dtype=tl.float32),)
        else:
            acc = acc + (tl.zeros((M_PAD, BD), dtype=tl.float32),)
    dz_sum = tl.zeros((BT, M_PAD), dtype=tl.float32)
    dzy_sum = tl.zeros((BT,), dtype=tl.float32)
    if INTERP:
        n0 = lo
        while n0 < hi:
            acc, dz_sum, dzy_sum = _dphi_step(r_ptr, coef_ptr, dz_ptr, dzy_ptr, n0, hi, N, D, M, jv, mask_j, offs_d,
                                              mask_d, first, acc, dz_sum, dzy_sum, M_PAD, BT, LATE)
            n0 += BT
    else:
        for n0 in range(lo, hi, BT):
            acc, dz_sum, dzy_sum = _dphi_step(r_ptr, coef_ptr, dz_ptr, dzy_ptr, n0, hi, N, D, M, jv, mask_j, offs_d,
                                              mask_d, first, acc, dz_sum, dzy_sum, M_PAD, BT, LATE)
    row = part_ptr + ck.to(tl.int64) * (M * D * M + M + 1)
    out = (jv[:, None] * D + offs_d[None, :]) * M  # dφ[j·d + c, i] at (j·d + c)·m + i
    for i in tl.static_range(M_PAD):
        if LATE:
            tl.store(row + out + i, tl.sum(acc[i], axis=1), mask=mask_j[:, None] & mask_d[None, :] & (i < M))
        else:
            tl.store(row + out + i, acc[i], mask=mask_j[:, None] & mask_d[None, :] & (i < M))
    tl.store(row + M * D * M + jv, tl.sum(dz_sum, axis=0), mask=mask_j & first)
    tl.store(row + M * D * M + M, tl.sum(dzy_sum, axis=0), mask=first)


@triton.jit
def _dphi_step(r_ptr, coef_ptr, dz_ptr, dzy_ptr, n0, hi, N, D, M, jv, mask_j, offs_d, mask_d, first, acc, dz_sum,
               dzy_sum, M_PAD: tl.constexpr, BT: tl.constexpr, LATE: tl.constexpr):
    """One step of _dphi_kernel: BT tokens from n0 (masked at the chunk's end hi)."""
    offs_n = n0 + tl.arange(0, BT)
    mask_n = offs_n < hi
    rows = offs_n.to(tl.int64)
    tile = (jv[:, None, None].to(tl.int64) * N + rows[None, :, None]) * D + offs_d[None, None, :]
    r = tl.load(r_ptr + tile, mask=mask_j[:, None, None] & mask_n[None, :, None] & mask_d[None, None, :],
                other=0.0).to(tl.float32)  # (M_PAD, BT, BD)
    nacc = ()
    for i in tl.static_range(M_PAD):
        ci = tl.load(coef_ptr + rows * M + i, mask=mask_n & (i < M), other=0.0)  # (BT,)
        if LATE:
            nacc = nacc + (acc[i] + r * ci[None, :, None],)  # (M_PAD, BT, BD)
        else:
            nacc = nacc + (acc[i] + tl.sum(r * ci[None, :, None], axis=1),)  # (M_PAD, BD)
    stat = rows[:, None] * M + jv[None, :]  # (BT, M_PAD)
    dz_sum += tl.load(dz_ptr + stat, mask=mask_n[:, None] & mask_j[None, :] & first, other=0.0)
    dzy_sum += tl.load(dzy_ptr + rows, mask=mask_n & first, other=0.0)
    return nacc, dz_sum, dzy_sum


@triton.jit(do_not_specialize=("S", "n_buf"))  # counts of sources: one compile for every count
def _stats_kernel(
    x_ptr,  # sources (S, B, T, d)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    qg_ptr,  # gain-folded queries (m, d) fp32
    near_ptr,  # document window bits (B, T) int32 (``doc_window``)
    dr_ptr,  # dL/dR (m, B, T, d) fp32 (or bf16: Blocks.grad_streams), read in fp32
    lse_ptr,  # log-sum-exp of the logits (m, B, T) fp32
    coef_ptr,  # result: w, κ, μ, then a scratch plane (4, M_PAD, S, B, T) fp32
    S, n_buf, p_off, B, T, D, M, K_MAX, eps, n_dt, plane,
    KEY_NORM: tl.constexpr, M_PAD: tl.constexpr, KS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    V3: tl.constexpr,
):
    """Per (view, source, token), the scalars of dE_j(x_s) = w dR_j + κ qg_j - μ E_j(x_s):
    w = exp(logit - lse), a = dR_j·E_j(x_s), dlogit = w (a - Σ_s' w a) (the softmax backward; its
    Σ_s' w a = dR_j·R_j comes from the same fp32 views, not from stored streams), κ = dlogit ρ,
    μ = dlogit logit ρ² / d (ρ = (‖E‖²/d + eps)^-½; without key norm κ = dlogit, μ = 0).
    Loop 1 over the sources rebuilds the views (reductions over all channels) and keeps w, a, ρ and
    the logit per (view, source, token) in coef; loop 2 reads them back (scalars only) for κ, μ."""
    tb = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tb * BT + tl.arange(0, BT)
    mask_t = offs_t < T
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    near_t = tl.load(near_ptr + b.to(tl.int64) * T + offs_t, mask=mask_t, other=0)  # (BT,) window bits
    stat = (jv[:, None] * B + b).to(tl.int64) * T + offs_t[None, :]
    stat_mask = mask_j[:, None] & mask_t[None, :]
    lse = tl.load(lse_ptr + stat, mask=stat_mask, other=0.0)
    delta = tl.zeros((M_PAD, BT), dtype=tl.float32)  # Σ_s w a = dR_j·R_j
    s = b * 0
    while s < S:
        x_row, tap_row = _src_row(x_ptr, taps_ptr, s, b, B, T, D, n_buf, p_off)
        dot_q = tl.zeros((M_PAD, BT), dtype=tl.float32)
        ss = tl.zeros((M_PAD, BT), dtype=tl.float32)
        dot_r = tl.zeros((M_PAD, BT), dtype=tl.float32)
        dt = b * 0
        while dt < n_dt:
            offs_d = dt * BD + tl.arange(0, BD)
            mask_d = offs_d < D
            qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=mask_j[:, None] & mask_d[None, :],
                         other=0.0)
            e = _views(x_row, tap_row, near_t, offs_t, mask_t, offs_d, mask_d, D, K_MAX, M_PAD, KS, BT, BD, V3)
            dr = tl.load(dr_ptr + stat[:, :, None] * D + offs_d[None, None, :],
                         mask=stat_mask[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
            dq_part, ss_part = tl.reduce((e * qg[:, None, :], e * e), 2, _add2)  # (three at once spill)
            dot_q += dq_part
            ss += ss_part
            dot_r += tl.sum(e * dr, axis=2)
            dt += 1
        if KEY_NORM:
            rho = tl.rsqrt(ss / D + eps)
        else:
            rho = tl.full((M_PAD, BT), 1.0, dtype=tl.float32)
        logit = dot_q * rho
        w = tl.where(stat_mask, tl.exp(logit - lse), 0.0)
        delta += w * dot_r
        cidx = ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :]
        tl.store(coef_ptr + cidx, w, mask=stat_mask)
        tl.store(coef_ptr + plane + cidx, dot_r, mask=stat_mask)
        tl.store(coef_ptr + 2 * plane + cidx, rho, mask=stat_mask)
        tl.store(coef_ptr + 3 * plane + cidx, logit, mask=stat_mask)
        s += 1
    tl.debug_barrier()  # loop 2 reads back what every thread of the program wrote
    s = b * 0
    while s < S:
        cidx = ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_t[None, :]
        w = tl.load(coef_ptr + cidx, mask=stat_mask, other=0.0)
        dot_r = tl.load(coef_ptr + plane + cidx, mask=stat_mask, other=0.0)
        rho = tl.load(coef_ptr + 2 * plane + cidx, mask=stat_mask, other=0.0)
        logit = tl.load(coef_ptr + 3 * plane + cidx, mask=stat_mask, other=0.0)
        kappa = w * (dot_r - delta) * rho  # dlogit ρ; without key norm ρ = 1
        if KEY_NORM:
            # logit = qg·E ρ  =>  ∂logit/∂E = ρ qg - logit ρ² E / d
            mu = kappa * rho * logit / D
        else:
            mu = tl.zeros((M_PAD, BT), dtype=tl.float32)
        tl.debug_barrier()  # every thread has read this source's scalars before they are overwritten
        tl.store(coef_ptr + plane + cidx, kappa, mask=stat_mask)
        tl.store(coef_ptr + 2 * plane + cidx, mu, mask=stat_mask)
        s += 1


@triton.jit
def _de_half(x_row, tap_row, coef_ptr, dr_ptr, near_row_ptr, qg, offs_h, mask_j, offs_d, mask_d,
             s, b, S, B, T, D, K_MAX, plane,
             SOFTMAX: tl.constexpr, M_PAD: tl.constexpr, KS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
             V3: tl.constexpr):
    """On the BT tokens offs_h of source s: dE = w dR + κ qg - μ E and κ E, (M_PAD, BT, BD) each.
    Without SOFTMAX (one source: κ = μ = 0) dE = w dR and no views are built."""
    jv = tl.arange(0, M_PAD)
    mask_h = offs_h < T
    m_h = mask_j[:, None] & mask_h[None, :]
    cidx = ((jv[:, None] * S + s) * B + b).to(tl.int64) * T + offs_h[None, :]
    w = tl.load(coef_ptr + cidx, mask=m_h, other=0.0)
    dr_rows = (jv[:, None] * B + b).to(tl.int64) * T + offs_h[None, :]  # (M_PAD, BT)
    dr = tl.load(dr_ptr + dr_rows[:, :, None] * D + offs_d[None, None, :],
                 mask=m_h[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
    if SOFTMAX:
        near_h = tl.load(near_row_ptr + offs_h, mask=mask_h, other=0)
        e = _views(x_row, tap_row, near_h, offs_h, mask_h, offs_d, mask_d, D, K_MAX, M_PAD, KS, BT, BD, V3)
        kappa = tl.load(coef_ptr + plane + cidx, mask=m_h, other=0.0)
        mu = tl.load(coef_ptr + 2 * plane + cidx, mask=m_h, other=0.0)
        ke = kappa[:, :, None] * e
        return w[:, :, None] * dr + kappa[:, :, None] * qg[:, None, :] - mu[:, :, None] * e, ke
    else:
        return w[:, :, None] * dr, tl.zeros((M_PAD, BT, BD), dtype=tl.float32)


@triton.jit(do_not_specialize=("S", "n_buf", "n_add"))  # counts of sources: one compile for every count
def _src_kernel(
    x_ptr,  # sources (S, B, T, d)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    qg_ptr,  # gain-folded queries (m, d) fp32
    near_ptr,  # document window bits (B, T) int32 (``doc_window``)
    dr_ptr,  # dL/dR (m, B, T, d) fp32 (or bf16: Blocks.grad_streams), read in fp32
    coef_ptr,  # w, κ, μ (3, M_PAD, S, B, T) fp32
    dx_ptr,  # result: dL/dx (S, B, T, d), x's dtype; or the buffer's row gradients (rows added into below n_add,
    # written from there) and the partial's gradient at element offset q_off (``streams_backward``)
    dqg_ptr,  # result: partial dL/d(q ⊙ g) (n_chunks·B, M_PAD, d) fp32
    dtap_ptr,  # result: partial dL/dc (n_chunks·B, K_PAD, M_PAD, d) fp32
    scratch_ptr,  # scratch: one (M_PAD, 2·BT, BD) fp32 ring per program (dE of one source, two halves)
    tap_scratch_ptr,  # scratch per program: (NPAIR, BT, BD) tap-gradient and (M_PAD, BT, BD)
    # query-gradient partials, fp32
    S, n_buf, p_off, n_add, q_off, B, T, D, M, K_MAX, plane, SUB,
    scr_stride, tap_stride,  # elements between two programs' scratch regions (the buffers' stride(0))
    SOFTMAX: tl.constexpr,  # more than one source (with one, κ = μ = 0: dE = w dR, no views built for it)
    M_PAD: tl.constexpr, KS: tl.constexpr, KOFF: tl.constexpr, NPAIR: tl.constexpr, K_PAD: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, V3: tl.constexpr,
):
    """Gradients of the sources, queries and taps; one program per (chunk of SUB token blocks, row,
    channel tile), all sources. A block of BT tokens needs dE_j(x_s) on the block and the next BT
    tokens (BT >= K_MAX - 1: the conv adjoint reads up to K_MAX - 1 tokens ahead),
        dE = w dR + κ qg - μ E   (M_PAD, 2·BT, BD), only in this program's scratch ring,
    then dx_s[t] = Σ_j Σ_{τ<k_j} c_τ^{(j)} ⊙ dE_j[t+τ] · [doc(t+τ) = doc(t)] from shifted loads of
    the scratch tile, dqg += Σ_t κ E and dc_τ^{(j)} += Σ_t dE_j[t+τ] ⊙ x_s[t] · [same doc] over the
    block's own tokens t (the adjoint's shifted dE times the block's own source tile: every pair
    (t, t+τ) of Σ_t' dE_j[t'] ⊙ x_s[t'-τ] once); the tap loops per view, unrolled."""
    chunk = tl.program_id(0)
    b = tl.program_id(1)
    dt = tl.program_id(2)
    offs_d = dt * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    jv = tl.arange(0, M_PAD)
    mask_j = jv < M
    kv = tl.arange(0, K_PAD)
    loc = tl.arange(0, BT)
    near_row_ptr = near_ptr + b.to(tl.int64) * T
    qg = tl.load(qg_ptr + jv[:, None] * D + offs_d[None, :], mask=mask_j[:, None] & mask_d[None, :], other=0.0)
    dtaps = tl.zeros((K_PAD, M_PAD, BD), dtype=tl.float32)
    ld = tl.arange(0, BD)
    pid = (chunk * B + b) * tl.num_programs(2) + dt
    # this program's own rows of the scratch buffers (programs run concurrently on a GPU: the regions
    # must not overlap, so the strides are the buffers' own, not recomputed here)
    scr = scratch_ptr + pid.to(tl.int64) * scr_stride  # (M_PAD, 2·BT, BD) ring
    tacc = tap_scratch_ptr + pid.to(tl.int64) * tap_stride  # (NPAIR, BT, BD) tap-gradient partials
    tile_t = loc[:, None] * BD + ld[None, :]  # (BT, BD) offsets in one scratch tile
    for p in tl.static_range(NPAIR):
        tl.store(tacc + p * (BT * BD) + tile_t, tl.zeros((BT, BD), dtype=tl.float32))
    qacc = tacc + NPAIR * BT * BD  # (M_PAD, BT, BD) query-gradient partials
    tile_h = (jv[:, None, None] * BT + loc[None, :, None]) * BD + ld[None, None, :]
    tl.store(qacc + tile_h, tl.zeros((M_PAD, BT, BD), dtype=tl.float32))
    # sources outer, blocks inner: the scratch is a ring of two halves of BT tokens; block i's own
    # tokens are half i % 2, its next BT tokens half (i + 1) % 2, so dE of the next tokens, computed
    # for block i's conv adjoint, is block i + 1's own dE: the views are built once per token (the
    # first block of a chunk also builds its own half)
    s = b * 0
    while s < S:
        x_row, tap_row = _src_row(x_ptr, taps_ptr, s, b, B, T, D, n_buf, p_off)
        dx_row = dx_ptr + _src_off(s, b, B, T, D, n_buf, q_off)  # where dx_s goes
        i = b * 0
        while i < SUB:
            t0 = (chunk * SUB + i) * BT
            offs_t = t0 + loc  # the block
            mask_t = offs_t < T
            near_t = tl.load(near_row_ptr + offs_t, mask=mask_t, other=0)
            own0 = (i % 2) * BT  # first row of the block's own half in the ring
            nxt0 = BT - own0
            tl.debug_barrier()  # every thread is done reading the half overwritten below
            if i == 0:
                de_o, ke_o = _de_half(x_row, tap_row, coef_ptr, dr_ptr, near_row_ptr, qg, offs_t, mask_j, offs_d,
                                      mask_d, s, b, S, B, T, D, K_MAX, plane, SOFTMAX, M_PAD, KS, BT, BD, V3)
                tl.store(scr + (jv[:, None, None] * (2 * BT) + own0 + loc[None, :, None]) * BD + ld[None, None, :],
                         de_o)
                tl.store(qacc + tile_h, tl.load(qacc + tile_h) + ke_o)  # κ E, summed over tokens at the end
            de_n, ke_n = _de_half(x_row, tap_row, coef_ptr, dr_ptr, near_row_ptr, qg, offs_t + BT, mask_j, offs_d,
                                  mask_d, s, b, S, B, T, D, K_MAX, plane, SOFTMAX, M_PAD, KS, BT, BD, V3)
            tl.store(scr + (jv[:, None, None] * (2 * BT) + nxt0 + loc[None, :, None]) * BD + ld[None, None, :], de_n)
            if i + 1 < SUB:  # the next block is this program's: count its κ E here, once
                tl.store(qacc + tile_h, tl.load(qacc + tile_h) + ke_n)
            tl.debug_barrier()  # dE visible to every thread of the program
            acc = tl.zeros((BT, BD), dtype=tl.float32)
            # the block's own source tile, once per block: the tap gradient of (j, τ) sums each pair
            # (t, t+τ) from the other end, Σ_t dE_j[t+τ] ⊙ x_s[t] over the block's own t, which covers
            # every pair of Σ_t' dE_j[t'] ⊙ x_s[t'-τ] once with the adjoint's mask and its shifted load
            # (instead of a load of x_s τ tokens back per tap: 6-7% faster, msar_tiles_nvidia_h200_night.md)
            tile = offs_t[:, None] * D + offs_d[None, :]  # (BT, BD) int32 offsets in the source's row
            x_own = tl.load(x_row + tile,
                            mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            for j in tl.static_range(len(KS)):
                for tau in tl.static_range(tl.constexpr(KS[j])):
                    c = tl.load(tap_row + (j * K_MAX + tau) * D + offs_d, mask=mask_d, other=0.0)  # (BD,)
                    # dE_j[t+τ] where t + τ is in the row and in t's document
                    ring = (own0 + loc + tau) % (2 * BT)
                    ok = ((near_t >> (16 + tau)) & 1) != 0
                    sh = tl.where(ok[:, None], tl.load(scr + (j * 2 * BT + ring[:, None]) * BD + ld[None, :]), 0.0)
                    acc += c[None, :] * sh  # conv adjoint: c_τ ⊙ dE_j[t+τ]
                    # tap gradient: summed over tokens once per program, at the end; here only a
                    # per-thread update of this (view, tap)'s (BT, BD) partial in the scratch
                    pair = tacc + (KOFF[j] + tau) * (BT * BD) + tile_t
                    tl.store(pair, tl.load(pair) + sh * x_own)
            # dx_s: the stacked (S, B, T, d) gradient, or the buffer's row s (added to what later readers left
            # there when s < n_add) and, for the partial, its own tensor (_src_off with q_off)
            m_dst = mask_t[:, None] & mask_d[None, :]
            if s < n_add:
                acc += tl.load(dx_row + tile, mask=m_dst, other=0.0).to(tl.float32)
            tl.store(dx_row + tile, acc.to(dx_ptr.dtype.element_ty), mask=m_dst)
            i += 1
        s += 1
    tl.debug_barrier()  # the partials of every thread written
    dqg = tl.sum(tl.load(qacc + tile_h), axis=1)  # (M_PAD, BD)
    for j in tl.static_range(len(KS)):
        for tau in tl.static_range(tl.constexpr(KS[j])):
            contrib = tl.sum(tl.load(tacc + (KOFF[j] + tau) * (BT * BD) + tile_t), axis=0)  # (BD,)
            sel = (kv == tau)[:, None] & (jv == j)[None, :]  # (K_PAD, M_PAD)
            dtaps += tl.where(sel[:, :, None], contrib[None, None, :], 0.0)
    part = (chunk * B + b).to(tl.int64)
    tl.store(dqg_ptr + (part * M_PAD + jv[:, None]) * D + offs_d[None, :], dqg,
             mask=mask_j[:, None] & mask_d[None, :])
    tl.store(dtap_ptr + ((part * K_PAD + kv[:, None, None]) * M_PAD + jv[None, :, None]) * D + offs_d[None, None, :],
             dtaps, mask=mask_j[None, :, None] & mask_d[None, None, :])


@triton.jit
def _doc_select(vals, bits, N: tl.constexpr):
    """vals[σ] where bit σ of ``bits`` is set (token t-σ in t's document, ``doc_window``), else 0, for σ < N."""
    out = ()
    for sg in tl.static_range(N):
        out = out + (tl.where(((bits >> sg) & 1) != 0, vals[sg], 0.0),)
    return out


@triton.jit
def _doc_masked(vals, bits, N: tl.constexpr, FAST: tl.constexpr):
    """``_doc_select``; with FAST only when a document boundary (or the row's start) lies in the window, a branch
    that is the same for the whole program (else every bit is set and the selects change nothing)."""
    out = vals
    if FAST:
        full = (1 << N) - 1
        if (bits & full) != full:
            out = _doc_select(vals, bits, N)
    else:
        out = _doc_select(vals, bits, N)
    return out


@triton.jit
def _zeros(N: tl.constexpr, BD: tl.constexpr):
    """A tuple of N (BD,) fp32 zeros: accumulators held in registers."""
    out = ()
    for _ in tl.static_range(N):
        out = out + (tl.zeros((BD,), dtype=tl.float32),)
    return out


@triton.jit
def _taps(taps_ptr, offs_d, mask_d, D, K_MAX, KS: tl.constexpr):
    """The taps of a channel tile, a tuple over the (view, tap) pairs, view by view."""
    c = ()
    for j in tl.static_range(len(KS)):
        for tau in tl.static_range(tl.constexpr(KS[j])):
            c = c + (tl.load(taps_ptr + (j * K_MAX + tau) * D + offs_d, mask=mask_d, other=0.0),)
    return c


@triton.jit
def _serial_start(x_ptr, taps_ptr, qg_ptr, near_ptr, S, n_buf, p_off, B, T, D, K_MAX, CH,
                  KS: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr):
    """What a serial program (grid: source and channel tile with the sources fastest, chunk of CH tokens, row)
    holds before its first token: (s, chunk, b, offs_d, mask_d, x_row, near_row, the taps (a tuple over the
    (view, tap) pairs, view by view), the queries (a tuple over the views), t0, t1 (its tokens), the window
    x[t0-1-σ] for σ < KW)."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    b = tl.program_id(2)
    s = pid % S
    offs_d = (pid // S) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x_row = x_ptr + _src_off(s, b, B, T, D, n_buf, p_off)
    c = _taps(taps_ptr, offs_d, mask_d, D, K_MAX, KS)
    qg = ()
    for j in tl.static_range(len(KS)):
        qg = qg + (tl.load(qg_ptr + j * D + offs_d, mask=mask_d, other=0.0),)
    t0 = chunk * CH
    t1 = tl.minimum(t0 + CH, T)
    xw = ()
    for sg in tl.static_range(KW):
        tt = t0 - 1 - sg
        xw = xw + (tl.load(x_row + tt * D + offs_d, mask=mask_d & (tt >= 0), other=0.0).to(tl.float32),)
    return s, chunk, b, offs_d, mask_d, x_row, near_ptr + b.to(tl.int64) * T, c, qg, t0, t1, xw


@triton.jit
def _stats_loads(x_row, near_row, dr_ptr, t, ok, b, B, T, D, offs_d, mask_d, KS: tl.constexpr, DR: tl.constexpr):
    """What one step of ``_stats_serial_kernel`` loads for token t (nothing where ``ok`` is false), as one flat
    tuple: the window bits, x[t], then (with DR) dR_j[t] per view."""
    md = mask_d & ok
    out = (tl.load(near_row + t, mask=ok, other=0),
           tl.load(x_row + t * D + offs_d, mask=md, other=0.0).to(tl.float32))
    if DR:
        for j in tl.static_range(len(KS)):
            out = out + (tl.load(dr_ptr + ((j * B + b).to(tl.int64) * T + t) * D + offs_d, mask=md,
                                 other=0.0).to(tl.float32),)
    return out


@triton.jit(do_not_specialize=("S", "n_buf"))  # counts of sources: one compile for every count
def _stats_serial_kernel(
    x_ptr,  # sources (S, B, T, d)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    qg_ptr,  # gain-folded queries (m, d) fp32
    near_ptr,  # document window bits (B, T) int32 (``doc_window``)
    dr_ptr,  # dL/dR (m, B, T, d) fp32 (or bf16: Blocks.grad_streams), read in fp32 (with DR)
    part_ptr,  # result: per channel tile, with QS qg_j·E_j and ‖E_j‖², with DR dR_j·E_j: (n_dt, 2·QS + DR, m, S, B, T)
    S, n_buf, p_off, B, T, D, K_MAX, CH,
    KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr,
    FAST: tl.constexpr,  # the document masks only where a boundary lies in the window (``_doc_masked``)
    QS: tl.constexpr,  # reduce qg_j·E_j and ‖E_j‖² (the logits; the backward can take them from the forward)
    DR: tl.constexpr,  # reduce dR_j·E_j (the backward; the forward's split pass 1 has no dR)
    PREFETCH: tl.constexpr,  # load token t+1 during step t
    PAIRS: tl.constexpr = False,  # two tokens a trip of the loop (their loads a step ahead, as PREFETCH)
    PM: tl.constexpr = 0,  # 0: parts in planes; M_PAD: token-major, (n_dt, S, B, T, 2·QS + DR, M_PAD)
):
    """The stats kernel's reductions over the channels, split by channel tile: one program per (source,
    channel tile), chunk of CH tokens and row walks its tokens one at a time, with the taps and the last KW source
    values in registers (each source element loaded once, not once per tap), builds E_j[t] and reduces
    qg_j·E_j[t] and ‖E_j[t]‖² (QS) and dR_j[t]·E_j[t] (DR) over its BD channels (one warp: the sums stay inside it).
    The backward runs it with DR, and with QS unless the forward saved its logits and ρ; ``stats_from_parts`` sums
    the tiles and finishes w, κ, μ per (view, source, token). The split forward runs it with QS alone (its
    pass 1, ``forward``). With PM (M_PAD) the parts are token-major (``Blocks.parts_layout="token"``): a token's
    sums of one statistic over the views side by side (pad views 0), stored as one vector (``_vector``)."""
    s, chunk, b, offs_d, mask_d, x_row, near_row, c, qg, t0, t1, xw = _serial_start(
        x_ptr, taps_ptr, qg_ptr, near_ptr, S, n_buf, p_off, B, T, D, K_MAX, CH, KS, KW, BD)
    plane = (PM if PM else len(KS)) * S * B * T  # one statistic of every (view, source, token)
    tile = (tl.program_id(0) // S).to(tl.int64)
    if QS:  # this channel tile's sums: 2·QS + DR statistics
        if DR:
            base = part_ptr + tile * 3 * plane
        else:
            base = part_ptr + tile * 2 * plane
    else:
        base = part_ptr + tile * plane
    t = t0
    nxt = _stats_loads(x_row, near_row, dr_ptr, t, t < t1, b, B, T, D, offs_d, mask_d, KS, DR)
    if PAIRS:  # two tokens a trip: the window moves two places a trip, and no load waits in a copy
        while t + 1 < t1:
            second = _stats_loads(x_row, near_row, dr_ptr, t + 1, True, b, B, T, D, offs_d, mask_d, KS, DR)
            xw = _stats_step(nxt, xw, c, qg, t, s, b, S, B, T, base, plane, KS, KOFF, KW, FAST, QS, DR, PM)
            nxt = _stats_loads(x_row, near_row, dr_ptr, t + 2, t + 2 < t1, b, B, T, D, offs_d, mask_d, KS, DR)
            xw = _stats_step(second, xw, c, qg, t + 1, s, b, S, B, T, base, plane, KS, KOFF, KW, FAST, QS, DR, PM)
            t += 2
        while t < t1:  # an odd chunk's last token (nxt holds its loads)
            xw = _stats_step(nxt, xw, c, qg, t, s, b, S, B, T, base, plane, KS, KOFF, KW, FAST, QS, DR, PM)
            t += 1
    else:
        while t < t1:
            if PREFETCH:
                cur = nxt
                nxt = _stats_loads(x_row, near_row, dr_ptr, t + 1, t + 1 < t1, b, B, T, D, offs_d, mask_d, KS, DR)
            else:
                cur = _stats_loads(x_row, near_row, dr_ptr, t, t < t1, b, B, T, D, offs_d, mask_d, KS, DR)
            xw = _stats_step(cur, xw, c, qg, t, s, b, S, B, T, base, plane, KS, KOFF, KW, FAST, QS, DR, PM)
            t += 1


@triton.jit
def _stats_step(cur, xw, c, qg, t, s, b, S, B, T, base, plane, KS: tl.constexpr, KOFF: tl.constexpr,
                KW: tl.constexpr, FAST: tl.constexpr, QS: tl.constexpr, DR: tl.constexpr, PM: tl.constexpr = 0):
    """One token of ``_stats_serial_kernel``: the window takes x[t] (``cur``: ``_stats_loads`` of t), E_j[t] is built
    from it and its sums over the tile's channels stored: a scalar a (statistic, view), or with PM one vector of PM
    a statistic (the views side by side, pad views 0; token-major parts). Returns the window."""
    xw = (cur[1],) + xw[:KW - 1]
    xm = _doc_masked(xw, cur[0], KW, FAST)
    qs = ()  # with PM: the sums of every view, a tuple a statistic
    ss = ()
    ds = ()
    for j in tl.static_range(len(KS)):
        e = c[KOFF[j]] * xm[0]
        for tau in tl.static_range(1, tl.constexpr(KS[j])):
            e += c[KOFF[j] + tau] * xm[tau]
        if PM:
            if QS:
                qs = qs + (tl.sum(qg[j] * e, axis=0),)
                ss = ss + (tl.sum(e * e, axis=0),)
            if DR:
                ds = ds + (tl.sum(cur[2 + j] * e, axis=0),)
        else:
            idx = ((j * S + s) * B + b).to(tl.int64) * T + t
            if QS:
                tl.store(base + idx, tl.sum(qg[j] * e, axis=0))
                tl.store(base + plane + idx, tl.sum(e * e, axis=0))
                if DR:
                    tl.store(base + 2 * plane + idx, tl.sum(cur[2 + j] * e, axis=0))
            else:
                tl.store(base + idx, tl.sum(cur[2 + j] * e, axis=0))
    if PM:  # (s, b, t)'s row of 2·QS + DR vectors of PM
        row = base + ((s * B + b).to(tl.int64) * T + t) * ((2 * QS + DR) * PM)
        lanes = tl.arange(0, PM)
        if QS:
            tl.store(row + lanes, _vector(qs, PM))
            tl.store(row + PM + lanes, _vector(ss, PM))
            if DR:
                tl.store(row + 2 * PM + lanes, _vector(ds, PM))
        else:
            tl.store(row + lanes, _vector(ds, PM))
    return xw


@triton.jit
def _vector(vals, N: tl.constexpr):
    """A tuple of at most N fp32 scalars as a (N,) tensor, in order, zeros past its end: a select a scalar
    (``tl.where`` on the element's index). The scalars are warp reductions, held by every lane, so a lane keeps its
    own element with selects on predicates that do not change from token to token. (Built with ``tl.join``, the
    inverse of ``_scalars``, the vector took 18 layout conversions in pass 1 and 719 instructions a trip against 682
    at `small`: the joined vector lies in one thread and is spread over the lanes to be stored.)"""
    lanes = tl.arange(0, N)
    v = tl.zeros((N,), dtype=tl.float32)
    for r in tl.static_range(len(vals)):
        v = tl.where(lanes == r, vals[r], v)
    return v


# --- the small steps between the kernels, fused (``Blocks.glue="triton"``; PyTorch's twins are the spec) -------------
GLUE_BN = 128  # tokens a program of the glue kernels


@triton.jit
def _softmax_parts_kernel(parts_ptr, logits_ptr, rho_ptr, lse_ptr, w_ptr, n_dt, S, N, d, eps,
                          M: tl.constexpr, KEY_NORM: tl.constexpr, LEAN: tl.constexpr, BN: tl.constexpr,
                          PM: tl.constexpr = 0):
    """The split forward between its passes, for BN of the N = B·T tokens and one view j: from pass 1's per-tile
    sums parts (n_dt, 2, m, S, N) (qg·E, ‖E‖²): ρ = (‖E‖²/d + eps)^-½ (KEY_NORM), logits = qg·E ρ (m, S, N), their
    lse over the sources (m, N) by a running maximum, and the weights w = exp(logits - lse), (m, S, N) or with LEAN
    (N, S, m). One program a (token block, view): the views are independent, and a grid over the tokens alone (the
    views a loop) ran 128 programs at `small`, too few to fill the GPU. ``_softmax_parts_torch`` is its twin. With PM
    (M_PAD) the parts are token-major, (n_dt, S, N, 2, PM) (``Blocks.parts_layout="token"``): the same sums, read
    2·PM floats apart."""
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = offs < N
    j = tl.program_id(1)
    plane = S * N  # one view's (S, N) block
    mx = tl.full((BN,), float("-inf"), tl.float32)
    se = tl.zeros((BN,), dtype=tl.float32)
    s = 0
    while s < S:
        q = tl.zeros((BN,), dtype=tl.float32)
        ss = tl.zeros((BN,), dtype=tl.float32)
        tile = 0
        while tile < n_dt:
            if PM:  # (tile, s, token, statistic, view)
                at = ((tile * S + s).to(tl.int64) * N + offs) * (2 * PM) + j
                q += tl.load(parts_ptr + at, mask=mask, other=0.0)
                ss += tl.load(parts_ptr + at + PM, mask=mask, other=0.0)
            else:
                at = ((tile * 2 * M + j) * S + s).to(tl.int64) * N + offs
                q += tl.load(parts_ptr + at, mask=mask, other=0.0)
                ss += tl.load(parts_ptr + at + M * plane, mask=mask, other=0.0)
            tile += 1
        if KEY_NORM:
            rho = tl.rsqrt(ss / d + eps)
            tl.store(rho_ptr + (j * S + s).to(tl.int64) * N + offs, rho, mask=mask)
            logit = q * rho
        else:
            logit = q
        tl.store(logits_ptr + (j * S + s).to(tl.int64) * N + offs, logit, mask=mask)
        top = tl.maximum(mx, logit)
        se = se * tl.exp(mx - top) + tl.exp(logit - top)
        mx = top
        s += 1
    lse = mx + tl.log(se)
    tl.store(lse_ptr + j * N + offs, lse, mask=mask)
    _store_weights(logits_ptr, w_ptr, lse, offs, mask, j, S, N, M, LEAN)  # each lane reads back what it stored above


@triton.jit
def _store_weights(logits_ptr, w_ptr, lse, offs, mask, j, S, N, M: tl.constexpr, LEAN: tl.constexpr):
    """w = exp(logit - lse) of view j over the S sources for the tokens offs, from the logits (m, S, N), into w
    (m, S, N) or with LEAN (N, S, m): one expression for the forward (``_softmax_parts_kernel``) and the rebuild of its
    weights in backward (``_weights_kernel``), so that the two agree to the bit."""
    s = 0
    while s < S:
        w = tl.exp(tl.load(logits_ptr + (j * S + s).to(tl.int64) * N + offs, mask=mask, other=0.0) - lse)
        if LEAN:
            tl.store(w_ptr + (offs.to(tl.int64) * S + s) * M + j, w, mask=mask)
        else:
            tl.store(w_ptr + (j * S + s).to(tl.int64) * N + offs, w, mask=mask)
        s += 1


@triton.jit
def _weights_kernel(logits_ptr, lse_ptr, w_ptr, S, N, M: tl.constexpr, LEAN: tl.constexpr, BN: tl.constexpr):
    """The split forward's weights again from its saved logits (m, S, N) and lse (m, N) (``rebuild_weights``), as
    ``_softmax_parts_kernel`` wrote them: a program a (token block, view)."""
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = offs < N
    j = tl.program_id(1)
    lse = tl.load(lse_ptr + j * N + offs, mask=mask, other=0.0)
    _store_weights(logits_ptr, w_ptr, lse, offs, mask, j, S, N, M, LEAN)


def _softmax_parts_torch(parts: Tensor, *, key_norm: bool, eps: float, d: int, lean: bool):
    """(logits, ρ or None, lse, w) from pass 1's parts (n_dt, 2, m, S, B, T), in PyTorch: the spec of
    ``_softmax_parts_kernel``. w: (m, S, B, T), or with ``lean`` (B, T, S, m) (written through a permuted view)."""
    q, ss = parts.sum(0)  # (m, S, B, T) each
    rho = torch.rsqrt(ss / d + eps) if key_norm else None
    logits = q * rho if key_norm else q
    lse = torch.logsumexp(logits, dim=1)  # (m, B, T)
    return logits, rho, lse, softmax_weights(logits, lse, lean=lean)


def softmax_weights(logits: Tensor, lse: Tensor, *, lean: bool = False) -> Tensor:
    """w = exp(logits - lse) fp32 from the logits (m, S, B, T) and their lse over the sources (m, B, T): (m, S, B,
    T), or with ``lean`` (B, T, S, m), a (token, source)'s weights side by side as the lean pass 2 reads them
    (written through a permuted view: no copy)."""
    if not lean:
        return torch.exp(logits - lse[:, None])
    m, S, B, T = logits.shape
    w = torch.empty(B, T, S, m, device=logits.device, dtype=torch.float32)
    torch.exp(logits - lse[:, None], out=w.permute(3, 2, 0, 1))
    return w


def rebuild_weights(logits: Tensor, lse: Tensor, *, lean: bool, glue: str) -> Tensor:
    """The weights the split forward's pass 2 took, again from its logits and lse: ``softmax_weights`` where its glue
    was PyTorch's, else the glue kernel's own expression (``_store_weights``): the same floats either way."""
    if glue == "torch":
        return softmax_weights(logits, lse, lean=lean)
    m, S, B, T = logits.shape
    w = torch.empty((B, T, S, m) if lean else (m, S, B, T), device=logits.device, dtype=torch.float32)
    _weights_kernel[(triton.cdiv(B * T, GLUE_BN), m)](logits, lse, w, S, B * T, M=m, LEAN=lean, BN=GLUE_BN)
    return w


def parts_buffer(n_dt: int, k: int, m: int, S: int, B: int, T: int, *, token: bool, device) -> tuple[Tensor, Tensor]:
    """(memory, view) of the serial stats kernel's per-tile sums: k statistics of m views, viewed (n_dt, k, m, S, B,
    T) in either layout: planes, or token-major (n_dt, S, B, T, k, M_PAD) (``Blocks.parts_layout="token"``: a
    token's sums of one statistic side by side, one vector store; the pad views hold zeros), viewed through a
    permutation of its first m views, so that PyTorch reads it unchanged."""
    if not token:
        mem = torch.empty(n_dt, k, m, S, B, T, device=device, dtype=torch.float32)
        return mem, mem
    mem = torch.empty(n_dt, S, B, T, k, triton.next_power_of_2(m), device=device, dtype=torch.float32)
    return mem, mem.permute(0, 4, 5, 1, 2, 3)[:, :, :m]


def softmax_parts(parts: Tensor, *, key_norm: bool, eps: float, d: int, lean: bool, glue: str, token: bool = False):
    """``_softmax_parts_torch`` (glue "torch") or its kernel (glue "triton"): same results, one launch. With
    ``token`` parts (n_dt, 2, m, S, B, T) is the permuted view of token-major (n_dt, S, B, T, 2, M_PAD) parts
    (``Blocks.parts_layout="token"``, ``parts_view``)."""
    if glue == "torch":
        return _softmax_parts_torch(parts, key_norm=key_norm, eps=eps, d=d, lean=lean)
    n_dt, _, m, S, B, T = parts.shape
    f32 = dict(device=parts.device, dtype=torch.float32)
    logits, lse = torch.empty(m, S, B, T, **f32), torch.empty(m, B, T, **f32)
    rho = torch.empty(m, S, B, T, **f32) if key_norm else None
    w = torch.empty(B, T, S, m, **f32) if lean else torch.empty(m, S, B, T, **f32)
    _softmax_parts_kernel[(triton.cdiv(B * T, GLUE_BN), m)](
        parts, logits, logits if rho is None else rho, lse, w, n_dt, S, B * T, d, eps, M=m, KEY_NORM=key_norm,
        LEAN=lean, BN=GLUE_BN, PM=triton.next_power_of_2(m) if token else 0)
    return logits, rho, lse, w


@triton.jit
def _gate_kernel(mparts_ptr, alpha_ptr, bias_ptr, g_ptr, z_ptr, rr_ptr, n_dt, N, md, eps,
                 M: tl.constexpr, M_PAD: tl.constexpr, SIGMOID: tl.constexpr, BN: tl.constexpr):
    """The mixer's gate for BN of the N tokens, from pass 2's per-tile sums mparts (n_dt, 1 + m, N) (‖R‖², R·φ_i):
    rr = ‖vec R‖² (N), z = R·φ (m, N), zz = α z (rr/(m·d) + eps)^-½ + b, g = σ(zz) or the softmax over the views
    (m, N). ``_gate_torch`` is its twin."""
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = offs < N
    views = tl.arange(0, M_PAD)
    vmask = views < M
    m2 = vmask[:, None] & mask[None, :]
    rr = tl.zeros((BN,), dtype=tl.float32)
    z = tl.zeros((M_PAD, BN), dtype=tl.float32)
    tile = 0
    while tile < n_dt:
        base = (tile * (1 + M)).to(tl.int64) * N
        rr += tl.load(mparts_ptr + base + offs, mask=mask, other=0.0)
        z += tl.load(mparts_ptr + base + (1 + views[:, None]) * N + offs[None, :], mask=m2, other=0.0)
        tile += 1
    zz = tl.load(alpha_ptr) * z * tl.rsqrt(rr / md + eps)[None, :] \
        + tl.load(bias_ptr + views, mask=vmask, other=0.0)[:, None]
    if SIGMOID:
        g = tl.sigmoid(zz)
    else:
        zz = tl.where(vmask[:, None], zz, float("-inf"))  # padded views out (not tokens: a lane's column stays finite)
        e = tl.exp(zz - tl.max(zz, axis=0)[None, :])
        g = e / tl.sum(e, axis=0)[None, :]
    tl.store(rr_ptr + offs, rr, mask=mask)
    tl.store(z_ptr + views[:, None] * N + offs[None, :], z, mask=m2)
    tl.store(g_ptr + views[:, None] * N + offs[None, :], g, mask=m2)


def _gate_torch(mparts: Tensor, alpha: Tensor, bias: Tensor, *, m: int, d: int, eps: float, sigmoid: bool):
    """(g (m, B, T), z (m, B, T), rr (B, T)) fp32 from pass 2's per-tile sums (n_dt, 1 + m, B, T), in PyTorch: the
    spec of ``_gate_kernel``."""
    sums = mparts.sum(0)  # (1 + m, B, T)
    rr, z = sums[0], sums[1:]
    zz = alpha * z * torch.rsqrt(rr / (m * d) + eps) + bias[:, None, None]
    g = (torch.sigmoid(zz) if sigmoid else torch.softmax(zz, dim=0)).contiguous()
    return g, z.contiguous(), rr.contiguous()


def gate(mparts: Tensor, alpha: Tensor, bias: Tensor, *, m: int, d: int, eps: float, sigmoid: bool, glue: str):
    """``_gate_torch`` (glue "torch") or its kernel (glue "triton"): same results, one launch."""
    if glue == "torch":
        return _gate_torch(mparts, alpha, bias, m=m, d=d, eps=eps, sigmoid=sigmoid)
    n_dt, _, B, T = mparts.shape
    f32 = dict(device=mparts.device, dtype=torch.float32)
    g, z, rr = torch.empty(m, B, T, **f32), torch.empty(m, B, T, **f32), torch.empty(B, T, **f32)
    _gate_kernel[(triton.cdiv(B * T, GLUE_BN),)](
        mparts, alpha, bias, g, z, rr, n_dt, B * T, m * d, eps, M=m, M_PAD=triton.next_power_of_2(m),
        SIGMOID=sigmoid, BN=GLUE_BN)
    return g, z, rr


@triton.jit
def _stats_finish_kernel(parts_ptr, lse_ptr, logits_ptr, rho_ptr, coef_ptr, n_dt, S, N, d, eps,
                         M: tl.constexpr, M_PAD: tl.constexpr, KEY_NORM: tl.constexpr, SAVED: tl.constexpr,
                         BN: tl.constexpr, TOKEN: tl.constexpr = False, PM: tl.constexpr = False):
    """``stats_from_parts`` for BN of the N tokens and one view j (a program each, as ``_softmax_parts_kernel``):
    from the serial stats kernel's per-tile sums parts (n_dt, K, m, S, N) (K = 1 with SAVED: dR·E alone, the
    forward's logits and ρ (m, S, N) given; else K = 3: qg·E, ‖E‖², dR·E) and the forward's lse (m, N), w, κ, μ into
    coef (3 of 4 planes of (M_PAD, S, N)): w = exp(logit - lse), κ = w (a - Σ_s w a) ρ, μ = κ ρ logit / d (0
    without KEY_NORM). The first sweep over the sources sums a over the tiles, keeps it in coef's κ plane (each
    lane reads back only what it wrote) and accumulates Σ_s w a; the second reads a once instead of n_dt times.
    With TOKEN, coef is token-major, (S, N, 4, M_PAD) (``Blocks.coef_layout="token"``: a token's w, κ, μ of every
    view side by side, one load of the serial source-gradient kernel); the same values, written 4·M_PAD floats
    apart. With PM the parts are token-major, (n_dt, S, N, K, M_PAD) (``Blocks.parts_layout="token"``)."""
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = offs < N
    j = tl.program_id(1)
    K: tl.constexpr = 1 if SAVED else 3
    plane = S * N  # one view's (S, N) block
    cplane = M_PAD * plane  # one of coef's planes
    lse = tl.load(lse_ptr + j * N + offs, mask=mask, other=0.0)
    wa = tl.zeros((BN,), dtype=tl.float32)
    for sweep in tl.static_range(2):  # Σ_s w a first, then κ and μ
        s = 0
        while s < S:
            at = (j * S + s).to(tl.int64) * N + offs
            if TOKEN:  # (s, token, plane, view): planes M_PAD floats apart
                out = coef_ptr + (s * N + offs).to(tl.int64) * (4 * M_PAD) + j
                cp = M_PAD
            else:
                out = coef_ptr + at
                cp = cplane
            q = tl.zeros((BN,), dtype=tl.float32)
            ss = tl.zeros((BN,), dtype=tl.float32)
            if sweep == 0:
                a = tl.zeros((BN,), dtype=tl.float32)
                tile = 0
                while tile < n_dt:
                    if PM:  # (tile, s, token, statistic, view)
                        pt = ((tile * S + s).to(tl.int64) * N + offs) * (K * M_PAD) + j
                        pp = M_PAD
                    else:
                        pt = ((tile * K * M + j) * S + s).to(tl.int64) * N + offs
                        pp = M * plane
                    if SAVED:
                        a += tl.load(parts_ptr + pt, mask=mask, other=0.0)
                    else:
                        q += tl.load(parts_ptr + pt, mask=mask, other=0.0)
                        ss += tl.load(parts_ptr + pt + pp, mask=mask, other=0.0)
                        a += tl.load(parts_ptr + pt + 2 * pp, mask=mask, other=0.0)
                    tile += 1
                tl.store(out + cp, a, mask=mask)
                if not SAVED:  # ρ and the logit kept too, in the planes w and μ
                    tl.store(out, q, mask=mask)
                    tl.store(out + 2 * cp, ss, mask=mask)
            else:
                a = tl.load(out + cp, mask=mask, other=0.0)
                if not SAVED:
                    q = tl.load(out, mask=mask, other=0.0)
                    ss = tl.load(out + 2 * cp, mask=mask, other=0.0)
            if SAVED:
                logit = tl.load(logits_ptr + at, mask=mask, other=0.0)
                if KEY_NORM:
                    rho = tl.load(rho_ptr + at, mask=mask, other=0.0)
                else:
                    rho = tl.full((BN,), 1.0, tl.float32)
            else:
                if KEY_NORM:
                    rho = tl.rsqrt(ss / d + eps)
                else:
                    rho = tl.full((BN,), 1.0, tl.float32)
                logit = q * rho
            w = tl.exp(logit - lse)
            if sweep == 0:
                wa += w * a
            else:
                kappa = w * (a - wa) * rho
                tl.store(out, w, mask=mask)
                tl.store(out + cp, kappa, mask=mask)
                if KEY_NORM:
                    tl.store(out + 2 * cp, kappa * rho * logit / d, mask=mask)
                else:
                    tl.store(out + 2 * cp, tl.zeros((BN,), dtype=tl.float32), mask=mask)
            s += 1


def stats_from_parts(parts: Tensor, lse: Tensor, coef: Tensor, *, key_norm: bool, eps: float, d: int,
                     saved: tuple[Tensor, Tensor | None] | None = None) -> None:
    """w, κ, μ into coef[0:3, :m] from the serial stats kernel's per-tile sums (n_dt, 3, m, S, B, T) and the
    forward's lse (m, B, T), as the tile stats kernel computes them: ρ = (‖E‖²/d + eps)^-½ (1 without key norm),
    logit = qg·E ρ, w = exp(logit - lse), a = dR·E, κ = w (a - Σ_s w a) ρ, μ = κ ρ logit / d. With ``saved``, the
    forward's (logits, ρ) (m, S, B, T) (``forward(save_stats=True)``), the parts hold a alone (n_dt, 1, m, S, B, T)."""
    if saved is None:
        q, ss, a = parts.sum(0)  # (m, S, B, T) each
        rho = torch.rsqrt(ss / d + eps) if key_norm else torch.ones_like(ss)
        logit = q * rho
    else:
        a = parts.sum(0)[0]
        logit, rho = saved
        if rho is None:
            rho = torch.ones_like(logit)
    m = a.shape[0]
    w = torch.exp(logit - lse[:, None])
    kappa = w * (a - (w * a).sum(1, keepdim=True)) * rho
    coef[0, :m] = w
    coef[1, :m] = kappa
    coef[2, :m] = kappa * rho * logit / d if key_norm else 0.0


def finish_stats(parts: Tensor, lse: Tensor, coef: Tensor, *, key_norm: bool, eps: float, d: int,
                 saved: tuple[Tensor, Tensor | None] | None, glue: str, token: bool = False,
                 parts_token: bool = False) -> None:
    """``stats_from_parts`` (glue "torch", the spec) or ``_stats_finish_kernel`` (glue "triton": one launch). With
    ``token`` coef (4, M_PAD, S, B, T) is the permuted view of a token-major (S, B, T, 4, M_PAD) tensor
    (``Blocks.coef_layout="token"``). With ``parts_token`` parts (n_dt, K, m, S, B, T) is the permuted view of
    token-major (n_dt, S, B, T, K, M_PAD) parts (``Blocks.parts_layout="token"``, ``parts_view``)."""
    if glue == "torch":
        return stats_from_parts(parts, lse, coef, key_norm=key_norm, eps=eps, d=d, saved=saved)
    n_dt, _, m, S, B, T = parts.shape
    logits, rho = saved if saved is not None else (lse, None)
    _stats_finish_kernel[(triton.cdiv(B * T, GLUE_BN), m)](
        parts, lse, logits, lse if rho is None else rho, coef, n_dt, S, B * T, d, eps, M=m, M_PAD=coef.shape[1],
        KEY_NORM=key_norm, SAVED=saved is not None, BN=GLUE_BN, TOKEN=token, PM=parts_token)


@triton.jit
def _add_views(acc, xs, c, w_s, KS: tl.constexpr, KOFF: tl.constexpr):
    """acc_j + w_js E_j(x_s) for each view j (acc a tuple of m (BD,) fp32): E_j from the shifted rows xs (xs[σ] =
    x_s[t-σ]) and the taps c, summed tap by tap; w_s points at the token's m weights of source s."""
    nacc = ()
    for j in tl.static_range(len(KS)):
        e = c[KOFF[j]] * xs[0]
        for tau in tl.static_range(1, tl.constexpr(KS[j])):
            e += c[KOFF[j] + tau] * xs[tau]
        nacc = nacc + (acc[j] + tl.load(w_s + j) * e,)
    return nacc


@triton.jit
def _full_rows(x_src, D, mask_d, ok, N: tl.constexpr, BD: tl.constexpr, EVEN: tl.constexpr):
    """The N rows x[σ] = *(x_src - σ·D) of BD channels, as stored (no conversion): the channels past d masked unless
    EVEN (BD divides d), and all of them 0 where ``ok`` (a scalar, or None: always loaded) is false."""
    x_tok = x_src + tl.arange(0, BD)
    rows = ()
    for sg in tl.static_range(N):
        if ok is None:
            if EVEN:
                rows = rows + (tl.load(x_tok - sg * D),)
            else:
                rows = rows + (tl.load(x_tok - sg * D, mask=mask_d, other=0.0),)
        elif EVEN:
            rows = rows + (tl.load(x_tok - sg * D, mask=ok, other=0.0),)
        else:
            rows = rows + (tl.load(x_tok - sg * D, mask=mask_d & ok, other=0.0),)
    return rows


@triton.jit
def _split_sources_ahead(x_src, x_step, w_tok, SM, c, acc, s, s_end, D, mask_d,
                         KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
                         EVEN: tl.constexpr):
    """``_split_sources_trip``'s loop without masks (FULL: no token's window holds a document boundary) with a source's
    KW + P - 1 rows loaded one source ahead (``Blocks.split_ahead``): source s+1's rows are loaded, as stored, before
    source s's multiply-adds, so their latency overlaps them (the serial kernels' PREFETCH, one source instead of one
    token ahead). Without masks: the first rows are loaded only where the loop runs (else from source 0's address, as
    the loop's first trip would), and the last source's "next" rows are its own again (L1 hits), not a row past it."""
    M: tl.constexpr = len(KS)
    ahead = _full_rows(x_src, D, mask_d, s < s_end, KW + P - 1, BD, EVEN)
    while s < s_end:
        rows = ahead
        x_src += tl.where(s + 1 < s_end, x_step, 0)
        ahead = _full_rows(x_src, D, mask_d, None, KW + P - 1, BD, EVEN)
        nacc = ()
        for p in tl.static_range(P):
            xs = ()
            for sg in tl.static_range(KW):  # token t+p's x_s[t+p-σ] is row P-1-p+σ
                xs = xs + (rows[P - 1 - p + sg].to(tl.float32),)
            nacc = nacc + _add_views(acc[p * M:(p + 1) * M], xs, c, w_tok + p * SM + s * M, KS, KOFF)
        acc = nacc
        s += 1
    return acc


@triton.jit
def _split_sources_trip(x_src, x_step, w_tok, SM, c, acc, s, s_end, D, mask_d, bits,
                        KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
                        FULL: tl.constexpr, EVEN: tl.constexpr):
    """The lean pass 2's loop over sources s < s_end of P tokens t .. t+P-1 (P = 1, or ``Blocks.split_trip``), adding
    w_js E_j(x_s) into each token's accumulators in the plain loop's order. x_src: where source s's BD channels of
    token t+P-1 start (a scalar: a loop-carried tensor of pointers loses its contiguity, and Triton then moves it
    through shared memory), x_step from one source to the next (buffer rows: one address increment a source, no
    select); w_tok: token t's weights ((S, m) side by side; token t+p's are p·SM further, SM = S·m); acc: a flat
    tuple of P·m (BD,) fp32, token t's m accumulators first; bits: a tuple of the P tokens' window bits
    (``doc_window``: bit σ of token u's says u-σ is in the row and in u's document). With d a constant (DK) the
    shifted loads' offsets from x_src are immediates, and without any mask when EVEN (BD divides d) and FULL.

    FULL (no token's window holds a document boundary): the KW + P - 1 rows x_s[t+P-1-σ] are loaded once, without
    document masks, and token t+p's views take rows P-1-p .. P-1-p+KW-1 (x_s[t+p-σ] is row P-1-p+σ). Each token reads
    only rows of its own window, which its bits say are in the row and in its document.

    Otherwise a shared row can be in one token's document and not in another's (when t+1 starts a document, every
    row before it is t's and not t+1's), so each token loads its own KW rows under its own bits, as one token alone
    does (a set bit implies the row is in [0, T): nothing before the row's start is read; the loads of rows already
    loaded for another token are L1 hits). Loading the shared rows once under the union of the tokens' bits and
    selecting each token's by its own bit was the other way at two tokens: compiled for sm_90a at `small` its 2·KW
    selects needed a predicate each, more than the predicate registers hold, and the compiler rebuilt them every
    source (96 selects and 96 predicate operations: 616 instructions a trip of the masked loop over the buffer rows
    and 255 registers, against 476 and 241 for loading twice; one token a trip: 243)."""
    M: tl.constexpr = len(KS)
    while s < s_end:
        x_tok = x_src + tl.arange(0, BD)
        views = ()  # per token, its KW shifted rows
        if FULL:
            stored = _full_rows(x_src, D, mask_d, None, KW + P - 1, BD, EVEN)
            rows = ()
            for sg in tl.static_range(KW + P - 1):
                rows = rows + (stored[sg].to(tl.float32),)
            for p in tl.static_range(P):
                views = views + (rows[P - 1 - p:P - 1 - p + KW],)
        else:
            for p in tl.static_range(P):
                xs = ()
                for sg in tl.static_range(KW):
                    xs = xs + (tl.load(x_tok - (P - 1 - p + sg) * D, mask=mask_d & (((bits[p] >> sg) & 1) != 0),
                                       other=0.0).to(tl.float32),)
                views = views + (xs,)
        nacc = ()
        for p in tl.static_range(P):
            nacc = nacc + _add_views(acc[p * M:(p + 1) * M], views[p], c, w_tok + p * SM + s * M, KS, KOFF)
        acc = nacc
        x_src += x_step
        s += 1
    return acc


@triton.jit
def _split_trip(x_ptr, w_ptr, near_row, r_ptr, phi_ptr, mpart_ptr, c, t, b, dt, S, n_buf, p_off, B, T, D, offs_d,
                mask_d, KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
                EVEN: tl.constexpr, MIXER: tl.constexpr, AHEAD: tl.constexpr = False):
    """One trip of the lean pass 2 over tokens t .. t+P-1: their window bits, every source (the buffer rows, then the
    partial when S > n_buf, each in a loop without masks or with them: of the two loops over the same sources one
    runs and the other not at all, so no branch yields a tuple), then each token's epilogue (``_split_store``)."""
    M: tl.constexpr = len(KS)
    ones = (1 << KW) - 1  # bits 0..KW-1: a token and the earlier ones of its window
    bits = (tl.load(near_row + t),)
    full = (bits[0] & ones) == ones
    for p in tl.static_range(1, P):
        bits = bits + (tl.load(near_row + t + p),)
        full = full & ((bits[p] & ones) == ones)  # no token's window holds a boundary
    acc = _zeros(P * M, BD)
    w_tok = w_ptr + (b * T + t).to(tl.int64) * S * M
    n_rows = tl.minimum(S, n_buf)
    step = B.to(tl.int64) * T * D
    last = t + P - 1
    row0 = x_ptr + _src_off(0, b, B, T, D, n_buf, p_off) + last * D + dt * BD  # source 0 (a buffer row), last token
    part = x_ptr + _src_off(n_buf, b, B, T, D, n_buf, p_off) + last * D + dt * BD  # the partial there
    if AHEAD:
        acc = _split_sources_ahead(row0, step, w_tok, S * M, c, acc, tl.where(full, 0, n_rows), n_rows, D, mask_d,
                                   KS, KOFF, KW, BD, P, EVEN)
    else:
        acc = _split_sources_trip(row0, step, w_tok, S * M, c, acc, tl.where(full, 0, n_rows), n_rows, D, mask_d,
                                  bits, KS, KOFF, KW, BD, P, True, EVEN)
    acc = _split_sources_trip(row0, step, w_tok, S * M, c, acc, tl.where(full, n_rows, 0), n_rows, D, mask_d, bits,
                              KS, KOFF, KW, BD, P, False, EVEN)
    acc = _split_sources_trip(part, 0, w_tok, S * M, c, acc, tl.where(full, n_rows, S), S, D, mask_d, bits,
                              KS, KOFF, KW, BD, P, True, EVEN)
    acc = _split_sources_trip(part, 0, w_tok, S * M, c, acc, tl.where(full, S, n_rows), S, D, mask_d, bits,
                              KS, KOFF, KW, BD, P, False, EVEN)
    for p in tl.static_range(P):
        _split_store(acc[p * M:(p + 1) * M], t + p, b, dt, B, T, D, offs_d, mask_d, r_ptr, phi_ptr, mpart_ptr, KS,
                     MIXER, True)


@triton.jit
def _split_store(acc, t, b, dt, B, T, D, offs_d, mask_d, r_ptr, phi_ptr, mpart_ptr,
                 KS: tl.constexpr, MIXER: tl.constexpr, LEAN: tl.constexpr):
    """The epilogue of one token of ``_streams_split_kernel``: R_j[t] from acc (a tuple of m (BD,) fp32), and with
    MIXER the channel tile's ‖R[t]‖² and R[t]·φ_i."""
    for j in tl.static_range(len(KS)):
        tl.store(r_ptr + ((j * B + b).to(tl.int64) * T + t) * D + offs_d, acc[j].to(r_ptr.dtype.element_ty),
                 mask=mask_d)
    if MIXER:
        plane = B * T
        base = mpart_ptr + (dt * (1 + len(KS))).to(tl.int64) * plane + b * T + t
        if LEAN:  # each lane's views summed first: 1 + m cross-lane reductions a token
            sq = acc[0] * acc[0]
            for j in tl.static_range(1, len(KS)):
                sq += acc[j] * acc[j]
            tl.store(base, tl.sum(sq, axis=0))
            for i in tl.static_range(len(KS)):
                zv = acc[0] * tl.load(phi_ptr + i * (len(KS) * D) + offs_d, mask=mask_d, other=0.0)
                for j in tl.static_range(1, len(KS)):
                    zv += acc[j] * tl.load(phi_ptr + i * (len(KS) * D) + j * D + offs_d, mask=mask_d, other=0.0)
                tl.store(base + (1 + i) * plane, tl.sum(zv, axis=0))
        else:
            rr = 0.0
            for j in tl.static_range(len(KS)):
                rr += tl.sum(acc[j] * acc[j], axis=0)
            tl.store(base, rr)
            for i in tl.static_range(len(KS)):
                zi = 0.0
                for j in tl.static_range(len(KS)):
                    ph = tl.load(phi_ptr + i * (len(KS) * D) + j * D + offs_d, mask=mask_d, other=0.0)  # φ[j·d + c, i]
                    zi += tl.sum(acc[j] * ph, axis=0)
                tl.store(base + (1 + i) * plane, zi)


@triton.jit(do_not_specialize=("S", "n_buf"))  # counts of sources: one compile for every count
def _streams_split_kernel(
    x_ptr,  # sources (S, B, T, d) (or n_buf rows of them and the partial: _src_off)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    near_ptr,  # document window bits (B, T) int32 (``doc_window``)
    w_ptr,  # softmax weights over the sources (m, S, B, T) fp32 (pass 1); with LEAN (B, T, S, m)
    phi_ptr,  # mixer projection as φᵀ (m, m·d) fp32 (with MIXER)
    r_ptr,  # result: the streams R (m, B, T, d) in its own dtype
    mpart_ptr,  # result with MIXER: per channel tile ‖R‖² and R·φ_i, (n_dt, 1 + m, B, T) fp32
    S, n_buf, p_off, B, T, D, K_MAX, CH,
    KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr, MIXER: tl.constexpr,
    LEAN: tl.constexpr = False,  # fewer instructions a (token, source), below (``Blocks.split_lean``)
    DK: tl.constexpr = 0,  # with LEAN: d as a compile-time constant (one compile per model width)
    TRIP: tl.constexpr = 1,  # with LEAN: tokens a trip of the token loop (``Blocks.split_trip``: 2 or 4), below
    AHEAD: tl.constexpr = False,  # with LEAN: a source's rows loaded one source ahead where no mask applies (below)
):
    """The split forward's pass 2: R_j[t] = Σ_s w_js[t] E_j(x_s)[t] on BD channels, one program per (channel tile,
    chunk of CH tokens, row), the taps in registers for the whole program, tokens outer and sources inner. A source's
    views at token t come from its KW shifted loads x_s[t-σ] (each masked by bit σ of t's window: the document mask
    costs no select), shared by the views (Σ_j k_j multiply-adds an element). No reduction over the sources or the
    channels until the epilogue of a token: R_j[t] is stored, and with MIXER its channel tile's ‖R[t]‖² and
    R[t]·φ_i, which PyTorch sums over the tiles for the gate.

    LEAN computes the same sums (up to fp32 rounding in the mixer's) with fewer instructions: d a constant, so the
    shifted loads' offsets are immediates; the weights of a (token, source) side by side ((B, T, S, m): one address
    a source instead of m int64 index computations); a token whose window holds no document boundary (nearly every
    token) takes a loop over the sources without masks or predicates; the mixer's sums add each lane's m views
    first, so a token costs 1 + m cross-lane reductions instead of m + m². The instruction counts of both, compiled
    for sm_90a: ``python -m benchmarks.msar_attn_ptxas --sass`` (docs/kernel_msar.md, "The lean pass 2").

    TRIP > 1 (with LEAN) walks the chunk TRIP tokens a trip (``_split_sources_trip``): where no token's window holds
    a document boundary a source's KW + TRIP - 1 rows are loaded once for all of the trip's views (a token alone
    loads KW, and the next token KW - 1 of them again), else each token loads its own under its own mask; then each
    token's epilogue runs. A chunk's last tokens short of a trip take the one-token loop below."""
    if LEAN:
        D = DK
    dt = tl.program_id(0)
    chunk = tl.program_id(1)
    b = tl.program_id(2)
    offs_d = dt * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    c = ()
    for j in tl.static_range(len(KS)):
        for tau in tl.static_range(tl.constexpr(KS[j])):
            c = c + (tl.load(taps_ptr + (j * K_MAX + tau) * D + offs_d, mask=mask_d, other=0.0),)
    near_row = near_ptr + b.to(tl.int64) * T
    t = chunk * CH
    t1 = tl.minimum(t + CH, T)
    if LEAN and TRIP > 1:  # TRIP tokens a trip; a chunk's last tokens short of a trip fall through to the loop below
        while t + TRIP - 1 < t1:
            _split_trip(x_ptr, w_ptr, near_row, r_ptr, phi_ptr, mpart_ptr, c, t, b, dt, S, n_buf, p_off, B, T, D,
                        offs_d, mask_d, KS, KOFF, KW, BD, TRIP, DK % BD == 0, MIXER, AHEAD)
            t += TRIP
    while t < t1:
        if LEAN:
            _split_trip(x_ptr, w_ptr, near_row, r_ptr, phi_ptr, mpart_ptr, c, t, b, dt, S, n_buf, p_off, B, T, D,
                        offs_d, mask_d, KS, KOFF, KW, BD, 1, DK % BD == 0, MIXER, AHEAD)
        else:
            bits = tl.load(near_row + t)
            acc = _zeros(len(KS), BD)
            s = b * 0  # while loops: Triton 3.6's interpreter cannot take a tensor as a range bound
            while s < S:
                x_tok = x_ptr + _src_off(s, b, B, T, D, n_buf, p_off) + t * D + offs_d
                xs = ()
                for sg in tl.static_range(KW):  # x_s[t-σ] where t-σ is in the row and in t's document, else 0
                    xs = xs + (tl.load(x_tok - sg * D, mask=mask_d & (((bits >> sg) & 1) != 0), other=0.0)
                               .to(tl.float32),)
                nacc = ()
                for j in tl.static_range(len(KS)):
                    e = c[KOFF[j]] * xs[0]
                    for tau in tl.static_range(1, tl.constexpr(KS[j])):
                        e += c[KOFF[j] + tau] * xs[tau]
                    wj = tl.load(w_ptr + ((j * S + s) * B + b).to(tl.int64) * T + t)
                    nacc = nacc + (acc[j] + wj * e,)
                acc = nacc
                s += 1
            _split_store(acc, t, b, dt, B, T, D, offs_d, mask_d, r_ptr, phi_ptr, mpart_ptr, KS, MIXER, False)
        t += 1


@triton.jit
def _combine_kernel(r_ptr, g_ptr, h_ptr, rs_ptr, N, D, M: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    COPY: tl.constexpr):
    """h[n] = Σ_j g_j[n] R_j[n] over tokens n < N = B·T from the streams R (m, N, d) and g (m, N) fp32, summed in fp32,
    h (N, d) in its own dtype (from fp32 R h is rounded once, as the tile forward's; ``Blocks.combine_from="kept"``
    gives R in the kept dtype); with COPY also R into rs, the copy the mixer's backward keeps
    (``saved_streams_dtype``, e.g. bf16)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_n = offs_n < N
    mask = mask_n[:, None] & (offs_d < D)[None, :]
    h = tl.zeros((BN, BD), dtype=tl.float32)
    for j in tl.static_range(M):
        g = tl.load(g_ptr + j * N + offs_n, mask=mask_n, other=0.0)
        at = (j * N + offs_n.to(tl.int64))[:, None] * D + offs_d[None, :]
        r = tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if COPY:
            tl.store(rs_ptr + at, r.to(rs_ptr.dtype.element_ty), mask=mask)
        h += g[:, None] * r
    tl.store(h_ptr + offs_n.to(tl.int64)[:, None] * D + offs_d[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _emit_dx(dx_row, val, t, offs_d, mask_d, D, add):
    """dx_s[t] = val, added to what the row already holds when ``add`` (a buffer row that later readers wrote)."""
    ptr = dx_row + t * D + offs_d
    if add:
        val += tl.load(ptr, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(ptr, val.to(dx_row.dtype.element_ty), mask=mask_d)


@triton.jit
def _scalars(v, N: tl.constexpr):
    """The N elements of a (N,) tensor (N a power of two) as a tuple of N scalars, in order. Each level splits every
    part into its even and odd elements (``tl.split`` of the last axis of its (n/2, 2) reshape): after l levels, part
    r holds the elements whose index is r mod 2**l. Splitting the last axis keeps a thread's registers in the
    elements' order, so that the load stays one vector load (a transposed split reverses that order, and ptxas then
    loads element by element)."""
    parts = (v,)
    for lvl in tl.static_range(N):
        if (1 << lvl) < N:
            evens = ()
            odds = ()
            for r in tl.static_range(len(parts)):
                if (N >> lvl) > 2:
                    lo, hi = tl.split(tl.reshape(parts[r], ((N >> lvl) // 2, 2)))
                else:
                    lo, hi = tl.split(parts[r])
                evens = evens + (lo,)
                odds = odds + (hi,)
            parts = evens + odds
    return parts


@triton.jit
def _serial_loads(x_row, near_row, coef_ptr, dr_ptr, t, ok, s, b, S, B, T, D, plane, offs_d, mask_d,
                  SOFTMAX: tl.constexpr, KS: tl.constexpr, CM: tl.constexpr = 0):
    """What one step of ``_src_serial_kernel`` loads for token t (nothing where ``ok`` is false), as one flat
    tuple: the window bits, x[t], then per view w, κ, μ (κ = μ = 0 without SOFTMAX) and dR_j[t]. With CM (M_PAD)
    the stats are token-major (``Blocks.coef_layout="token"``, (S, B, T, 4, M_PAD)): a token's 4·M_PAD scalars
    (w, κ, μ of every view and a pad plane) are one load, split into scalars (``_scalars``)."""
    md = mask_d & ok
    out = (tl.load(near_row + t, mask=ok, other=0),
           tl.load(x_row + t * D + offs_d, mask=md, other=0.0).to(tl.float32))
    if CM:
        crow = coef_ptr + ((s * B + b).to(tl.int64) * T + t) * (4 * CM)
        cv = _scalars(tl.load(crow + tl.arange(0, 4 * CM), mask=ok, other=0.0), 4 * CM)
    for j in tl.static_range(len(KS)):
        if CM:
            out = out + (cv[j],)
            if SOFTMAX:
                out = out + (cv[CM + j], cv[2 * CM + j])
            else:
                out = out + (0.0, 0.0)
        else:
            cidx = ((j * S + s) * B + b).to(tl.int64) * T + t
            out = out + (tl.load(coef_ptr + cidx, mask=ok, other=0.0),)
            if SOFTMAX:
                out = out + (tl.load(coef_ptr + plane + cidx, mask=ok, other=0.0),
                             tl.load(coef_ptr + 2 * plane + cidx, mask=ok, other=0.0))
            else:
                out = out + (0.0, 0.0)
        out = out + (tl.load(dr_ptr + ((j * B + b).to(tl.int64) * T + t) * D + offs_d, mask=md,
                             other=0.0).to(tl.float32),)
    return out


@triton.jit
def _src_step(cur, t, t0, t1, xw, dw, dq, dc, c, qg, dx_row, offs_d, mask_d, D, add, SOFTMAX: tl.constexpr,
              KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, FAST: tl.constexpr):
    """One token of ``_src_serial_kernel`` (``cur``: ``_serial_loads`` of t): dx[t-KW] written, then E_j[t], dE_j[t],
    the query and tap gradients and the scattered conv adjoint. Returns the window, the dx accumulators and the
    query and tap gradients."""
    zero = tl.zeros_like(qg[0])
    bits = cur[0]
    xw = (cur[1],) + xw[:KW - 1]
    xm = _doc_masked(xw, bits, KW, FAST)  # x[t-σ] where t-σ is in the row and in t's document, else 0
    if t - KW >= t0:  # dx[t-KW] has every contribution (dE[t-KW .. t-1])
        _emit_dx(dx_row, dw[KW - 1], t - KW, offs_d, mask_d, D, add)
    own = (t < t1).to(tl.float32)  # the tokens past the chunk are the next program's for dqg and dc
    de = ()
    nq = ()
    nc = ()
    for j in tl.static_range(len(KS)):
        w = cur[2 + 4 * j]
        dr = cur[5 + 4 * j]
        if SOFTMAX:
            kappa = cur[3 + 4 * j]
            mu = cur[4 + 4 * j]
            e = c[KOFF[j]] * xm[0]
            for tau in tl.static_range(1, tl.constexpr(KS[j])):
                e += c[KOFF[j] + tau] * xm[tau]
            dej = w * dr + kappa * qg[j] - mu * e
            nq = nq + (dq[j] + (own * kappa) * e,)
        else:  # one source: κ = μ = 0, no views
            dej = w * dr
            nq = nq + (dq[j],)
        de = de + (dej,)
        deo = own * dej
        for tau in tl.static_range(tl.constexpr(KS[j])):
            nc = nc + (dc[KOFF[j] + tau] + deo * xm[tau],)
    dq = nq
    dc = nc
    # scatter: the window moves one token (dw[τ] is now dx[t-τ]), then dx[t-τ] += Σ_j c_τ^{(j)} ⊙ dE_j[t]
    g = ()  # Σ_j c_τ^{(j)} ⊙ dE_j[t], τ < KW
    for tau in tl.static_range(KW):
        gt = zero
        for j in tl.static_range(len(KS)):
            if tau < KS[j]:
                gt += c[KOFF[j] + tau] * de[j]
        g = g + (gt,)
    g = _doc_masked(g, bits, KW, FAST)  # only into dx of t's document
    nw = (g[0],)
    for tau in tl.static_range(1, KW):
        nw = nw + (dw[tau - 1] + g[tau],)
    dw = nw
    return xw, dw, dq, dc


@triton.jit(do_not_specialize=("S", "n_buf", "n_add"))  # counts of sources: one compile for every count
def _src_serial_kernel(
    x_ptr,  # sources (S, B, T, d)
    taps_ptr,  # packed taps (M_PAD, K_MAX, d) fp32
    qg_ptr,  # gain-folded queries (m, d) fp32
    near_ptr,  # document window bits (B, T) int32 (``doc_window``)
    dr_ptr,  # dL/dR (m, B, T, d) fp32 (or bf16: Blocks.grad_streams), read in fp32
    coef_ptr,  # w, κ, μ (3, M_PAD, S, B, T) fp32
    dx_ptr,  # result: dL/dx, as for ``_src_kernel`` (rows added into below n_add; the partial at q_off)
    dqg_ptr,  # result: partial dL/d(q ⊙ g) (n_part, m, d) fp32, one row per program
    dtap_ptr,  # result: partial dL/dc (n_part, NPAIR, d) fp32, (view, tap) pairs view by view
    S, n_buf, p_off, n_add, q_off, B, T, D, K_MAX, plane, CH, n_chunks,
    SOFTMAX: tl.constexpr, KS: tl.constexpr, KOFF: tl.constexpr, KW: tl.constexpr, NPAIR: tl.constexpr,
    BD: tl.constexpr, PREFETCH: tl.constexpr,  # load token t+1 during step t
    FAST: tl.constexpr,  # the document masks only where a boundary lies in the window (``_doc_masked``)
    CM: tl.constexpr = 0,  # 0: w, κ, μ in planes (3, M_PAD, S, B, T); M_PAD: token-major (S, B, T, 4, M_PAD)
    AHEAD2: tl.constexpr = False,  # with PREFETCH: token t+2's loads issued during step t (Blocks.serial_ahead2)
):
    """Gradients of one source's row on CH tokens and BD channels, walking the tokens one at a time
    (one program per (source, channel tile), chunk, row; the sources vary fastest, so that the programs
    that read the same dR run side by side). Each thread holds its channels' state in registers:
    the taps c (Σ_j k_j), the last KW source values x[t-σ], the dx accumulators of the KW tokens that
    dE[t] reaches (dx[t-τ] += c_τ^{(j)} ⊙ dE_j[t]: the conv adjoint, scattered), and the tap and query
    gradients summed over the program's tokens. Per token t:
        E_j[t]  = Σ_{σ<k_j} c_σ^{(j)} ⊙ x[t-σ] · [t-σ in t's document]
        dE_j[t] = w dR_j[t] + κ qg_j - μ E_j[t]     (the stats kernel's w, κ, μ)
        dqg_j += κ E_j[t],   dc_σ^{(j)} += dE_j[t] ⊙ x[t-σ] · [same document]
        dx[t-τ] += Σ_j c_τ^{(j)} ⊙ dE_j[t] · [same document]
    dx[t-KW] is final after token t-1 and is written then. The program runs KW - 1 tokens past its
    chunk (the dE of the next tokens reaches back into it) without counting them in dqg and dc. No
    scratch, no barriers, no shared memory: the only loads are one token of x, of dR and of the
    stats a step, and the window bits (with PREFETCH issued one step ahead, so that their latency overlaps
    a step's arithmetic)."""
    s, chunk, b, offs_d, mask_d, x_row, near_row, c, qg, t0, t1, xw = _serial_start(
        x_ptr, taps_ptr, qg_ptr, near_ptr, S, n_buf, p_off, B, T, D, K_MAX, CH, KS, KW, BD)
    dx_row = dx_ptr + _src_off(s, b, B, T, D, n_buf, q_off)
    add = s < n_add
    t_end = tl.minimum(t1 + KW - 1, T)
    dw = _zeros(KW, BD)  # dx[t-1-τ] accumulators, τ < KW
    dq = _zeros(len(KS), BD)  # the query gradients, summed over the program's tokens
    dc = _zeros(NPAIR, BD)  # the tap gradients, (view, tap) pairs view by view
    t = t0
    nxt = _serial_loads(x_row, near_row, coef_ptr, dr_ptr, t, t < t_end, s, b, S, B, T, D, plane, offs_d, mask_d,
                        SOFTMAX, KS, CM)
    if AHEAD2:  # a second token in flight: t+1's loads, then t+2's during step t
        nxt2 = _serial_loads(x_row, near_row, coef_ptr, dr_ptr, t + 1, t + 1 < t_end, s, b, S, B, T, D, plane,
                             offs_d, mask_d, SOFTMAX, KS, CM)
    while t < t_end:
        if PREFETCH:
            cur = nxt
            if AHEAD2:
                nxt = nxt2
                nxt2 = _serial_loads(x_row, near_row, coef_ptr, dr_ptr, t + 2, t + 2 < t_end, s, b, S, B, T, D,
                                     plane, offs_d, mask_d, SOFTMAX, KS, CM)
            else:
                nxt = _serial_loads(x_row, near_row, coef_ptr, dr_ptr, t + 1, t + 1 < t_end, s, b, S, B, T, D,
                                    plane, offs_d, mask_d, SOFTMAX, KS, CM)
        else:
            cur = _serial_loads(x_row, near_row, coef_ptr, dr_ptr, t, t < t_end, s, b, S, B, T, D, plane, offs_d,
                                mask_d, SOFTMAX, KS, CM)
        xw, dw, dq, dc = _src_step(cur, t, t0, t1, xw, dw, dq, dc, c, qg, dx_row, offs_d, mask_d, D, add,
                                   SOFTMAX, KS, KOFF, KW, FAST)
        t += 1
    for tau in tl.static_range(KW):  # the last KW tokens' dx: dw[τ] = dx[t_end-1-τ]
        tt = t_end - 1 - tau
        if tt >= t0:
            if tt < t1:
                _emit_dx(dx_row, dw[tau], tt, offs_d, mask_d, D, add)
    part = ((b * n_chunks + chunk) * S + s).to(tl.int64)
    for j in tl.static_range(len(KS)):
        tl.store(dqg_ptr + (part * len(KS) + j) * D + offs_d, dq[j], mask=mask_d)
    for p in tl.static_range(NPAIR):
        tl.store(dtap_ptr + (part * NPAIR + p) * D + offs_d, dc[p], mask=mask_d)


@triton.jit
def _doc_window_kernel(doc_ptr, near_ptr, T, BT: tl.constexpr):
    """Window bits of one block of tokens: bit τ of near[t] is [t-τ >= 0 and doc(t-τ) = doc(t)],
    bit 16 + τ is [t+τ < T and doc(t+τ) = doc(t)], for τ < 16."""
    tb = tl.program_id(0)
    b = tl.program_id(1)
    offs = tb * BT + tl.arange(0, BT)
    mask = offs < T
    row = doc_ptr + b.to(tl.int64) * T
    doc = tl.load(row + offs, mask=mask, other=0)
    one = tl.full((BT,), 1, dtype=tl.int32)
    bits = tl.zeros((BT,), dtype=tl.int32)
    for tau in tl.static_range(16):
        ok = mask & (offs - tau >= 0)
        ok = ok & (tl.load(row + offs - tau, mask=ok, other=0) == doc)
        bits = bits | tl.where(ok, one << tau, 0)
        ok = mask & (offs + tau < T)
        ok = ok & (tl.load(row + offs + tau, mask=ok, other=0) == doc)
        bits = bits | tl.where(ok, one << (16 + tau), 0)
    tl.store(near_ptr + b.to(tl.int64) * T + offs, bits, mask=mask)


def doc_window_block(T: int) -> int:
    """Tokens a program of ``_doc_window_kernel`` (over 4 warps; 1024 spills registers)."""
    return min(triton.next_power_of_2(max(T, 1)), 256)


def doc_window(doc_ids: Tensor) -> Tensor:
    """The document mask of every tap as bits, (B, T) int32: bit τ of near[b, t] says t-τ is in the
    row and in t's document, bit 16 + τ the same of t+τ (τ < 16, the longest kernel the op takes).
    One small kernel per call; the tap loops then test a bit instead of loading two document ids
    (no load whose address waits for another load)."""
    B, T = doc_ids.shape
    doc_ids = doc_ids.to(torch.int64).contiguous()
    near = torch.empty(B, T, device=doc_ids.device, dtype=torch.int32)
    bt = doc_window_block(T)
    _doc_window_kernel[(triton.cdiv(T, bt), B)](doc_ids, near, T, BT=bt, num_warps=4)
    return near


# --- launchers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Blocks:
    bd: int  # channels per tile of the forward
    single: bool  # d fits one tile: one pass over the sources
    bt: int  # tokens per program of the forward
    warps: int
    bwd_bd: int  # channels per tile of the mixer backward (and of the stats kernel when stats_bd is 0)
    bwd_bt: int  # tokens per program of the mixer backward (and of the stats kernel when stats_bt is 0)
    stats_warps: int  # warps of the stats kernel
    src_bt: int  # tokens per block of the source-gradient kernel (>= K_MAX - 1)
    src_bd: int  # channels per program of the source-gradient kernel
    src_warps: int
    sub: int  # token blocks per source-gradient program (fewer partial sums of the query and tap gradients)
    stats_bd: int = 0  # channels per tile of the stats kernel (0: bwd_bd)
    stats_bt: int = 0  # tokens per program of the stats kernel (0: bwd_bt)
    mix_warps: int = 4  # warps of the mixer backward (tiles of (m, bwd_bt, bwd_bd) of the saved streams)
    one_source_warps: int = 0  # warps of the forward over one source (attnres_conv's op); 0: ``warps``
    # the views built from loads in the (m, BT, BD) view tile's own layout instead of (BT, BD) tiles and (BD,)
    # tap rows placed into it: compiled for sm_90a at `small` (`python -m benchmarks.msar_attn_ptxas
    # --views-3d`), the forward's layout conversions 51 -> 9, its shared memory 4096 -> 256 bytes and its
    # spills 36 -> 0 bytes; the stats kernel's conversions 37 -> 7. Off: timed on an H200 at `small` the forward
    # 5% faster but the streams backward 4% slower, at `medium` equal (msar_tiles_nvidia_h200_views_*.md).
    views_3d: bool = False
    # the source-gradient kernel: "serial" (``_src_serial_kernel``: one program per source, channel tile, chunk of
    # serial_ch tokens and row, walking its tokens one at a time with its state in registers) or "ring"
    # (``_src_kernel``: all sources a program, token blocks of src_bt through a scratch ring of dE)
    src_mode: str = "serial"
    # channels per serial program, two a thread at 4 warps: H200, one process, 1.584 -> 1.399 ms at `small` and
    # 5.711 -> 5.068 ms at `medium` against 128 (S = 5, msar_tiles_nvidia_h200_serial_bd.md; ptxas: 255 registers,
    # 32 bytes spilled)
    serial_bd: int = 256
    serial_warps: int = 4
    serial_ch: int = 128  # tokens per serial program (it also walks K_MAX - 1 past them)
    serial_prefetch: bool = True  # the serial kernel loads token t+1 during step t
    # with serial_prefetch, the source-gradient kernel with two tokens' loads in flight (t+1's and t+2's issued during
    # step t), for its steps' load latency (its warps wait on loads with 2 programs an SM). sm_90a at `small`
    # (python -m benchmarks.msar_attn_ptxas): 255 registers and 32 bytes spilled, against 252 and none. Its taps
    # loaded again every step from L1 instead of held (to make room) took more registers, not fewer: 255 and 48
    # bytes spilled (152 with both), so that was not kept. Built 2026-12-05 (last session). Timed 2026-12-05 late on an
    # H100, one process (msar_tiles_nvidia_h100_80gb_hbm3_src_ahead2.md): the streams backward 0.788 -> 1.041 ms at
    # `small` and 2.649 -> 3.578 ms at `medium` (S = 5), 32-35% slower: the spilled registers and the longer step
    # cost more than the second token in flight gains. Kept opt-in and tested, as the measured counter-example
    serial_ahead2: bool = False
    # both serial kernels: the document masks of the window (a select a tap a step) only in the steps whose window
    # holds a document boundary or the row's start, a branch the whole program takes alike (not yet timed)
    serial_fast: bool = False
    # the stats: "tile" (``_stats_kernel``: (stats_bt, stats_bd) tiles, all sources a program) or "serial"
    # (``_stats_serial_kernel``: one warp a (source, channel tile, chunk, row) program walking its tokens, then
    # ``stats_from_parts``)
    stats_mode: str = "serial"
    # 64 channels (two a lane) with the loads a step ahead: H200, one process, streams backward 0.920 -> 0.911 ms at
    # `small` and 3.131 -> 3.016 ms at `medium` (S = 5) against 32 channels without (msar_tiles_nvidia_h200_saved.md;
    # the prefetch alone at 32 channels 0.953 and 3.301: slower); ptxas 143 registers, no spills
    stats_serial_bd: int = 64
    stats_serial_ch: int = 128
    # the serial stats kernel reduces dR_j·E_j alone when the forward saved its logits and ρ (``forward(save_stats=
    # True)``, what the autograd functions do), instead of recomputing qg_j·E_j and ‖E_j‖² too (12 warp reductions
    # and stores a token, 4 with them)
    # (H200, one process, streams backward (stats + source gradients) 1.210 -> 0.919 ms at `small` and 4.308 ->
    # 3.133 ms at `medium`, S = 5, msar_tiles_nvidia_h200_saved.md)
    stats_saved: bool = True
    stats_prefetch: bool = True  # the serial stats kernel loads token t+1 during step t
    # the serial stats kernel (the backward's stats and the split forward's pass 1) two tokens a trip of its loop:
    # the window of source values moves two places a trip and the loads a step ahead need no copy (sm_90a SASS at
    # `small`: the stats' loop 241 instructions a token -> 218, pass 1's 396 -> 381). H200, one process
    # (msar_tiles_nvidia_h200_pairs.md): streams backward 0.876 -> 0.851 ms at `small`, 2.974 -> 2.932 at `medium`
    # (S = 5); the forward unchanged (0.554 / 0.557 ms); msar_block's `small` step 40.0 -> 39.1 ms
    # (throughput_small_pairs.md)
    stats_pairs: bool = True
    # the forward: "tile" (``_fwd_kernel``: (m, bt, bd) tiles, all sources a program, the views rebuilt from
    # shifted loads of the source tile for every view and tap) or "split" (pass 1: ``_stats_serial_kernel`` reduces
    # qg_j·E_j and ‖E_j‖² per channel tile of split_logit_bd channels, ``softmax_parts`` (``glue``) finishes the
    # logits, their lse and the weights; pass 2: ``_streams_split_kernel`` accumulates R_j = Σ_s w E_j(x_s) per channel tile of
    # split_bd channels on split_warps warps with the mixer's per-tile sums, writes R; ``_combine_kernel`` h)
    # H200, one process each (msar_tiles_nvidia_h200_split*.md): at `small` (S = 5) 0.842 -> 0.656 ms, at `medium`
    # 4.70 -> 2.32 ms (S = 5) and 12.05 -> 7.79 ms (S = 17, pass 1 on 64 channels)
    fwd_mode: str = "split"
    split_logit_bd: int = 128  # pass 1 on one warp, four channels a lane (0.676 -> 0.656 ms against 64 at `small`)
    split_bd: int = 128  # pass 2 on split_warps warps (64, 256 channels and 2 or 4 warps: slower)
    split_warps: int = 1
    # pass 2 with fewer instructions a (token, source) (``_streams_split_kernel``'s LEAN: d a compile-time constant,
    # the weights in (B, T, S, m), no masks where a token's window holds no document boundary, the mixer's sums
    # reduced once a view set; sm_90a SASS of its loop 310 -> 216 instructions, benchmarks.msar_attn_ptxas --sass).
    # H200, one process (msar_tiles_nvidia_h200_lean.md): forward 0.657 -> 0.613 ms at `small`, 2.314 -> 2.145 ms at
    # `medium` (S = 5); on 64 or 256 channels, 2 warps or 32 / 128 tokens a program: slower
    split_lean: bool = True
    # tokens a trip of the lean pass 2's token loop (``_streams_split_kernel``'s TRIP: 1, 2 or 4): a source's
    # K_MAX + trip - 1 shifted rows loaded once for the trip's views instead of K_MAX for each token
    # (``_split_sources_trip``); a chunk's last tokens short of a trip take the one-token loop. Two tokens (then
    # ``split_pairs``) on an H200, one process (msar_tiles_nvidia_h200_pass2_pairs.md, S = 5): forward 0.563 -> 0.485 ms
    # at `small`, 2.105 -> 1.815 at `medium` (the same results to the bit); on chunks of 128 tokens 0.626 / 1.839;
    # msar_block's `small` step 39.5 -> 38.6 / 38.4 ms (docs/kernel_msar.md, "Two tokens a trip of pass 2"). Four:
    # built and tested on the CPU, not timed (more registers: on 64 channels a program, see msar_tiles)
    split_trip: int = 2
    # the lean pass 2's unmasked loop loading a source's rows one source ahead (``_split_sources_ahead``), so their
    # latency overlaps the previous source's multiply-adds (pass 2 is latency-bound: about 7.5 one-warp programs an SM
    # issuing 0.38 instructions a cycle). sm_90a at `small` (python -m benchmarks.msar_attn_ptxas --sass): two tokens a
    # trip 243 registers as now, no spills, 392 instructions a trip of the loop against 345 (the rows' rotation); one
    # token 215 against 190 registers. Timed 2026-12-05 late on an H200, one process each, the same results to the
    # bit: the forward alone 0.450 -> 0.443 ms at `small`, 1.701 -> 1.654 at `medium`
    # (msar_tiles_nvidia_h200_pass2_ahead.md); msar_block's step 36.7-36.9 -> 36.6 ms at `small`, 344.5-344.9 ->
    # 343.1 at `medium` (throughput_*_pass2_ahead.md). The default since; False loads the rows where they are used
    split_ahead: bool = True
    # the split forward's small steps between its kernels (the softmax over the sources, the gate): "torch"
    # (PyTorch operations, about 20 launches a forward; the spec) or "triton" (one kernel each: ``softmax_parts``,
    # ``gate``). H200, one process (msar_tiles_nvidia_h200_lean2.md), the forward with both switches at once and each
    # alone: `small` (S = 5) 0.655 ms (plain pass 2, PyTorch glue) -> 0.612 (lean) / 0.592 (glue) -> 0.550 (both);
    # `medium` 2.314 -> 2.142 / 2.247 -> 2.079
    glue: str = "triton"
    # the backward's step between the stats and the source-gradient kernels (w, κ, μ from the stats' per-tile
    # sums): "torch" (about 12 launches; the spec) or "triton" (``finish_stats``' one kernel, a program a (token
    # block, view)). H200, one process (msar_tiles_nvidia_h200_lean2.md): streams backward 0.904 -> 0.876 ms at
    # `small`, 3.015 -> 2.972 at `medium`; its first version, the views a loop in a program per 128 tokens, was 1%
    # slower than PyTorch (msar_tiles_nvidia_h200_lean.md)
    stats_glue: str = "triton"
    split_ch: int = 64  # tokens a program of both passes (32: 0.730 ms, 128: 0.885 at `small`; `medium` within 3%)
    # what the split forward's pass 2 writes and ``_combine_kernel`` reads: "float32" (R in fp32, h = Σ_j g_j R_j
    # rounded once, then R copied into the dtype the mixer's backward keeps) or "kept" (pass 2 writes R in that dtype,
    # ``saved_streams_dtype``, each value rounded once from its fp32 sum, and h is combined from it: no fp32 R and no
    # copy, so the backward's R is the forward's to the bit). Under bf16 autocast (bf16 kept streams) a read moves
    # 6·m·d bytes a token less (pass 2 writes 2·m·d less; the combine reads 2·m·d less and writes no copy of 2·m·d),
    # about 200 MB a read at `small`; h moves by up to one bf16 rounding of the streams (what the sublayer's bf16
    # matmuls round its input to anyway). The same for fp32 streams (kept = fp32). The default since 2026-12-06
    # (night): H100, one process, alternating (throughput_small_msar_glue_h100.md), msar_block's `small` step 40.4 /
    # 40.3 -> 39.3 / 39.3 ms; with part_sums="triton" too 39.0 / 39.0 ms (0.440x -> 0.455x vanilla's), `medium`
    # 376.5 / 376.2 -> 368.2 / 368.5 ms (0.455x -> 0.465x, throughput_medium_msar_glue_h100.md); 60 training steps at
    # `small`, seeds 0 and 1, within the run-to-run spread of "float32" (worst gap 0.0030 against 0.0628,
    # backend_training_small_msar_block_combine_kept_h100.md)
    combine_from: str = "kept"
    # how the serial source-gradient kernel's partial query and tap gradients, one row a program ((B·chunks·S,
    # m, d) and (B·chunks·S, Σ_j k_j, d) fp32, about 37 MB at `small` and S = 5), are summed: "torch" (``.sum(0)``)
    # or "triton" (``sum_rows``: a program a few dozen columns walking every row, as many programs as the columns
    # allow; the same sums in another order, deterministic). msar_block's `small` step spent 1.1 ms of 41 in five
    # reductions a read (profile_step_small_graphs_phi_check_h100.md). The default since 2026-12-06 (night): H100,
    # one process, the streams backward alone (S = 5) 0.793 -> 0.769 ms at `small`, 2.666 -> 2.650 at `medium`
    # (msar_tiles_nvidia_h100_80gb_hbm3_part_sums.md); msar_block's `small` step 40.4 / 40.3 -> 40.0 / 40.0 ms
    # alternating (throughput_small_msar_glue_h100.md)
    part_sums: str = "triton"
    # the dtype of dR (m, B, T, d), which the mixer's backward writes and the stats and source-gradient kernels read
    # (each program of theirs is one source's: dR is read S times by each): "float32", or "kept", the dtype the
    # forward kept R in (bf16 under bf16 autocast), each value rounded once from its fp32 sum. The kernels compute in
    # fp32 either way. Built 2026-12-06 (night) and timed the same night on an H100, one process, alternating
    # (throughput_small_msar_dr_h100.md): msar_block's `small` step 39.1 / 38.9 ms against 38.8 / 38.9, no gain
    # past the noise (the two kernels wait on latency, not on dR's bytes), though it trains within the spread (60
    # steps, seeds 0 1: worst gap 0.0125 against 0.0668, backend_training_small_msar_block_grad_streams_h100.md).
    # Opt-in: the measured counter-example
    grad_streams: str = "float32"
    # where the backward keeps the per-token scalars w, κ, μ that the serial source-gradient kernel reads (src_mode
    # "serial"; the ring kernel always reads planes): "planes" ((4, M_PAD, S, B, T): w, κ, μ and a scratch plane; 3·m
    # scalar loads a token, each moved to a uniform register) or "token" ((S, B, T, 4, M_PAD): a token's scalars side
    # by side, one load split into scalars, ``_scalars``). sm_90a at `small`: the source-gradient kernel's token loop
    # 510 -> 465 instructions (12 LDG -> 3 LDG.E.128, R2UR 12 -> 0, UMOV 24 -> 12), 255 -> 252 registers, 8 -> 0
    # bytes spilled; the glue kernel (``_stats_finish_kernel``) writes them 4·M_PAD floats apart. H200, one process
    # (msar_tiles_nvidia_h200_token_major.md, S = 5, the same results to the bit): streams backward 0.863 -> 0.792 ms
    # at `small`, 2.967 -> 2.679 at `medium` (docs/kernel_msar.md, "The backward's w, κ, μ token-major")
    coef_layout: str = "token"
    # where the serial stats kernel (the split forward's pass 1 and the backward's stats, ``_stats_serial_kernel``)
    # stores its per-tile sums: "planes" ((n_dt, K, m, S, B, T): a scalar store a (statistic, view, token), each with
    # its own 64-bit address) or "token" ((n_dt, S, B, T, K, M_PAD): a token's sums of one statistic side by side,
    # built from scalars by ``_vector`` and stored as one vector; the glue kernels then read them K·M_PAD floats
    # apart). H200, one process (msar_tiles_nvidia_h200_pass2_trips.md and _token_major.md, S = 5, the same
    # results to the bit): forward 0.485 -> 0.457 ms at `small`, 1.812 -> 1.726 at `medium`; streams backward
    # 0.863 -> 0.854 / 2.967 -> 2.926 (docs/kernel_msar.md, "Pass 1's and the stats' sums token-major")
    parts_layout: str = "token"
    # where the mixer's backward sums dφ = Σ_t vec R ⊗ α ρ_R dz (and Σ dz, Σ dz·y for db and dα): "product" (it writes
    # coef (B, T, m), then ``dphi_from`` reads R a third time in batched products, 0.66 ms of a `small` step on an
    # H100, and torch sums dz and dz·y) or "walk" (``_mix_bwd_walk_kernel``: a program walks mix_walk tokens of the
    # flattened rows, mix_walk_bt a step, and keeps its partial dφ, Σ dz and Σ dz·y in registers, one row of a
    # (programs, m·d·m + m + 1) fp32 buffer that one torch.sum reduces; the products from R in fp32, not from the
    # bf16 product of bf16 R and coef). "walk" applies where one tile of the mixer backward holds all of d
    # (bwd_bd >= d: d·m_pad <= 4096 on the GPU, `small` and `medium`), elsewhere the product runs. ptxas (sm_90a,
    # `small`, 8 warps): 225 registers (one program an SM; φ's tile is loaded once a program), none spilled. H100, one
    # process, alternating (throughput_small_mix_walk_h100.md): msar_block's `small` step 39.0 / 39.0 ms against 38.5 /
    # 38.4 with the product (its programs wait on their loads): opt-in, a measured counter-example. "reduce" (2026-12-07):
    # ``_dphi_kernel`` after the mixer's backward sums dφ, Σ dz and Σ dz·y from R, coef, dz and dz·y in one pass (a
    # program a channel tile and a token chunk, fp32 products), one sum over its rows (7 kernels a read -> 3), at any
    # d. H100, one process, alternating (throughput_{small,medium}_dphi_reduce*_h100.md): msar_block's `small` step 40.2
    # / 40.2 ms against 38.3 / 38.4, `medium` 383.5 / 383.7 against 367.2 / 367.1 (its per-step sums across threads
    # wait on each other); 60 training steps within the spread (gap 0.0039 against 0.0572). With dphi_late (below) the
    # default; "product" (``dphi_from``) is the setting before
    mix_dphi: str = "reduce"
    mix_walk: int = 0  # tokens a walking program; 0: one program a multiprocessor (a single wave)
    mix_walk_bt: int = 2  # tokens a step of it
    mix_walk_warps: int = 8
    # mix_dphi="reduce" (``_dphi_kernel``, after the mixer's backward, which writes coef, dz and dz·y as for the
    # product): tokens a step, channels and warps a program, the programs a multiprocessor it aims at (the token
    # chunks are as many as that takes), or a fixed chunk of tokens (0: from dphi_waves)
    dphi_bt: int = 4  # 8 as timed every step (2026-12-07); 4 with dphi_late (114 registers)
    dphi_bd: int = 128
    dphi_warps: int = 4
    dphi_waves: int = 4
    dphi_chunk: int = 0
    # the reduction's products summed over a step's tokens every step (False, as timed 2026-12-07) or kept per token
    # in registers and summed once at the end (True: a multiply-add a step, no cross-thread sum). The default since
    # 2026-12-07 (final session), with mix_dphi="reduce" and dphi_bt=4. H100, one process, alternating with the product
    # before it: msar_block's graphed `small` step 37.6 / 37.5 ms against 38.0 / 37.9 (throughput_small_dphi_default_
    # h100.md; 37.7 / 37.6 against 37.9 / 38.0 in plan glue_next), `medium` 363.9 / 364.0 against 364.4 / 364.7
    # (throughput_medium_glue_both_h100.md); its GPU tests passed at all four shapes, the graphed step replays as the
    # eager one, and 60 training steps stay within the spread (gap 0.0183 against 0.0572,
    # backend_training_small_msar_block_dphi_default_h100.md)
    dphi_late: bool = True
    # the dtype of the product's partials of dφ (``dphi_from``, mix_dphi="product"): "kept" (R's, bf16 under autocast:
    # each of up to 64 partials rounded to 8 bits before their fp32 sum, dφ about 2.4e-3 off the walk's fp32 sums on an
    # H100 at `small` and `medium`, msar_tiles_nvidia_h100_80gb_hbm3_mix_walk.md; the setting before 2026-12-06, final
    # session) or "float32" (the product's own fp32 output on a GPU). H100, one process, alternating: msar_block's
    # `small` step 38.4 / 38.4 ms against 38.5 / 38.4, `medium` 367.3 / 367.5 against 367.4 / 367.5
    # (throughput_{small,medium}_mix_next*_h100.md): the same time, dφ to fp32 round-off
    dphi_partials: str = "float32"
    # where the product's mixer backward sums dz and dz·y over the tokens (db and dα): "torch" (the kernel writes dz
    # (B, T, m) and dz·y (B, T), then two torch sums, about 11 µs each a read in a `small` step's profile on an H100,
    # profile_step's reduce_kernel rows) or "kernel" (each program of ``_mix_bwd_kernel`` sums its tokens' dz and dz·y
    # into one row of a (programs, m + 1) fp32 buffer, and one torch sum finishes both). H100, one process, alternating
    # (plan glue_next, throughput_small_glue_next_h100.md): msar_block's `small` step 37.9 / 38.0 -> 37.8 / 37.8 ms;
    # dphi_late below gains more and does the same sums itself
    mix_sums: str = "torch"
    # the backward of MsarFunction takes the packed taps, the folded queries and φᵀ the forward made (kept on ctx:
    # (M_PAD·K_MAX + m + m·m)·d fp32 a read, 0.14 MB at `small`) instead of making them again: a fill, a fill, a copy a
    # tap, a product and a transposed copy fewer a read (7 small kernels, 119 a `small` msar_block step). H100, one
    # process, alternating (throughput_small_pack_once_h100.md): msar_block's `small` step 38.4 / 38.4 -> 38.3 / 38.3 ms,
    # the same results to the bit; False makes them again (the setting before 2026-12-06, final session)
    pack_once: bool = True
    # (register caps per kernel, Triton's ``maxnreg`` at 168 and 128, were timed on an H200 at `small` and withdrawn:
    # the forward 10-25%, the stats 12% and the source gradients 72-76% slower; docs/kernel_msar.md)

    def __post_init__(self):  # a misspelt mode fails where the tiles are chosen, before any kernel runs
        for field, choices in (("src_mode", ("serial", "ring")), ("stats_mode", ("tile", "serial")),
                               ("fwd_mode", ("tile", "split")), ("glue", ("torch", "triton")),
                               ("stats_glue", ("torch", "triton")), ("coef_layout", ("planes", "token")),
                               ("parts_layout", ("planes", "token")), ("combine_from", COMBINE_FROM),
                               ("part_sums", ("torch", "triton")), ("grad_streams", ("float32", "kept")),
                               ("mix_dphi", ("product", "walk", "reduce")), ("dphi_partials", ("kept", "float32")),
                               ("mix_sums", ("torch", "kernel"))):
            if getattr(self, field) not in choices:
                raise ValueError(f"msar: Blocks.{field} {getattr(self, field)!r} is not one of "
                                 + ", ".join(map(repr, choices)))

    def forward_warps(self, S: int) -> int:
        return self.one_source_warps if S == 1 and self.one_source_warps else self.warps

    def forward_views_3d(self, S: int) -> bool:
        """The forward's view layout: never 3-d for the one-source forward on its own warps (compiled so,
        ptxas keeps 32 registers and spills 7.8 KB at `small`)."""
        return self.views_3d and not (S == 1 and self.one_source_warps)

    def stats_tiles(self) -> tuple[int, int]:
        """(channels, tokens) of the stats kernel: it loops over channel tiles anyway (no
        recomputation), so its tiles need not hold all of d (0: the mixer backward's)."""
        return self.stats_bd or self.bwd_bd, self.stats_bt or self.bwd_bt


COMBINE_FROM = ("float32", "kept")  # Blocks.combine_from


# fields of Blocks replaced in every tile choice of ``_blocks``: a setting of the code for timing a candidate end to
# end beside the default in one process (``python -m benchmarks.throughput --residuals msar_block
# "msar_block@py:kernels.msar_attn.fused.FIELDS={'stats_pairs':True}"``); empty in training
FIELDS: dict = {}


def _blocks(T: int, d: int, m_pad: int, k_max: int) -> Blocks:
    blk = _tiles(T, d, m_pad, k_max)
    return dataclasses.replace(blk, **FIELDS) if FIELDS else blk


def _tiles(T: int, d: int, m_pad: int, k_max: int) -> Blocks:
    """Tile sizes. GPU: the split forward (the default, ``Blocks.fwd_mode``) runs its two passes on channel tiles
    of 128 channels and chunks of 64 tokens (fields of ``Blocks``, timed on an H200). The tile forward holds two
    (m, BT, BD) fp32 tiles (views, accumulator) of 4096
    elements; channels in one tile up to 4096 / m_pad (d <= 1024 at m = 4 runs the one-pass
    forward), else tiles of 512 channels and three passes. The mixer backward holds tiles of 4096
    elements too; the stats kernel (2, 128) tiles on one warp, looping over channel tiles. The
    source-gradient kernel: 16 tokens (>= K_MAX - 1) and 32 channels a program over 4
    warps, 16 token blocks a program (its scratch, (4 + 0.5·(Σ_j k_j + m_pad))·BD/8 KiB a program,
    and the partial sums scale with the number of programs): the "ring" mode; by default the serial stats and
    source-gradient kernels run instead (32 channels on one warp and 128 channels on four, 128 tokens a program:
    streams backward 3.14 -> 1.58 ms at `small`, 22.9 -> 9.9 ms at `medium` on an H200,
    msar_tiles_nvidia_h200_serial*.md). Warps: measured, see below. ptxas
    (sm_90a) registers and spills: docs/kernel_msar.md. Under the interpreter each program costs
    milliseconds: big blocks."""
    halo = triton.next_power_of_2(max(k_max - 1, 1))
    if interpreting():
        bd = triton.next_power_of_2(d) if d <= 1024 else 512
        bt = min(triton.next_power_of_2(T), 16)
        return Blocks(bd, bd >= d, bt, 4, bd, bt, 4, max(bt, halo), bd, 4, 4)
    elems = 8192
    bd_full = triton.next_power_of_2(d)
    t_pow = triton.next_power_of_2(T)
    # forward and mixer backward: all channels in one tile up to 4096 / m_pad (d <= 1024 at m = 4:
    # the one-pass forward), else tiles of 512 channels (the three-pass forward); 4096 elements a
    # tile but at least 2 tokens (at d = 1024: (4, 2, 1024), measured faster than (4, 1, 1024))
    bd = bd_full if m_pad * bd_full <= elems // 2 else 512
    bt = max(1, min(t_pow, max(2, elems // (2 * m_pad * bd)), 16))
    # the stats kernel: one warp on 2 tokens of 128 channels a tile, its reductions over d inside the warp (the
    # depth-attention kernels' lesson). H200, `small`, stats + source gradients (`benchmarks.msar_tiles --only`,
    # msar_tiles_nvidia_h200_one_warp.md): 3.087 ms against 3.165 / 3.176 with 4 warps on (2, 512) tiles;
    # (1, 256) at one warp timed 3.073 but spills 724 bytes (ptxas), (2, 128) 384
    stats_bd = min(bd_full, 128)
    stats_bt = max(1, min(t_pow, 2))
    # 4 warps a program throughout, and 32 channels a source-gradient program: timed with
    # `python -m benchmarks.msar_tiles --shapes small medium` on an H200
    # (benchmarks/results/msar_tiles_nvidia_h200.md). 4 warps beat 8 and 16 although a few hundred
    # bytes spill at `small` (several programs per SM hide the latency of the tap loads): at `small`
    # forward 0.86 vs 1.42 ms, stats + source gradients 3.5 vs 4.8 ms; at `medium` forward 4.1 vs
    # 6.8 ms, mixer backward 0.67 vs 1.17 ms.
    # One source (attnres_conv's op: no softmax over sources, the views and the mixer only): 2 warps
    # while the (m, BT, BD) tile holds at most 4096 elements. H200, `python -m benchmarks.msar_tiles
    # --sources 1` (msar_tiles_nvidia_h200_passes_s1.md): `small` 0.249 against 0.345 ms with 4 warps;
    # at `medium` ((4, 2, 1024) tiles) 2 warps took 2.56 against 1.12 ms, so it keeps 4.
    one_source_warps = 2 if m_pad * bt * bd <= 4096 else 0
    # the serial source-gradient kernel: 128 tokens a program, 256 from T = 2048 (H200, one process each,
    # msar_tiles_nvidia_h200_serial*.md: 9.74 against 9.94 ms at `medium`, S = 9, with half the partials; 1.597
    # against 1.582 ms at `small`)
    serial_ch = 256 if T >= 2048 else 128
    return Blocks(bd, bd >= d, bt, 4, bd, bt, 1, max(halo, min(16, t_pow)), 32, 4, 16,
                  stats_bd, stats_bt, 4, one_source_warps=one_source_warps, serial_ch=serial_ch)


def pair_offsets(ks: Sequence[int]) -> tuple[int, ...]:
    """Where each view's taps start when the (view, tap) pairs are numbered view by view (the kernels' KOFF)."""
    return tuple(sum(ks[:j]) for j in range(len(ks)))


def pack_taps(taps: Sequence[Tensor], d: int, device) -> tuple[Tensor, int, int]:
    """All views' taps as one (..., M_PAD, K_MAX, d) fp32 tensor (view 0 the Dirac, zero rows past k_j
    and for padded views), the kernel sizes (1, k_1, …) (the kernels' constexpr KS) and M_PAD. Taps (..., k_j, d):
    a read's (k_j, d), or every consumer's (C, k_j, d) at once (``pack_reads``)."""
    ks = [1, *(c.shape[-2] for c in taps)]
    k_max, m_pad = max(ks), triton.next_power_of_2(len(ks))
    lead = taps[0].shape[:-2] if taps else ()
    packed = torch.zeros(*lead, m_pad, k_max, d, device=device, dtype=torch.float32)
    packed[..., 0, 0, :] = 1.0
    for j, c in enumerate(taps, start=1):
        packed[..., j, : c.shape[-2], :] = c.detach().float()
    return packed, tuple(ks), m_pad


class Packed(NamedTuple):
    """What one read's kernels take besides its sources and that the read otherwise makes from its parameters and
    from the step's document ids (about 6 small kernels): made once a step for every consumer by ``pack_reads``."""

    taps: Tensor  # (M_PAD, K_MAX, d) fp32, as ``pack_taps`` packs them
    ks: tuple[int, ...]  # (1, k_1, …)
    qg: Tensor  # (m, d) fp32, as ``folded_queries`` folds them
    mixer: tuple[Tensor, Tensor, Tensor]  # φᵀ (m, m·d), α (1,), b (m,) fp32, as ``_mixer_params`` makes them
    near: Tensor  # (B, T) int32, ``doc_window`` of the step's document ids


@torch.no_grad()
def pack_reads(taps: Sequence[Tensor], queries: Tensor, key_gains: Tensor | None, phi: Tensor, alpha: Tensor,
               bias: Tensor, doc_ids: Tensor) -> tuple[Packed, ...]:
    """Every consumer's ``Packed`` at once (``Msar.pack_step``): taps m-1 of (C, k_j, d) (each consumer's own, gathered
    from shared groups by the caller), queries and key gains (C, m, d), φ (C, m·d, m), α (C,), b (C, m), the step's
    document ids (B, T). A few kernels a step in place of about 6 a read; each consumer's pieces are views of one
    tensor, equal to the bit to what its read would make."""
    C, _, d = queries.shape
    packed, ks, _ = pack_taps(taps, d, queries.device)  # (C, M_PAD, K_MAX, d)
    qg = folded_queries(queries, key_gains)  # (C, m, d)
    phis, alphas, biases = _mixer_params(phi, alpha, bias)  # (C, m, m·d), (C, 1), (C, m)
    near = doc_window(doc_ids)
    return tuple(Packed(packed[c], ks, qg[c], (phis[c], alphas[c], biases[c]), near) for c in range(C))


def folded_queries(queries: Tensor, key_gains: Tensor | None) -> Tensor:
    q = queries.detach().float()
    return (q if key_gains is None else q * key_gains.detach().float()).contiguous()  # (m, d)


def _mixer_params(phi, alpha, bias):
    """(φᵀ (m, m·d), α (1,), b (m,)) fp32 as the kernels take them: φ transposed, so that a program's
    loads of column i run along the channels (φ itself is (m·d, m): a column is strided by m). With a leading
    consumer dimension (φ (C, m·d, m), α (C,), b (C, m): ``pack_reads``) each gets it: (C, m, m·d), (C, 1), (C, m)."""
    return (phi.detach().float().transpose(-1, -2).contiguous(),
            alpha.detach().float().reshape(*phi.shape[:-2], 1).contiguous(), bias.detach().float().contiguous())


OFFSET_BIAS = 1 << 40  # added to the element offsets the kernels take (``offset_arg``)


def offset_arg(offset: int) -> int:
    """An element offset as the kernels take it: plus 2**40. Triton specialises an integer argument on its type
    (int32 or int64 by value) and on divisibility by 16; an offset between two allocations depends on where the
    allocator put them, which differs between the eager warm-up and a CUDA-graph capture, and a new
    specialisation would compile a kernel inside the capture. Biased, every offset is an int64 above 2**31, and
    offsets between CUDA allocations (multiples of 512 bytes, so of 16 elements) keep their divisibility."""
    if not -OFFSET_BIAS < offset < OFFSET_BIAS:
        raise ValueError(f"msar: an element offset of {offset} is beyond the kernels' ±2**40")
    return offset + OFFSET_BIAS


def sources_layout(x: Tensor, partial: Tensor | None) -> tuple[int, int, int]:
    """(S, n_buf, p_off) of the sources x (n_buf, B, T, d), followed, when given, by ``partial`` (B, T, d), which
    the kernels read in place at element offset p_off from x (x may be rows of a ``SourceBuffer``: nothing is
    stacked). The partial must have x's dtype, device and row shape and be contiguous."""
    n, _, T, d = x.shape
    if (T + 64) * d >= 2**31:  # the kernels' offsets inside one source row are int32 (``_src_row``)
        raise ValueError(f"msar: T·d = {T}·{d} is too large for the fused kernels' int32 offsets inside a row "
                         f"(at most {2**31 // d - 64} tokens at d = {d}); use backend='torch'")
    if partial is None:
        return n, n, 0
    if n == 0:  # an empty slice has no address (data_ptr 0): the partial's offset from it would be meaningless
        raise ValueError("msar: a partial source needs at least one buffered row before it (got 0 rows); pass it as "
                         "the only source instead (Block MSAR always has b_0 buffered)")
    if (partial.dtype != x.dtype or partial.device != x.device or tuple(partial.shape) != tuple(x.shape[1:])
            or not partial.is_contiguous()):
        raise ValueError(f"msar: the partial source must be a contiguous {x.dtype} tensor {tuple(x.shape[1:])} on "
                         f"{x.device} like the buffered rows, got {partial.dtype} {tuple(partial.shape)} on "
                         f"{partial.device} (contiguous: {partial.is_contiguous()})")
    gap = partial.data_ptr() - x.data_ptr()
    if gap % x.element_size():
        raise ValueError(f"msar: the partial source is not aligned to x's elements ({gap} bytes apart)")
    return n + 1, n, gap // x.element_size()


def forward(x, packed, ks, m, qg, near, *, key_norm, eps, mixer=None, sigmoid=True, write_r=False,
            store_logits=False, save=False, partial=None, save_dtype=None, save_stats=False, keep_streams=True,
            out_dtype=None):
    """h (B, T, d) in ``out_dtype`` (default x's) (or with ``write_r`` R (m, B, T, d) fp32), lse (m, B, T) fp32, the
    logits (m, S, B, T) fp32 when ``store_logits`` (else None), with ``save`` what the mixer's
    backward takes, (R (m, B, T, d) in ``save_dtype`` (default x's), R·φ (m, B, T), ‖vec R‖² (B, T)) (else None),
    and with ``save_stats`` the softmax's statistics for the backward, (logits, ρ) (m, S, B, T) fp32 each (ρ None
    without ``key_norm``; else None): ``streams_backward(stats=...)``, whose stats kernel then reduces dR·E alone.
    Without ``keep_streams`` what ``save`` returns holds None for R (the backward then rebuilds it,
    ``rebuild_streams``; the split forward never writes that copy). ``mixer``: (φᵀ, α, b) fp32 from
    ``_mixer_params``; ``partial``: a last source read in place (``sources_layout``). ``_blocks(...).fwd_mode``
    picks the kernels: "split" (``_forward_split``, the default) or "tile" (``_fwd_kernel``); both return the
    same."""
    _, B, T, d = x.shape
    S, n_buf, p_off = sources_layout(x, partial)
    m_pad, k_max = packed.shape[0], max(ks)
    blk = _blocks(T, d, m_pad, k_max)
    if blk.fwd_mode == "split":
        return _forward_split(x, packed, ks, m, qg, near, blk, key_norm=key_norm, eps=eps, mixer=mixer,
                              sigmoid=sigmoid, write_r=write_r, store_logits=store_logits, save=save, partial=partial,
                              save_dtype=save_dtype, save_stats=save_stats, keep_streams=keep_streams,
                              out_dtype=out_dtype)
    out = (torch.empty(m, B, T, d, device=x.device, dtype=torch.float32) if write_r
           else torch.empty(B, T, d, device=x.device, dtype=out_dtype or x.dtype))
    lse = torch.empty(m, B, T, device=x.device, dtype=torch.float32)
    want_logits, store_logits = store_logits, store_logits or save_stats
    if blk.single:
        logits = torch.empty(m, S, B, T, device=x.device, dtype=torch.float32) if store_logits else lse
    else:  # the passes over channel tiles keep the logits of every (padded) view
        logits = torch.empty(m_pad, S, B, T, device=x.device, dtype=torch.float32)
    store_rho = save_stats and key_norm
    rho = torch.empty(m, S, B, T, device=x.device, dtype=torch.float32) if store_rho else lse
    phi, alpha, bias = (lse, lse, lse) if write_r else mixer  # unused by the kernel with WRITE_R
    save = save and not write_r
    saved = ((torch.empty(m, B, T, d, device=x.device, dtype=save_dtype or x.dtype),
              torch.empty(m, B, T, device=x.device, dtype=torch.float32),
              torch.empty(B, T, device=x.device, dtype=torch.float32)) if save else (lse, lse, lse))
    _fwd_kernel[(triton.cdiv(T, blk.bt), B)](
        x, packed, qg, phi, alpha, bias, near, out, lse, logits, rho, *saved, S, n_buf, offset_arg(p_off), B, T, d,
        m, k_max, eps, triton.cdiv(d, blk.bd), KEY_NORM=key_norm, SIGMOID=sigmoid, WRITE_R=write_r,
        STORE_LOGITS=store_logits, STORE_RHO=store_rho, SAVE=save, SINGLE=blk.single, M_PAD=m_pad, KS=ks, BT=blk.bt,
        BD=blk.bd, V3=blk.forward_views_3d(S), num_warps=blk.forward_warps(S))
    logits = logits[:m] if store_logits else None
    stats = (logits, rho if store_rho else None) if save_stats else None
    if save and not keep_streams:  # the tile kernel wrote R anyway; it is dropped here, not kept for backward
        saved = (None, *saved[1:])
    return out, lse, (logits if want_logits else None), (saved if save else None), stats


def _forward_split(x, packed, ks, m, qg, near, blk, *, key_norm, eps, mixer, sigmoid, write_r, store_logits, save,
                   partial, save_dtype, save_stats, keep_streams=True, out_dtype=None):
    """``forward`` as two passes over channel tiles (``Blocks.fwd_mode="split"``), any d, same results. Pass 1
    (``_stats_serial_kernel``, QS alone): qg_j·E_j and ‖E_j‖² per channel tile; ``softmax_parts`` (one kernel, or
    PyTorch with ``Blocks.glue="torch"``) sums the tiles into the logits, ρ, their lse over the sources and the
    weights w (m, S, B, T) or (B, T, S, m) for the lean pass 2, a few small tensors. Pass 2
    (``_streams_split_kernel``): R (m, B, T, d) fp32 with the mixer's per-tile sums; ``gate`` finishes ‖vec R‖², R·φ
    and the gate g (m, B, T); ``_combine_kernel`` writes h = Σ_j g_j R_j (rounded once, from fp32 R: from a bf16 R,
    h differed from the tile forward's by 2.2e-3 relative on an H200) and the copy of R the mixer's backward keeps
    (``save_dtype``). With ``Blocks.combine_from="kept"`` pass 2 writes R in that dtype and h is combined from it
    (R·φ and ‖vec R‖² still from the fp32 sums)."""
    _, B, T, d = x.shape
    S, n_buf, p_off = sources_layout(x, partial)
    k_max = max(ks)
    koff = pair_offsets(ks)
    f32 = dict(device=x.device, dtype=torch.float32)
    bd1, ch = blk.split_logit_bd, max(1, min(blk.split_ch, T))
    n_dt1 = triton.cdiv(d, bd1)
    ptok = blk.parts_layout == "token"
    parts_mem, parts = parts_buffer(n_dt1, 2, m, S, B, T, token=ptok, device=x.device)
    _stats_serial_kernel[(S * n_dt1, triton.cdiv(T, ch), B)](
        x, packed, qg, near, parts_mem, parts_mem, S, n_buf, offset_arg(p_off), B, T, d, k_max, ch, KS=ks,
        KOFF=koff, KW=k_max, BD=bd1, FAST=blk.serial_fast, QS=True, DR=False, PREFETCH=blk.stats_prefetch,
        PAIRS=blk.stats_pairs, num_warps=1, **(dict(PM=triton.next_power_of_2(m)) if ptok else {}))
    logits, rho, lse, w = softmax_parts(parts, key_norm=key_norm, eps=eps, d=d, lean=blk.split_lean, glue=blk.glue,
                                        token=ptok)
    kept = save_dtype or x.dtype  # the streams' dtype for the mixer's backward
    narrow = blk.combine_from == "kept" and not write_r  # pass 2 writes R in it, the combine reads it (no copy)
    r, mparts = _pass_2(x, packed, ks, m, near, w, blk, partial=partial, phi=None if write_r else mixer[0],
                        dtype=kept if narrow else torch.float32)
    stats = (logits, rho) if save_stats else None
    logits = logits if store_logits else None
    if write_r:
        return r, lse, logits, None, stats
    _, alpha, bias = mixer
    g, z, rr = gate(mparts, alpha, bias, m=m, d=d, eps=eps, sigmoid=sigmoid, glue=blk.glue)
    h = torch.empty(B, T, d, device=x.device, dtype=out_dtype or x.dtype)
    copy = save and keep_streams and r.dtype != kept
    r_saved = torch.empty(m, B, T, d, device=x.device, dtype=kept) if copy else r
    bn, bdc = 16, min(256, triton.next_power_of_2(d))
    _combine_kernel[(triton.cdiv(B * T, bn), triton.cdiv(d, bdc))](
        r, g, h, r_saved, B * T, d, M=m, BN=bn, BD=bdc, COPY=copy)
    return h, lse, logits, ((r_saved if keep_streams else None, z, rr) if save else None), stats


def split_trip(blk: Blocks) -> int:
    """Tokens a trip of pass 2 (``Blocks.split_trip``; 1 without ``split_lean``, which it applies to)."""
    if blk.split_trip not in (1, 2, 4) or isinstance(blk.split_trip, bool):
        raise ValueError(f"msar: Blocks.split_trip={blk.split_trip!r}: choose 1, 2 or 4 tokens a trip of pass 2")
    return blk.split_trip if blk.split_lean else 1


def _pass_2(x, packed, ks, m, near, w, blk, *, partial, phi=None, dtype=torch.float32):
    """The split forward's pass 2 (``_streams_split_kernel``): R (m, B, T, d) (fp32, or ``dtype``: each value rounded
    once from fp32) from the weights w ((m, S, B, T), or (B, T, S, m) with ``blk.split_lean``: ``softmax_weights``),
    and with ``phi`` (the mixer's φᵀ) the mixer's per-tile sums (n_dt, 1 + m, B, T) (else None)."""
    _, B, T, d = x.shape
    S, n_buf, p_off = sources_layout(x, partial)
    k_max = max(ks)
    f32 = dict(device=x.device, dtype=torch.float32)
    ch = max(1, min(blk.split_ch, T))
    r = torch.empty(m, B, T, d, device=x.device, dtype=dtype)
    n_dt = triton.cdiv(d, blk.split_bd)
    mparts = None if phi is None else torch.empty(n_dt, 1 + m, B, T, **f32)
    _streams_split_kernel[(n_dt, triton.cdiv(T, ch), B)](
        x, packed, near, w, r if phi is None else phi, r, r if mparts is None else mparts, S, n_buf,
        offset_arg(p_off), B, T, d, k_max, ch, KS=ks, KOFF=pair_offsets(ks), KW=k_max, BD=blk.split_bd,
        MIXER=phi is not None, LEAN=blk.split_lean, DK=d if blk.split_lean else 0,
        TRIP=split_trip(blk), AHEAD=bool(blk.split_ahead and blk.split_lean), num_warps=blk.split_warps)
    return r, mparts


def rebuild_streams(x, packed, ks, near, logits, lse, *, partial=None, dtype=torch.float32) -> Tensor:
    """R (m, B, T, d) in ``dtype`` for the mixer's backward of a read that kept none (``msar(recompute_streams=True)``):
    the split forward's pass 2 alone, its weights w = exp(logit - lse) from the forward's saved logits (m, S, B, T)
    and lse (m, B, T) as the forward computed them (``rebuild_weights``). Given the dtype the forward would have kept
    (``saved_streams_dtype``), it is the R a read that keeps its streams keeps, to the bit, after the split forward
    (the default; the tile forward computes its R by other arithmetic: within fp32 rounding of it)."""
    _, B, T, d = x.shape
    blk = _blocks(T, d, packed.shape[0], max(ks))
    w = rebuild_weights(logits, lse, lean=blk.split_lean, glue=blk.glue)
    return _pass_2(x, packed, ks, logits.shape[0], near, w, blk, partial=partial, dtype=dtype)[0]


def saved_streams_dtype(x: Tensor) -> torch.dtype:
    """The dtype the streams R are kept in for the mixer's backward: x's, or under autocast its dtype when that
    is narrower (bf16 for fp32 sources under bf16 mixed precision, as autocast's matmuls keep their inputs for
    backward): 2·m·d bytes a token and consumer instead of 4·m·d (msar_block at `medium`: about 8 GiB of its
    peak). The mixer's backward reads R for dh·r_j, the RMSNorm term of dR and dφ; the softmax backward does not
    use it (the stats kernel rebuilds the views in fp32)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        low = torch.get_autocast_dtype(dev)
        if low.itemsize < x.dtype.itemsize:
            return low
    return x.dtype


def dphi_from(r: Tensor, coef: Tensor, *, fp32_partials: bool = False) -> Tensor:
    """dφ = Σ_t vec R ⊗ coef (m·d, m) fp32 from R (m, B, T, d) and coef (B, T, m) fp32: one long
    reduction over the tokens, split into up to 64 batched products of a few hundred tokens each
    (a single (d, B·T) @ (B·T, m) product keeps a few dozen thread blocks busy over 16k tokens)
    whose partials are summed in fp32. The products take R in its dtype and coef rounded to it; their partials
    come out in R's dtype (bf16 under autocast: each rounded to 8 bits before the sum, about 2e-3 of dφ), or with
    ``fp32_partials`` in fp32 (on a GPU the product's own fp32 output, ``out_dtype``; elsewhere the product in fp32)."""
    m, B, T, d = r.shape
    n = B * T
    p = math.gcd(n, 64)
    rs = r.reshape(m, p, n // p, d).transpose(2, 3).reshape(m * p, d, n // p)  # a view, no copy
    cf = coef.reshape(p, n // p, m).to(r.dtype).expand(m, p, n // p, m).reshape(m * p, n // p, m)
    if not fp32_partials or r.dtype == torch.float32:
        parts = torch.bmm(rs, cf).float()
    elif r.is_cuda:
        parts = torch.bmm(rs, cf, out_dtype=torch.float32)
    else:
        parts = torch.bmm(rs.float(), cf.float())
    return parts.reshape(m, p, d, m).sum(1).reshape(m * d, m)


def mixer_backward(dh, saved, mixer, *, eps, sigmoid):
    """The mixer's backward from what the forward saved (R, R·φ, ‖vec R‖²): dR (m, B, T, d) fp32 (in R's dtype with
    ``Blocks.grad_streams="kept"``) and the gradients of φ, α, b (fp32)."""
    r, z, rr = saved
    m, B, T, d = r.shape
    m_pad = triton.next_power_of_2(m)
    blk = _blocks(T, d, m_pad, 1)
    f32 = dict(device=r.device, dtype=torch.float32)
    dr = torch.empty(m, B, T, d, device=r.device, dtype=r.dtype if blk.grad_streams == "kept" else torch.float32)
    if blk.mix_dphi == "walk" and d <= blk.bwd_bd:  # one tile holds every channel: dφ inside the kernel
        n, bt = B * T, blk.mix_walk_bt
        # 0: one program a multiprocessor (four under the interpreter), every program the same number of steps
        walk = blk.mix_walk or triton.cdiv(n, 4 if r.device.type == "cpu" else sm_count(r.device))
        n_walk = triton.cdiv(walk, bt)
        n_prog = triton.cdiv(n, n_walk * bt)
        part = torch.empty(n_prog, m * d * m + m + 1, **f32)
        _mix_bwd_walk_kernel[(n_prog,)](
            r, z, rr, *mixer, dh, dr, part, n, d, m, eps, n_walk,
            SIGMOID=sigmoid, M_PAD=m_pad, BT=bt, BD=blk.bwd_bd, num_warps=blk.mix_walk_warps)
        sums = part.sum(0)
        return (dr, *_mixer_sums(sums, m, d))
    n_tb = triton.cdiv(T, blk.bwd_bt)
    coef = torch.empty(B, T, m, **f32)
    in_kernel = blk.mix_sums == "kernel" and blk.mix_dphi == "product"  # the reduction reads dz and dz·y per token
    if in_kernel:  # each program's sums of dz and dz·y; dz and dz·y themselves not written
        dz = dzy = None
        sums = torch.empty(B * n_tb, m + 1, **f32)
    else:
        dz, dzy, sums = torch.empty(B, T, m, **f32), torch.empty(B, T, **f32), None
    _mix_bwd_kernel[(n_tb, B)](
        r, z, rr, *mixer, dh, dr, dz, coef, dzy, sums, B, T, d, m, eps, triton.cdiv(d, blk.bwd_bd),
        SIGMOID=sigmoid, M_PAD=m_pad, BT=blk.bwd_bt, BD=blk.bwd_bd, SUMS=in_kernel, num_warps=blk.mix_warps)
    if blk.mix_dphi == "reduce":
        sums = dphi_reduce(r, coef, dz, dzy, blk)
        return (dr, *_mixer_sums(sums, m, d))
    dphi = dphi_from(r, coef, fp32_partials=blk.dphi_partials == "float32")
    if in_kernel:
        # (m + 1,): Σ dz, then Σ dz·y; torch's sum, which splits the rows over many programs (sum_rows would walk
        # thousands of narrow rows in one program: a program a column block)
        sums = sums.sum(0)
        return dr, dphi, sums[m], sums[:m]
    return dr, dphi, dzy.sum(), dz.sum((0, 1))


def _mixer_sums(sums: Tensor, m: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """dφ (m·d, m), dα and db from one summed row (m·d·m + m + 1,) of the walk's or the reduction's partials:
    dφ, then Σ dz (db), then Σ dz·y (dα)."""
    return sums[:m * d * m].view(m * d, m), sums[-1], sums[m * d * m:m * d * m + m]


def dphi_reduce(r: Tensor, coef: Tensor, dz: Tensor, dzy: Tensor, blk: Blocks) -> Tensor:
    """dφ, Σ dz and Σ dz·y as one vector (m·d·m + m + 1,) fp32 (``Blocks.mix_dphi="reduce"``, ``_dphi_kernel``):
    R (m, B, T, d) read once in channel tiles of ``dphi_bd`` over token chunks: ``dphi_chunk`` tokens a chunk when
    set, else as many chunks as give about ``dphi_waves`` programs a multiprocessor (four chunks off a GPU), each
    chunk a multiple of ``dphi_bt`` tokens; the chunks' rows summed by ``Blocks.part_sums``."""
    m, B, T, d = r.shape
    n = B * T
    n_dt = triton.cdiv(d, blk.dphi_bd)
    if blk.dphi_chunk:
        chunk = blk.dphi_chunk
    else:
        want = 4 if r.device.type == "cpu" else max(1, blk.dphi_waves * sm_count(r.device) // n_dt)
        chunk = triton.cdiv(n, want)
    chunk = triton.cdiv(chunk, blk.dphi_bt) * blk.dphi_bt
    n_chunk = triton.cdiv(n, chunk)
    part = torch.empty(n_chunk, m * d * m + m + 1, device=r.device, dtype=torch.float32)
    _dphi_kernel[(n_dt, n_chunk)](r, coef, dz, dzy, part, n, d, m, chunk, M_PAD=triton.next_power_of_2(m),
                                  BT=blk.dphi_bt, BD=blk.dphi_bd, INTERP=interpreting(), LATE=blk.dphi_late,
                                  num_warps=blk.dphi_warps)
    return sum_rows(part) if blk.part_sums == "triton" else part.sum(0)


def src_scratch(n_prog: int, m_pad: int, npair: int, bt: int, bd: int, device) -> tuple[Tensor, Tensor]:
    """The source-gradient kernel's scratch, one row per program: the dE ring (n_prog, M_PAD, 2·BT, BD)
    and the partials (n_prog, NPAIR + M_PAD, BT, BD) (tap-gradient products of every (view, tap) pair,
    then κE of every view), fp32. The kernel steps from one program's row to the next by the
    buffers' stride(0)."""
    f32 = dict(device=device, dtype=torch.float32)
    return torch.empty(n_prog, m_pad, 2 * bt, bd, **f32), torch.empty(n_prog, npair + m_pad, bt, bd, **f32)


def streams_backward(dr, lse, x, taps, packed, ks, qg, near, *, key_norm, eps, partial=None, rows_grad=None,
                     stats=None):
    """Gradients through the streams, given dR (m, B, T, d) fp32 (or bf16: Blocks.grad_streams) and the forward's lse
    (m, B, T) (and, when it saved them, ``stats``: its (logits, ρ), ``forward(save_stats=True)``, which the serial
    stats kernel then need not recompute):
    dx (S, B, T, d) in x's dtype (the partial's gradient last), [dtaps_j (k_j, d) fp32], dqg (m, d) fp32. Two
    kernels: the stats and the source gradients, serial (a program per source walking its tokens; the default)
    or over all sources a program (``Blocks.stats_mode="tile"``, ``src_mode="ring"``). With
    ``rows_grad = (grads, n_add)`` (x: rows of a buffer, ``grads`` the buffer's row gradients, in the rows' dtype,
    ``RowGradients.target``) the rows' gradients go into ``grads`` instead, added to rows below n_add (what later
    readers left) and written above, and dx is the partial's gradient (B, T, d) fp32 alone (None without a
    partial)."""
    _, B, T, d = x.shape
    S, n_buf, p_off = sources_layout(x, partial)
    m, m_pad, k_max = dr.shape[0], packed.shape[0], max(ks)
    blk = _blocks(T, d, m_pad, k_max)
    f32 = dict(device=x.device, dtype=torch.float32)
    plane = m_pad * S * B * T
    # w, κ, μ, scratch (4, M_PAD, S, B, T); padded views stay zero. Token-major for the serial source-gradient
    # kernel with coef_layout "token": (S, B, T, 4, M_PAD) in memory, a token's 4·M_PAD scalars in one load; coef
    # is then its permuted view, so that what writes it by index is unchanged
    token = blk.coef_layout == "token" and blk.src_mode == "serial"
    coef_mem = torch.zeros(S, B, T, 4, m_pad, **f32) if token else torch.zeros(4, m_pad, S, B, T, **f32)
    coef = coef_mem.permute(3, 4, 0, 1, 2) if token else coef_mem
    koff = pair_offsets(ks)
    if S == 1:  # one source (placement=post's view op): every weight is 1 and the softmax has no gradient
        coef[0, :m] = 1.0  # κ = μ = 0: no stats kernel
    elif blk.stats_mode == "serial":
        bd, ch = blk.stats_serial_bd, max(1, min(blk.stats_serial_ch, T))
        n_dt = triton.cdiv(d, bd)
        saved = stats if blk.stats_saved else None
        ptok = blk.parts_layout == "token"
        parts_mem, parts = parts_buffer(n_dt, 1 if saved else 3, m, S, B, T, token=ptok, device=x.device)
        _stats_serial_kernel[(S * n_dt, triton.cdiv(T, ch), B)](
            x, packed, qg, near, dr, parts_mem, S, n_buf, offset_arg(p_off), B, T, d, k_max, ch, KS=ks, KOFF=koff,
            KW=k_max, BD=bd, FAST=blk.serial_fast, QS=saved is None, DR=True, PREFETCH=blk.stats_prefetch,
            PAIRS=blk.stats_pairs, num_warps=1, **(dict(PM=m_pad) if ptok else {}))
        finish_stats(parts, lse, coef, key_norm=key_norm, eps=eps, d=d, saved=saved, glue=blk.stats_glue,
                     token=token, parts_token=ptok)
    else:
        stats_bd, stats_bt = blk.stats_tiles()
        planes = torch.zeros(4, m_pad, S, B, T, **f32) if token else coef  # the tile kernel writes planes
        _stats_kernel[(triton.cdiv(T, stats_bt), B)](
            x, packed, qg, near, dr, lse, planes, S, n_buf, offset_arg(p_off), B, T, d, m, k_max, eps,
            triton.cdiv(d, stats_bd), plane, KEY_NORM=key_norm, M_PAD=m_pad, KS=ks, BT=stats_bt, BD=stats_bd,
            V3=blk.views_3d, num_warps=blk.stats_warps)
        if token:
            coef.copy_(planes)
    if rows_grad is None:
        dx = out = torch.empty(S, B, T, d, device=x.device, dtype=x.dtype)
        n_add, q_off = 0, n_buf * B * T * d  # the partial's gradient: the last row of the stacked dx
    else:
        out, n_add = rows_grad
        dx = None if partial is None else torch.empty(B, T, d, device=x.device, dtype=out.dtype)
        q_off = 0 if dx is None else sources_layout(out[:n_buf], dx)[2]
    if blk.src_mode == "serial":
        ch = max(1, min(blk.serial_ch, T))
        n_chunks = triton.cdiv(T, ch)
        n_part = B * n_chunks * S
        dqg_part = torch.empty(n_part, m, d, **f32)
        dtap_part = torch.empty(n_part, sum(ks), d, **f32)
        _src_serial_kernel[(S * triton.cdiv(d, blk.serial_bd), n_chunks, B)](
            x, packed, qg, near, dr, coef_mem, out, dqg_part, dtap_part, S, n_buf, offset_arg(p_off), n_add,
            offset_arg(q_off), B, T, d, k_max, plane, ch, n_chunks, SOFTMAX=S > 1, KS=ks, KOFF=koff, KW=k_max,
            NPAIR=sum(ks), BD=blk.serial_bd, PREFETCH=blk.serial_prefetch, FAST=blk.serial_fast,
            CM=m_pad if token else 0, AHEAD2=bool(blk.serial_ahead2 and blk.serial_prefetch),
            num_warps=blk.serial_warps)
        total = sum_rows if blk.part_sums == "triton" else (lambda t: t.sum(0))
        dtaps_all = total(dtap_part)  # (NPAIR, d)
        dtaps = [dtaps_all[koff[j]: koff[j] + c.shape[0]] for j, c in enumerate(taps, start=1)]
        return dx, dtaps, total(dqg_part)
    n_blocks = triton.cdiv(T, blk.src_bt)
    sub = min(blk.sub, n_blocks)
    n_chunks = triton.cdiv(n_blocks, sub)
    k_pad = triton.next_power_of_2(k_max)
    dqg_part = torch.empty(n_chunks * B, m_pad, d, **f32)
    dtap_part = torch.empty(n_chunks * B, k_pad, m_pad, d, **f32)
    grid = (n_chunks, B, triton.cdiv(d, blk.src_bd))
    n_prog = grid[0] * grid[1] * grid[2]
    scratch, tap_scratch = src_scratch(n_prog, m_pad, sum(ks), blk.src_bt, blk.src_bd, x.device)
    _src_kernel[grid](
        x, packed, qg, near, dr, coef, out, dqg_part, dtap_part, scratch, tap_scratch, S, n_buf, offset_arg(p_off),
        n_add, offset_arg(q_off), B, T, d, m, k_max, plane, sub, scratch.stride(0), tap_scratch.stride(0),
        SOFTMAX=S > 1,
        M_PAD=m_pad, KS=ks, KOFF=koff, NPAIR=sum(ks), K_PAD=k_pad, BT=blk.src_bt, BD=blk.src_bd,
        V3=blk.views_3d, num_warps=blk.src_warps)
    dqg = dqg_part.sum(0)[:m]
    dtaps_all = dtap_part.sum(0)  # (K_PAD, M_PAD, d)
    dtaps = [dtaps_all[: c.shape[0], j] for j, c in enumerate(taps, start=1)]
    return dx, dtaps, dqg


@triton.jit
def _rows_tile(src_ptr, n0, N, X, offs_x, mask_x, BN: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    tile = offs_n.to(tl.int64)[:, None] * X + offs_x[None, :]
    return tl.load(src_ptr + tile, mask=(offs_n < N)[:, None] & mask_x[None, :], other=0.0)  # (BN, BX)


@triton.jit(do_not_specialize=("N",))  # the partials' count follows the sources': one compile for every count
def _sum_rows_kernel(src_ptr, dst_ptr, N, X, BN: tl.constexpr, BX: tl.constexpr, INTERP: tl.constexpr):
    """dst[x] = Σ_n src[n, x] for BX of the X columns of src (N, X) fp32: (BN, BX) tiles down the rows, summed in
    fp32, one reduction over the tile's rows at the end. The rows' loop a ``range`` (pipelined) on the GPU, a
    ``while`` under the interpreter (whose ``range`` takes no run-time bound): the same tiles in the same order."""
    offs_x = tl.program_id(0) * BX + tl.arange(0, BX)
    mask_x = offs_x < X
    acc = tl.zeros((BN, BX), dtype=tl.float32)
    if INTERP:
        n0 = 0
        while n0 < N:
            acc += _rows_tile(src_ptr, n0, N, X, offs_x, mask_x, BN)
            n0 += BN
    else:
        for n0 in range(0, N, BN):
            acc += _rows_tile(src_ptr, n0, N, X, offs_x, mask_x, BN)
    tl.store(dst_ptr + offs_x, tl.sum(acc, axis=0), mask=mask_x)


def sum_rows(parts: Tensor) -> Tensor:
    """``parts.sum(0)`` of contiguous fp32 partials (N, ...) as one kernel (``Blocks.part_sums="triton"``): columns
    in blocks of 32 to 128, as wide as still gives two programs for each of about 132 SMs (or 32 when nothing does),
    32 rows a trip (8 under the interpreter); deterministic."""
    if parts.dtype != torch.float32 or not parts.is_contiguous() or parts.dim() < 2:
        raise ValueError(f"sum_rows: needs contiguous fp32 partials (N, ...), got {parts.dtype} {tuple(parts.shape)} "
                         f"(contiguous: {parts.is_contiguous()})")
    n, x = parts.shape[0], parts[0].numel()
    out = torch.empty(parts.shape[1:], device=parts.device, dtype=torch.float32)
    bx = 32
    while bx < 128 and triton.cdiv(x, 2 * bx) >= 264:
        bx *= 2
    interp = interpreting()
    _sum_rows_kernel[(triton.cdiv(x, bx),)](parts, out, n, x, BN=8 if interp else 32, BX=bx, INTERP=interp,
                                            num_warps=4)
    return out


def _query_grads(dqg, queries, key_gains):
    if key_gains is None:
        return dqg.to(queries.dtype), None
    return (dqg * key_gains.float()).to(queries.dtype), (dqg * queries.float()).to(key_gains.dtype)


class MsarFunction(torch.autograd.Function):
    """The whole MSAR read. Inputs: n_src, buffer, pre (a ``Packed`` or None), queries, key_gains (or None), near,
    φ, α, b, flags, then the sources and the taps: with n_src = 0 one stacked x (S, B, T, d), else n_src tensors
    (B, T, d). With ``pre`` the packed taps, folded queries and φᵀ are taken from it instead of made here.
    Without ``buffer`` those are stacked here and saved as they are (tensors the residual keeps anyway), so
    no stacked copy lives from forward to backward; the backward stacks them again. With ``buffer =
    (rows, grads)`` (``BufferedSources``) nothing is stacked: the kernels read ``rows`` (n, B, T,
    d), rows of a ``SourceBuffer`` written once and never changed, in place (kept on ctx, outside the saved
    tensors, as the phase-1 op of depth attention does), and the partial (the last tensor) through its own
    address; the n_src tensors are the rows' aliases and the partial. The rows' gradients go into the buffer's
    ``RowGradients`` ``grads`` (added to what later readers left there), not to autograd, which would sum one
    (B, T, d) gradient per reader: each row's store takes the finished sum (kernels/depth_attn/buffer.py).
    Outputs: h (differentiable), lse and logits (diagnostics, not differentiable). Saves the inputs,
    the lse, and (when a gradient is wanted) the streams R (``saved_streams_dtype``) with two per-token scalars of
    the mixer: the mixer's backward then reads R instead of rebuilding the views (2·m·d bytes a
    token in bf16; docs/kernel_msar.md, "Backward"); the streams' backward rebuilds them. Also the logits and
    the keys' ρ of every (view, source, token) (8·m·S bytes a token), so that the backward's stats kernel reduces
    dR·E alone. With ``recompute_streams`` it keeps no R: the backward rebuilds it from the sources and the saved
    logits (``rebuild_streams``, the split forward's pass 2), 2·m·d bytes a token and consumer less to keep."""

    @staticmethod
    def forward(ctx, n_src, buffer, pre, queries, key_gains, near, phi, alpha, bias, key_norm, eps, fusion,
                store_logits, recompute_streams, out_dtype, *tensors):
        split = max(n_src, 1)
        xs, taps = tensors[:split], tensors[split:]
        x, partial = _source_tensors(xs, n_src, buffer)
        d, m = x.shape[-1], queries.shape[0]
        if pre is not None:  # Msar.pack_step: packed once a step for every consumer (``pack_reads``)
            packed, ks, qg, mixer, m_pad = pre.taps, pre.ks, pre.qg, pre.mixer, pre.taps.shape[0]
        else:
            packed, ks, m_pad = pack_taps(taps, d, x.device)
            qg, mixer = folded_queries(queries, key_gains), _mixer_params(phi, alpha, bias)
        save = any(ctx.needs_input_grad)
        # Blocks.pack_once: the backward takes the packed taps, the folded queries and φᵀ made here (a few small
        # tensors a read, from parameters that do not change before the backward; they stay saved, so an in-place
        # change still fails autograd's version check) instead of making them again
        ctx.packed = (packed, ks, qg, mixer) if save and _blocks(x.shape[-2], d, m_pad, max(ks)).pack_once else None
        ctx.kept = saved_streams_dtype(x)  # what R is kept in (autocast is on here, not in backward): rebuilt alike
        h, lse, logits, saved, stats = forward(x, packed, ks, m, qg, near,
                                               key_norm=key_norm, eps=eps, mixer=mixer,
                                               sigmoid=fusion == "sigmoid", store_logits=store_logits, save=save,
                                               partial=partial, save_dtype=ctx.kept, save_stats=save,
                                               keep_streams=not recompute_streams, out_dtype=out_dtype)
        # with a buffer the rows stay on ctx (written once) and only the partial is saved
        ctx.rows, ctx.grads = (None, None) if buffer is None else buffer
        keep = xs if buffer is None else (partial,)
        ctx.save_for_backward(queries, key_gains, near, phi, alpha, bias, lse,
                              *(saved if save else (None, None, None)), *(stats if save else (None, None)),
                              *keep, *taps)
        ctx.key_norm, ctx.eps, ctx.fusion, ctx.n_src, ctx.n_keep = key_norm, eps, fusion, n_src, len(keep)
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(lse, logits)
        return h, lse, logits

    @staticmethod
    def backward(ctx, dh, _dlse, _dlogits):
        queries, key_gains, near, phi, alpha, bias, lse, r, z, rr, logits, rho, *tensors = ctx.saved_tensors
        keep, taps = tensors[:ctx.n_keep], tensors[ctx.n_keep:]
        if ctx.rows is not None:
            x, partial = ctx.rows, keep[0]
        else:
            x, partial = _source_tensors(keep, ctx.n_src, None)  # (S, B, T, d), stacked again
        d = x.shape[-1]
        if ctx.packed is not None:
            packed, ks, qg, mixer = ctx.packed
            ctx.packed = None
        else:
            packed, ks, _ = pack_taps(taps, d, x.device)
            qg, mixer = folded_queries(queries, key_gains), _mixer_params(phi, alpha, bias)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if r is None:  # recompute_streams: the forward kept no R
                r = rebuild_streams(x, packed, ks, near, logits, lse, partial=partial, dtype=ctx.kept)
            dr, dphi, dalpha, dbias = mixer_backward(dh.contiguous(), (r, z, rr), mixer,
                                                     eps=ctx.eps, sigmoid=ctx.fusion == "sigmoid")
            rows_grad = None if ctx.rows is None else ctx.grads.target(x.shape[0])
            dx, dtaps, dqg = streams_backward(dr, lse, x, taps, packed, ks, qg, near, key_norm=ctx.key_norm,
                                              eps=ctx.eps, partial=partial, rows_grad=rows_grad, stats=(logits, rho))
            dq, dg = _query_grads(dqg, queries, key_gains)
        if ctx.rows is not None:  # the rows' gradients are in ctx.grads; the partial's is dx
            dxs = (None,) * x.shape[0] + (() if partial is None else (dx.to(partial.dtype),))
        else:
            dxs = dx.unbind(0) if ctx.n_src else (dx,)
        return (None, None, None, dq, dg, None, dphi.to(phi.dtype), dalpha.reshape(alpha.shape).to(alpha.dtype),
                dbias.to(bias.dtype), None, None, None, None, None, None, *dxs,
                *(dc.to(c.dtype) for dc, c in zip(dtaps, taps)))


def _source_tensors(xs, n_src: int, buffer) -> tuple[Tensor, Tensor | None]:
    """(x, partial) for the kernels: the stacked sources (or the one stacked tensor), or with ``buffer``
    (rows, grads) the buffer's rows in place and the partial, the last of ``xs`` when there is one more."""
    if buffer is None:
        return (torch.stack(xs) if n_src else xs[0]), None
    rows = buffer[0]
    return rows, (xs[-1] if len(xs) > rows.shape[0] else None)


class StreamsFunction(torch.autograd.Function):
    """The streams R (m, B, T, d) without the mixer (``msar_attn``). Inputs: x, queries, key_gains,
    near, flags, *taps. Outputs: R in x's dtype, lse, logits. Saves the inputs, the lse and (when a gradient is
    wanted) the logits and ρ for the backward's stats."""

    @staticmethod
    def forward(ctx, x, queries, key_gains, near, key_norm, eps, store_logits, *taps):
        d, m = x.shape[-1], queries.shape[0]
        packed, ks, _ = pack_taps(taps, d, x.device)
        save = any(ctx.needs_input_grad)
        r, lse, logits, _, stats = forward(x, packed, ks, m, folded_queries(queries, key_gains), near,
                                           key_norm=key_norm, eps=eps, write_r=True, store_logits=store_logits,
                                           save_stats=save)
        ctx.save_for_backward(x, queries, key_gains, near, lse, *(stats if save else (None, None)), *taps)
        ctx.key_norm, ctx.eps = key_norm, eps
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(lse, logits)
        return r.to(x.dtype), lse, logits

    @staticmethod
    def backward(ctx, dr, _dlse, _dlogits):
        x, queries, key_gains, near, lse, logits, rho, *taps = ctx.saved_tensors
        d = x.shape[-1]
        packed, ks, _ = pack_taps(taps, d, x.device)
        qg = folded_queries(queries, key_gains)
        with torch.autocast(device_type=x.device.type, enabled=False):
            dx, dtaps, dqg = streams_backward(dr.float().contiguous(), lse, x, taps, packed, ks, qg, near,
                                              key_norm=ctx.key_norm, eps=ctx.eps, stats=(logits, rho))
            dq, dg = _query_grads(dqg, queries, key_gains)
        return (dx, dq, dg, None, None, None, None, *(dc.to(c.dtype) for dc, c in zip(dtaps, taps)))


def _prepare(taps, queries, key_gains, doc_ids, near=None):
    return ([c.contiguous() for c in taps], queries.contiguous(),
            None if key_gains is None else key_gains.contiguous(), doc_window(doc_ids) if near is None else near)


@torch.compiler.disable  # under torch.compile: a graph break, the kernels run as they are
def msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, *, key_norm=True, fusion="sigmoid",
         eps=1e-6, return_weights=False, recompute_streams=False, packed=None):
    """The fused MSAR read; inputs already validated by ``kernels.msar_attn.msar``. ``x``: the stacked
    sources (S, B, T, d) or a sequence of S tensors (B, T, d), which are not kept stacked for the
    backward. ``BufferedSources``: the buffer's rows and the partial read in place (the partial in the buffer's
    dtype). ``packed``: this read's ``Packed`` from ``pack_reads`` (validated), else the read packs its own.
    Weights are returned detached (diagnostics)."""
    from . import BufferedSources

    buffer, out_dtype = None, None
    if isinstance(x, BufferedSources):  # h in the stream's dtype, whatever the buffer stores (residual.source_dtype)
        rows, out_dtype = x.rows, x.buffer.stream_dtype
        partial = () if x.partial is None else (x.partial.to(x.buffer.data.dtype).contiguous(),)
        xs, buffer = (*rows, *partial), (x.buffer.data[:len(rows)], x.buffer.grads)
    else:
        xs = (x.contiguous(),) if isinstance(x, Tensor) else tuple(t.contiguous() for t in x)
    n_src = 0 if isinstance(x, Tensor) else len(xs)
    taps, queries, key_gains, near = _prepare(taps, queries, key_gains, doc_ids,
                                              None if packed is None else packed.near)
    h, lse, logits = MsarFunction.apply(n_src, buffer, packed, queries, key_gains, near, phi, alpha, bias,
                                        bool(key_norm), float(eps), fusion, bool(return_weights),
                                        bool(recompute_streams), out_dtype, *xs, *taps)
    if not return_weights:
        return h
    return h, softmax_weights(logits, lse)  # (m, S, B, T) fp32


@torch.compiler.disable
def msar_attn(x, taps, queries, key_gains, doc_ids, *, key_norm=True, eps=1e-6, return_weights=False):
    """The fused streams (no mixer); inputs already validated by ``kernels.msar_attn.msar_attn``."""
    taps, queries, key_gains, near = _prepare(taps, queries, key_gains, doc_ids)
    r, lse, logits = StreamsFunction.apply(x.contiguous(), queries, key_gains, near, bool(key_norm), float(eps),
                                           bool(return_weights), *taps)
    if not return_weights:
        return r
    return r, softmax_weights(logits, lse)
