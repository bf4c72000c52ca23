"""Depth attention fused in Triton: the two-phase schedule of Block AttnRes (docs/method.md §3).

Paper: "Attention Residuals", Kimi Team, arXiv 2603.15031 (two-phase computation).

Static pseudo-queries do not depend on the input, so the C consumers of a block can attend the
completed sources at once (phase 1), and each consumer then folds in its intra-block partial with an
online-softmax merge (phase 2). Same semantics as ``reference.py``; all math in fp32 whatever the
sources' dtype (bf16 on the GPU). PyTorch only folds the key gains into the queries (q ⊙ g, with
autograd) and sums per-program partial query gradients (deterministic, no atomics).

Phase 1, ``_summaries_fwd_kernel``: one program per block of BLOCK_T tokens (one token for
d >= 512) with all d channels, one warp per 512 channels (``tiles``). A chunk of BLOCK_S (<= 8) sources
is read in one load, so every source of a token is in flight at once; with n <= BLOCK_S (``ONE_CHUNK``: Block
AttnRes up to 8 blocks at d <= 2048) the chunk is loaded once for all C consumers (3 or 5 sources as two loads of
2 + 1 or 4 + 1 rows rather than one padded to 4 or 8: ``FWD_TAIL``). Per consumer (a
static loop): the logits (q_c ⊙ g_c)·x_s·r_s (the sums of squares r_s are shared), the softmax over
the sources in fp32 (online across chunks when n > BLOCK_S, the later consumers then read the chunks
from L2), and the weighted sum. Writes each consumer's normalised output (C, N, d) in the sources'
dtype and its log-sum-exp (C, N) fp32 (N = B·T tokens). From 9 sources (more than one load holds) the forward
streams them instead (``_summaries_fwd_stream_kernel``, ``FWD_STREAM``): one row a load, the next in flight, each
folded into every consumer's online-softmax state, so each source is read once for all consumers.

Phase 2, ``_merge_fwd_kernel``: for one consumer and its partial p, z = (q ⊙ g)·RMSNorm(p) and
w = σ(z − lse) (the partial's share of the merged softmax), h = o + w·(p − o). Reads o and p,
writes h and w (N,) fp32.

Backward, ``_merge_bwd_kernel`` (per consumer) then ``_summaries_bwd_kernel`` (per block):
    merge:   do = (1−w)·dh,  dz = w(1−w)·dh·(p − o) = w·dh·(p − h),  dlse = −dz,  dp = w·dh + dz·∂z/∂p
             (from h, the merge's output, which the consumer's sublayer holds anyway, not from o: p − h =
             (1−w)(p − o), so no (B, T, d) phase-1 output is kept per merge)
    phase 1: dlogit_cs = w_cs (dO_c·x_s − dO_c·o_c + dlse_c),  w_cs = exp(logit_cs − lse_c)
             dx_s = Σ_c w_cs dO_c + Σ_c dlogit_cs ∂logit_cs/∂x_s
with ∂logit/∂x = r (qg − logit·r·x / d), r = rsqrt(mean x² + eps) for the key RMSNorm. With
``ONE_CHUNK`` the phase-1 backward reads every source and every upstream gradient of a token block
once: dO_c·o_c = Σ_s w_cs dO_c·x_s comes from the chunk in registers (no fp32 copy of the outputs is
kept), then the chunk's gradients are written. Otherwise a first pass over the chunks sums
dO_c·o_c and a second (usually from L2) writes the gradients; with outputs narrower than the sources (bf16
outputs of fp32 sources, ``out_dtype``) phase 1 keeps them and dO_c·o_c comes from them as stored
(``DELTA_FROM_OUT``: C rows of o and dO a token instead of the first pass). Both backward kernels are persistent
(each program loops over token blocks and writes one partial gradient of q ⊙ g) with as many
programs as fit on the GPU at once, read from the compiled kernel's registers and shared memory.

Split backward (``split_backward``: 2 to 9 sources at d = 1024; ``SPLIT_BWD`` sets it): ``_split_scores_kernel``
reads every source and upstream gradient of 4 tokens (one warp each) in chunks of channels (its products summed over
the chunks and reduced once for 2 or more consumers, ``scores_once``; the logits and the key norm's r_s taken from
the forward, which stores them for it, ``SCORES_FROM_LOGITS``, so it sums only dO_c·x_s) and writes the per-token
scalars w_cs, dlogit_cs·r_s (C, n, N) and the key norm's −r_s² Σ_c dlogit_cs logit_cs / d (n, N) in fp32; then
``_split_grads_kernel`` (persistent, one token over all d) forms dx_s and the query-gradient partials elementwise from
them, reading the sources and upstream gradients again. Twice the reads of those, but no token's whole rows in
registers and no reduction across warps: at `medium` 0.87-0.89x the one kernel's time at 2-4 sources and 0.5-0.7x
from 5 on with the logits summed again; taking them from the forward, 0.66-0.89x that again (2026-12-04).
``SPLIT_GRADS_ROWS`` (off: slower) takes the gradients kernel's sources as separate rows, one fused multiply-add a
term; ``SPLIT_GRADS_PREFETCH`` (off: no gain in the step) loads each trip's sources (and with "all" its scalars) a trip
ahead. Two other gradients kernels lost alone on an H100 at `medium` and were removed (2026-12-05): the
query-gradient partial written per token block and summed apart (112 registers against 168; 1.15-1.49x the persistent
kernel's time) and the consumers' loop outside each trip's sources (each upstream gradient loaded once a trip;
1.00-1.09x).
Both passes in one kernel (the scalars of a token block from a first pass over its chunks, the gradients from a
second) was measured 2.2-12x slower alone and removed (2026-12-04, docs/kernel_attnres.md).
The row gradients a buffered call adds into are in the rows' dtype (``buffer.ROW_GRADIENTS``).

Tiles are fixed (``tiles``, ``_row_tiles``; no autotuning), chosen from the sm_90 compiler's
resource report (``python -m benchmarks.depth_attn_ptxas``) and a sweep on an H200
(``python -m benchmarks.depth_attn_tiles``): 16 fp32 per thread and row, up to 8 sources per load
forward, backward 1 at one warp (d <= 512) and 2 above, except 3 or 4 sources at d = 1024, taken in one load over
4 warps with the registers capped (``NARROW_WIDE_BWD``; ``WIDE_BWD`` overrides the backward's tiles above 512 channels).
Under the interpreter: 32 tokens per program.

Sources are never stacked per read: phase 1 reads rows [0, n) of a preallocated (n_max, B, T, d)
buffer (``SourceBuffer``), whose rows are written once, when a source is complete, and never
modified afterwards (so the backward may read them after later rows are filled).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting


@triton.jit
def _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S: tl.constexpr):
    """Sources s0 .. s0 + BLOCK_S - 1 of a token block in one load (BLOCK_S rows in flight at once):
    x (BLOCK_S, BLOCK_T, BLOCK_D) fp32 (0 past n), the source mask (BLOCK_S,) and the rows
    s·N + t (BLOCK_S, BLOCK_T) int64 in the (n, N) source-token grid."""
    idx = s0 + tl.arange(0, BLOCK_S)
    mask_s = idx < n
    rows = idx.to(tl.int64)[:, None] * N + tok[None, :]
    x = tl.load(src_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                mask=mask_s[:, None, None] & mask_td[None, :, :], other=0.0)
    return x.to(tl.float32), mask_s, rows


@triton.jit
def _chunk_rstd(x, D, eps, KEY_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr):
    """r = rsqrt(mean x² + eps) (S, T) of a chunk (1 for raw keys): shared by every consumer."""
    if KEY_NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=2) / D + eps)
    else:
        r = tl.full((BLOCK_S, BLOCK_T), 1.0, tl.float32)
    return r


@triton.jit
def _fwd_chunk(x, r, mask_s, qg, m_i, l_i, acc):
    """One consumer (qg (D,)) over a chunk x (S, T, D): logits (S, T) and the online-softmax state
    (running max m_i (T,), sum l_i (T,), accumulator acc (T, D)) updated."""
    logit = tl.sum(x * qg, axis=2) * r  # qg (1, 1, D)
    masked = tl.where(mask_s[:, None], logit, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(masked, axis=0))  # a chunk holds at least one source
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(masked - m_new[None, :])  # (S, T)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * x, axis=0)
    return logit, m_new, l_i, acc


@triton.jit
def _token_block(pid, N, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """A forward program's tokens and channels: offs_d, the token and channel masks, their (T, D) product and the
    tokens as int64."""
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < N
    mask_d = offs_d < D
    return offs_d, mask_t, mask_d, mask_t[:, None] & mask_d[None, :], offs_t.to(tl.int64)


@triton.jit
def _store_output(out0_ptr, out_ptr, lse_ptr, acc, m_i, l_i, c: tl.constexpr, tok, offs_d, mask_t, mask_td, N, D):
    """Consumer c's normalised output (its online-softmax state divided by its sum) and log-sum-exp. Consumer 0's
    output goes to ``out0_ptr`` (N, D), consumer c >= 1's to row c - 1 of ``out_ptr`` (C - 1, N, D): two views of one
    (C, N, D) tensor, or consumer 0's output in a tensor of its own (``summaries_fwd(first_apart=True)``)."""
    val = acc / l_i[:, None]
    if c == 0:
        tl.store(out0_ptr + tok[:, None] * D + offs_d[None, :], val.to(out0_ptr.dtype.element_ty), mask=mask_td)
    else:
        out_rows = tok + (c - 1) * N  # (T,) int64 in (C - 1, N)
        tl.store(out_ptr + out_rows[:, None] * D + offs_d[None, :], val.to(out_ptr.dtype.element_ty), mask=mask_td)
    tl.store(lse_ptr + c * N + tok, m_i + tl.log(l_i), mask=mask_t)


@triton.jit
def _summaries_fwd_kernel(
    src_ptr,  # sources (n_max, N, d) contiguous; rows [0, n) are read
    qg_ptr,  # gain-folded queries q_c ⊙ g_c (C, d) fp32
    out0_ptr,  # result: consumer 0's normalised output (N, d), in the outputs' dtype
    out_ptr,  # result: consumers 1 .. C-1's normalised outputs (C - 1, N, d) (``_store_output``)
    lse_ptr,  # result: log-sum-exp of the logits over sources (C, N) fp32
    logits_ptr,  # result: raw logits (C, n, N) fp32, only when STORE_LOGITS
    rstd_ptr,  # result: the key norm's r_s (n, N) fp32, only when STORE_RSTD (for the split backward)
    n, N, D, eps,
    C: tl.constexpr, KEY_NORM: tl.constexpr, STORE_LOGITS: tl.constexpr, ONE_CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_S: tl.constexpr = 0,
    STORE_RSTD: tl.constexpr = False,
):
    # TAIL_S > 0 (ONE_CHUNK only): the sources past the first BLOCK_S in a second load of TAIL_S rows, so n = 3 or 5
    # holds 2 + 1 or 4 + 1 rows in registers instead of 4 or 8 (``FWD_TAIL``)
    pid = tl.program_id(0)
    offs_d, mask_t, mask_d, mask_td, tok = _token_block(pid, N, D, BLOCK_T, BLOCK_D)
    if ONE_CHUNK:  # every source in registers: read once for all consumers
        x, mask_s, rows = _load_chunk(src_ptr, pid * 0, n, tok, mask_td, offs_d, N, D, BLOCK_S)  # (S, T, D)
        r = _chunk_rstd(x, D, eps, KEY_NORM, BLOCK_S, BLOCK_T)
        if STORE_RSTD:
            tl.store(rstd_ptr + rows, r, mask=mask_s[:, None] & mask_t[None, :])
        if TAIL_S > 0:
            x2, mask_s2, rows2 = _load_chunk(src_ptr, pid * 0 + BLOCK_S, n, tok, mask_td, offs_d, N, D, TAIL_S)
            r2 = _chunk_rstd(x2, D, eps, KEY_NORM, TAIL_S, BLOCK_T)
            if STORE_RSTD:
                tl.store(rstd_ptr + rows2, r2, mask=mask_s2[:, None] & mask_t[None, :])
    for c in tl.static_range(C):
        # in the chunk's layout (1, 1, D): loaded as a (D,) row and broadcast, it cost a layout conversion per
        # consumer (bf16 sources at `small` on an H200: 0.410 against 0.135 ms, depth_attn_tiles_nvidia_h200_small.md)
        qg = tl.load(qg_ptr + c * D + offs_d[None, None, :], mask=mask_d[None, None, :], other=0.0)
        # online softmax over chunks of sources, fp32 (AttnRes §3: the softmax is in fp32)
        m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        if ONE_CHUNK:
            logit, m_i, l_i, acc = _fwd_chunk(x, r, mask_s, qg, m_i, l_i, acc)
            if STORE_LOGITS:
                tl.store(logits_ptr + c * n * N + rows, logit, mask=mask_s[:, None] & mask_t[None, :])
            if TAIL_S > 0:  # the tail holds at least one source (n > BLOCK_S)
                logit2, m_i, l_i, acc = _fwd_chunk(x2, r2, mask_s2, qg, m_i, l_i, acc)
                if STORE_LOGITS:
                    tl.store(logits_ptr + c * n * N + rows2, logit2, mask=mask_s2[:, None] & mask_t[None, :])
        else:  # chunk by chunk; consumers after the first read them from L2
            s0 = pid * 0  # a while loop: the interpreter cannot take a tensor as a range bound
            while s0 < n:
                xc, mask_sc, rows_c = _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S)
                rc = _chunk_rstd(xc, D, eps, KEY_NORM, BLOCK_S, BLOCK_T)
                if STORE_RSTD and c == 0:  # shared by every consumer: stored once
                    tl.store(rstd_ptr + rows_c, rc, mask=mask_sc[:, None] & mask_t[None, :])
                logit, m_i, l_i, acc = _fwd_chunk(xc, rc, mask_sc, qg, m_i, l_i, acc)
                if STORE_LOGITS:
                    tl.store(logits_ptr + c * n * N + rows_c, logit, mask=mask_sc[:, None] & mask_t[None, :])
                s0 += BLOCK_S
        _store_output(out0_ptr, out_ptr, lse_ptr, acc, m_i, l_i, c, tok, offs_d, mask_t, mask_td, N, D)


@triton.jit
def _stream_states(C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every consumer's online-softmax state at the start: running max, sum and accumulator, a tuple of C each."""
    m_s = ()
    l_s = ()
    acc_s = ()
    for c in tl.static_range(C):
        m_s = m_s + (tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32),)
        l_s = l_s + (tl.zeros((BLOCK_T,), dtype=tl.float32),)
        acc_s = acc_s + (tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32),)
    return m_s, l_s, acc_s


@triton.jit
def _stream_chunk(x, r, mask_s, rows, mask_t, qg_ptr, logits_ptr, m_s, l_s, acc_s, n, N, offs_d, mask_d, D,
                  C: tl.constexpr, STORE_LOGITS: tl.constexpr):
    """One load of sources x (S, T, D) folded into every consumer's state (the queries from L1 at each load)."""
    nm = ()
    nl = ()
    na = ()
    for c in tl.static_range(C):
        qg = tl.load(qg_ptr + c * D + offs_d[None, None, :], mask=mask_d[None, None, :], other=0.0)
        logit, m_c, l_c, a_c = _fwd_chunk(x, r, mask_s, qg, m_s[c], l_s[c], acc_s[c])
        if STORE_LOGITS:
            tl.store(logits_ptr + c * n * N + rows, logit, mask=mask_s[:, None] & mask_t[None, :])
        nm = nm + (m_c,)
        nl = nl + (l_c,)
        na = na + (a_c,)
    return nm, nl, na


@triton.jit
def _summaries_fwd_stream_kernel(
    src_ptr, qg_ptr, out0_ptr, out_ptr, lse_ptr, logits_ptr, rstd_ptr,  # as ``_summaries_fwd_kernel``'s
    n, N, D, eps,
    C: tl.constexpr, KEY_NORM: tl.constexpr, STORE_LOGITS: tl.constexpr, STORE_RSTD: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Phase 1's forward with the sources streamed (``FWD_STREAM``): the sources in loads of BLOCK_S rows, each
    folded into all C consumers' online-softmax states (C × BLOCK_T × BLOCK_D fp32 accumulators in registers), so a
    source is read once and the registers hold one load of rows instead of all n. With PREFETCH the next load is
    issued before this one's arithmetic (two loads in flight a program)."""
    pid = tl.program_id(0)
    offs_d, mask_t, mask_d, mask_td, tok = _token_block(pid, N, D, BLOCK_T, BLOCK_D)
    m_s, l_s, acc_s = _stream_states(C, BLOCK_T, BLOCK_D)
    s0 = pid * 0  # a while loop: the interpreter cannot take a tensor as a range bound
    if PREFETCH:
        x, mask_s, rows = _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S)
    while s0 < n:
        if PREFETCH:  # the next load (masked off past n) in flight during this one's arithmetic
            x_next, mask_next, rows_next = _load_chunk(src_ptr, s0 + BLOCK_S, n, tok, mask_td, offs_d, N, D, BLOCK_S)
        else:
            x, mask_s, rows = _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S)
        r = _chunk_rstd(x, D, eps, KEY_NORM, BLOCK_S, BLOCK_T)
        if STORE_RSTD:
            tl.store(rstd_ptr + rows, r, mask=mask_s[:, None] & mask_t[None, :])
        m_s, l_s, acc_s = _stream_chunk(x, r, mask_s, rows, mask_t, qg_ptr, logits_ptr, m_s, l_s, acc_s, n, N,
                                        offs_d, mask_d, D, C, STORE_LOGITS)
        if PREFETCH:
            x, mask_s, rows = x_next, mask_next, rows_next
        s0 += BLOCK_S
    for c in tl.static_range(C):
        _store_output(out0_ptr, out_ptr, lse_ptr, acc_s[c], m_s[c], l_s[c], c, tok, offs_d, mask_t, mask_td, N, D)


@triton.jit
def _consumer_scores(x, r, mask_s, qg_ptr, do_ptr, lse_ptr, c, tok, td, offs_d, mask_t, mask_td, mask_d, N, D):
    """Consumer c over a chunk x (S, T, D): its query qg (D,), upstream gradient dO (T, D), the logits
    (S, T), the weights w = exp(logit − lse) (S, T) (0 past n) and a = dO·x_s (S, T)."""
    # loaded as (1, T, D) and (1, 1, D): the layout of the chunk, no conversion through shared memory
    qg = tl.load(qg_ptr + c * D + offs_d[None, None, :], mask=mask_d[None, None, :], other=0.0)
    do = tl.load(do_ptr + td[None, :, :], mask=mask_td[None, :, :], other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + c * N + tok, mask=mask_t, other=0.0)
    logit = tl.sum(x * qg, axis=2) * r
    w = tl.where(mask_s[:, None], tl.exp(logit - lse[None, :]), 0.0)
    a = tl.sum(x * do, axis=2)
    return qg, do, logit, w, a


@triton.jit
def _pick(ptrs, c, C: tl.constexpr):
    """ptrs[c] for a runtime index c (a chain of selects over the tuple)."""
    ptr = ptrs[0]
    for j in tl.static_range(1, C):
        ptr = tl.where(c == j, ptrs[j], ptr)
    return ptr


@triton.jit
def _consumer_grad(x, r, mask_s, delta, dqg, dx, dl_l, qg_ptr, do_ptr, lse_ptr, dlse_ptr, c, tok, td, offs_c,
                   offs_d, mask_t, mask_td, mask_d, N, D, LOCAL_DELTA: tl.constexpr):
    """Consumer c's share of a chunk's gradients: dx (S, T, D), Σ_c dlogit·logit (S, T), dqg row c."""
    qg, do, logit, w, a = _consumer_scores(x, r, mask_s, qg_ptr, do_ptr, lse_ptr, c, tok, td, offs_d, mask_t,
                                           mask_td, mask_d, N, D)
    if LOCAL_DELTA:
        delta_c = tl.sum(w * a, axis=0)  # (T,), from the sources in fp32
    else:
        delta_c = tl.sum(tl.where(offs_c[:, None] == c, delta, 0.0), axis=0)
    dlse = tl.load(dlse_ptr + c * N + tok, mask=mask_t, other=0.0)
    dl = w * (a - delta_c[None, :] + dlse[None, :])  # softmax backward (S, T)
    dl_l += dl * logit
    dlr = dl * r
    dx += w[:, :, None] * do + dlr[:, :, None] * qg
    dq = tl.sum(tl.sum(dlr[:, :, None] * x, axis=0), axis=0)  # (D,): Σ dlogit · r x
    dqg += tl.where(offs_c[:, None] == c, dq[None, :], 0.0)
    return dx, dl_l, dqg


@triton.jit
def _chunk_grads(x, r, mask_s, delta, dx, dqg, qg_ptr, douts, lse_ptr, dlse_ptr, tok, td, offs_c, offs_d, mask_t,
                 mask_td, mask_d, N, D, C: tl.constexpr, KEY_NORM: tl.constexpr, LOCAL_DELTA: tl.constexpr,
                 UNROLL_C: tl.constexpr):
    """dx (S, T, D) plus the gradient of a chunk of sources, and dqg (BLOCK_C, D) plus this chunk's share:
        dlogit_cs = w_cs (a_cs − delta_c + dlse_c),  delta_c = dO_c·o_c = Σ_s w_cs a_cs
        dx_s = Σ_c w_cs dO_c + r_s Σ_c dlogit_cs qg_c − r_s² x_s Σ_c dlogit_cs logit_cs / d
    ``LOCAL_DELTA``: the chunk holds every source, delta_c is summed here; else it is given (C, T).
    ``UNROLL_C``: consumers unrolled (the compiler overlaps their upstream-gradient loads); else a
    loop that keeps one consumer's values live at a time (for the 128-register cap of 16 warps)."""
    dl_l = tl.zeros_like(r)  # Σ_c dlogit_cs logit_cs (S, T)
    if UNROLL_C:
        for c in tl.static_range(C):
            dx, dl_l, dqg = _consumer_grad(x, r, mask_s, delta, dqg, dx, dl_l, qg_ptr, douts[c], lse_ptr, dlse_ptr,
                                           c, tok, td, offs_c, offs_d, mask_t, mask_td, mask_d, N, D, LOCAL_DELTA)
    else:
        for c in range(C):
            dx, dl_l, dqg = _consumer_grad(x, r, mask_s, delta, dqg, dx, dl_l, qg_ptr, _pick(douts, c, C), lse_ptr,
                                           dlse_ptr, c, tok, td, offs_c, offs_d, mask_t, mask_td, mask_d, N, D,
                                           LOCAL_DELTA)
    if KEY_NORM:  # through r = rsqrt(mean x² + eps)
        dx -= (r * r * dl_l / D)[:, :, None] * x
    return dx, dqg


@triton.jit
def _earlier_dsrc(dsrc_ptr, rows, offs_d, mask, n_add, N, D):
    """What the source gradients hold at rows s·N + t for s < n_add (the gradient a later phase-1 call's
    backward left in a shared buffer), 0 for the others; loaded with the sources, before the chunk's
    arithmetic, so that its latency overlaps it (no traffic where the mask is empty, e.g. n_add = 0)."""
    return tl.load(dsrc_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                   mask=mask & (rows < n_add * N)[:, :, None], other=0.0).to(tl.float32)


@triton.jit
def _persistent_start(N, D, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """A persistent backward's program: its id, the number of programs, the channels' offsets (BLOCK_D,) and mask,
    the consumers' offsets (BLOCK_C,), a zero query-gradient partial (BLOCK_C, BLOCK_D) and the token blocks' count."""
    offs_d = tl.arange(0, BLOCK_D)
    return (tl.program_id(0), tl.num_programs(0), offs_d, tl.arange(0, BLOCK_C), offs_d < D,
            tl.zeros((BLOCK_C, BLOCK_D), dtype=tl.float32), tl.cdiv(N, BLOCK_T))


@triton.jit
def _store_partial(dqg_ptr, dqg, pid, offs_c, offs_d, mask_d, C, D):
    """A program's query-gradient partial into row ``pid`` of (programs, C, d) fp32."""
    tl.store(dqg_ptr + (pid * C + offs_c[:, None]).to(tl.int64) * D + offs_d[None, :], dqg,
             mask=(offs_c[:, None] < C) & mask_d[None, :])


@triton.jit
def _summaries_bwd_kernel(
    src_ptr,  # sources (n_max, N, d) contiguous; rows [0, n) are read
    qg_ptr,  # gain-folded queries (C, d) fp32
    lse_ptr,  # forward log-sum-exp (C, N) fp32
    douts,  # tuple of C upstream gradients of the outputs, each (N, d) contiguous
    dlse_ptr,  # upstream gradient of the log-sum-exp (C, N) fp32
    dsrc_ptr,  # result: gradient of the sources (n, N, d) (rows [0, n_add) added into, the rest written)
    dqg_ptr,  # result: per-program partial gradient of q ⊙ g (programs, C, d) fp32
    out_ptr,  # DELTA_FROM_OUT: the forward's outputs (C, N, d) contiguous
    n, n_add, N, D, eps,
    C: tl.constexpr, BLOCK_C: tl.constexpr, KEY_NORM: tl.constexpr, ONE_CHUNK: tl.constexpr,
    UNROLL_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DELTA_FROM_OUT: tl.constexpr,
):
    pid, n_prog, offs_d, offs_c, mask_d, dqg, n_tiles = _persistent_start(N, D, BLOCK_C, BLOCK_T, BLOCK_D)
    tile = pid
    while tile < n_tiles:  # as many programs as fit on the GPU at once, each over many token blocks
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < N
        mask_td = mask_t[:, None] & mask_d[None, :]
        tok = offs_t.to(tl.int64)
        td = tok[:, None] * D + offs_d[None, :]
        if ONE_CHUNK:  # every source in one load: each source and upstream gradient read once
            x, mask_s, rows = _load_chunk(src_ptr, pid * 0, n, tok, mask_td, offs_d, N, D, BLOCK_S)
            mask_x = mask_s[:, None, None] & mask_td[None, :, :]
            dx = _earlier_dsrc(dsrc_ptr, rows, offs_d, mask_x, n_add, N, D)
            r = _chunk_rstd(x, D, eps, KEY_NORM, BLOCK_S, BLOCK_T)
            dx, dqg = _chunk_grads(x, r, mask_s, dqg, dx, dqg, qg_ptr, douts, lse_ptr, dlse_ptr, tok, td, offs_c,
                                   offs_d, mask_t, mask_td, mask_d, N, D, C, KEY_NORM, True, UNROLL_C)
            tl.store(dsrc_ptr + rows[:, :, None] * D + offs_d[None, None, :], dx.to(dsrc_ptr.dtype.element_ty),
                     mask=mask_x)
        else:
            # pass 1: delta_c = dO_c·o_c (C, T); pass 2 (the chunks again, usually from L2): gradients
            delta = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
            s0 = pid * 0
            if DELTA_FROM_OUT:  # from the outputs as stored: C rows of o and dO instead of n sources and C·n dO
                for c in tl.static_range(C):
                    o_c = tl.load(out_ptr + c * N * D + td, mask=mask_td, other=0.0).to(tl.float32)
                    do_c = tl.load(douts[c] + td, mask=mask_td, other=0.0).to(tl.float32)
                    delta += tl.where(offs_c[:, None] == c, tl.sum(o_c * do_c, axis=1)[None, :], 0.0)
                s0 = n  # pass 1 skipped
            while s0 < n:
                x, mask_s, rows = _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S)
                r = _chunk_rstd(x, D, eps, KEY_NORM, BLOCK_S, BLOCK_T)
                for c in tl.static_range(C):
                    qg, do, logit, w, a = _consumer_scores(x, r, mask_s, qg_ptr, douts[c], lse_ptr, c, tok, td,
                                                           offs_d, mask_t, mask_td, mask_d, N, D)
                    delta += tl.where(offs_c[:, None] == c, tl.sum(w * a, axis=0)[None, :], 0.0)
                s0 += BLOCK_S
            s0 = pid * 0
            while s0 < n:
                x, mask_s, rows = _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S)
                mask_x = mask_s[:, None, None] & mask_td[None, :, :]
                dx = _earlier_dsrc(dsrc_ptr, rows, offs_d, mask_x, n_add, N, D)
                r = _chunk_rstd(x, D, eps, KEY_NORM, BLOCK_S, BLOCK_T)
                dx, dqg = _chunk_grads(x, r, mask_s, delta, dx, dqg, qg_ptr, douts, lse_ptr, dlse_ptr, tok, td, offs_c,
                                       offs_d, mask_t, mask_td, mask_d, N, D, C, KEY_NORM, False, UNROLL_C)
                tl.store(dsrc_ptr + rows[:, :, None] * D + offs_d[None, None, :], dx.to(dsrc_ptr.dtype.element_ty),
                         mask=mask_x)
                s0 += BLOCK_S
        tile += n_prog
    _store_partial(dqg_ptr, dqg, pid, offs_c, offs_d, mask_d, C, D)


@triton.jit
def _chunk4(src_ptr, douts, rows, mask_st, tok, mask_t, offs_c, offs_d, mask_d, D, C: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """A chunk of channels in the (S, T, C, chunk) shape of the split scores kernel: the sources x (S, T, 1, chunk) and the
    C upstream gradients side by side (1, T, C, chunk), fp32."""
    x = tl.load(src_ptr + rows[:, :, None, None] * D + offs_d[None, None, None, :],
                mask=mask_st[:, :, None, None] & mask_d[None, None, None, :], other=0.0).to(tl.float32)
    do = tl.zeros((1, BLOCK_T, BLOCK_C, BLOCK_D), dtype=tl.float32)
    for c in tl.static_range(C):
        do_c = tl.load(douts[c] + tok[None, :, None, None] * D + offs_d[None, None, None, :],
                       mask=mask_t[None, :, None, None] & mask_d[None, None, None, :], other=0.0)
        do += tl.where(offs_c[None, None, :, None] == c, do_c.to(tl.float32), 0.0)
    return x, do


@triton.jit
def _forward_logits(logit_ptr, rstd_ptr, sc, mask_sc, rows, mask_st, KEY_NORM: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """The forward's logits (S, T, C) at ``sc`` in (C, n, N) and its r_s (S, T) (1 for raw keys)."""
    logit = tl.load(logit_ptr + sc, mask=mask_sc, other=0.0)
    if KEY_NORM:
        r = tl.load(rstd_ptr + rows, mask=mask_st, other=1.0)
    else:
        r = tl.full((BLOCK_S, BLOCK_T), 1.0, tl.float32)
    return logit, r


@triton.jit
def _softmax_bwd(a, logit, lse_ptr, dlse_ptr, valid, offs_c, mask_c, tok, mask_t, N):
    """From a = dO_c·x_s and the logits (S, T, C): the weights w_cs and dlogit_cs = w_cs (a_cs − dO_c·o_c + dlse_c),
    with dO_c·o_c = Σ_s w_cs a_cs from the sources in fp32."""
    ct = offs_c[None, None, :] * N + tok[None, :, None]  # (1, T, C) in (C, N)
    mask_ct = mask_c[None, None, :] & mask_t[None, :, None]
    lse = tl.load(lse_ptr + ct, mask=mask_ct, other=0.0)
    dlse = tl.load(dlse_ptr + ct, mask=mask_ct, other=0.0)
    w = tl.where(valid, tl.exp(logit - lse), 0.0)
    delta = tl.sum(w * a, axis=0)  # dO_c·o_c (T, C)
    return w, w * (a - delta[None, :, :] + dlse)


@triton.jit
def _split_scores_kernel(
    src_ptr,  # sources (n_max, N, d) contiguous; rows [0, n) are read
    qg_ptr,  # gain-folded queries (C, d) fp32
    lse_ptr,  # forward log-sum-exp (C, N) fp32
    douts,  # tuple of C upstream gradients of the outputs, each (N, d) contiguous
    dlse_ptr,  # upstream gradient of the log-sum-exp (C, N) fp32
    w_ptr,  # result: softmax weights w_cs (C, n, N) fp32
    dlr_ptr,  # result: dlogit_cs · r_s (C, n, N) fp32
    coef_ptr,  # result (KEY_NORM): −r_s² Σ_c dlogit_cs logit_cs / d (n, N) fp32
    logit_in_ptr,  # FROM_LOGITS: the forward's logits (C, n, N) fp32
    rstd_in_ptr,  # FROM_LOGITS and KEY_NORM: the forward's r_s (n, N) fp32
    n, N, D, eps,
    C: tl.constexpr, BLOCK_C: tl.constexpr, KEY_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, ONCE: tl.constexpr, FROM_LOGITS: tl.constexpr = False,
):
    """Split backward, first kernel: the per-token scalars of every (consumer, source) pair, from one read of the
    sources and upstream gradients in chunks of BLOCK_D channels (one warp a token on the GPU: every dot product is a
    reduction inside a warp). Accumulators are (S, T, C): the consumer axis last, in the chunk's layout. ``ONCE``:
    the products are summed elementwise over the chunks in (S, T, C, BLOCK_D) accumulators and reduced over the
    channels once, after the last chunk (one reduction a dot product instead of one a chunk). ``FROM_LOGITS``: the
    logits and r_s come from the forward (``SCORES_FROM_LOGITS``), so only the dot products dO_c·x_s are summed here
    (no query loads, no sums of squares: half the accumulators)."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    tok = offs_t.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    rows = offs_s.to(tl.int64)[:, None] * N + tok[None, :]  # (S, T) in the (n, N) source-token grid
    mask_st = mask_s[:, None] & mask_t[None, :]
    if ONCE:
        offs_k = tl.arange(0, BLOCK_D)
        if not FROM_LOGITS:
            ss4 = tl.zeros((BLOCK_S, BLOCK_T, 1, BLOCK_D), dtype=tl.float32)  # x² summed over the chunks
            qx4 = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C, BLOCK_D), dtype=tl.float32)  # (q_c ⊙ g_c) ⊙ x_s likewise
        a4 = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C, BLOCK_D), dtype=tl.float32)  # dO_c ⊙ x_s
        d0 = pid * 0
        while d0 < D:
            offs_d = d0 + offs_k
            mask_d = offs_d < D
            x, do = _chunk4(src_ptr, douts, rows, mask_st, tok, mask_t, offs_c, offs_d, mask_d, D, C, BLOCK_T,
                                  BLOCK_C, BLOCK_D)  # (S, T, 1, Dc), the C upstream gradients (1, T, C, Dc)
            if not FROM_LOGITS:
                qg = tl.load(qg_ptr + offs_c[None, None, :, None] * D + offs_d[None, None, None, :],
                             mask=mask_c[None, None, :, None] & mask_d[None, None, None, :], other=0.0)  # (1, 1, C, Dc)
                if KEY_NORM:
                    ss4 += x * x
                qx4 += x * qg
            a4 += x * do
            d0 += BLOCK_D
        if not FROM_LOGITS:
            ss = tl.sum(tl.sum(ss4, axis=3), axis=2)  # (S, T)
            qx = tl.sum(qx4, axis=3)  # (S, T, C)
        a = tl.sum(a4, axis=3)
    else:
        if not FROM_LOGITS:
            ss = tl.zeros((BLOCK_S, BLOCK_T), dtype=tl.float32)  # Σ_d x² (S, T)
            qx = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C), dtype=tl.float32)  # (q_c ⊙ g_c)·x_s
        a = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_C), dtype=tl.float32)  # dO_c·x_s
        d0 = pid * 0  # a while loop: the interpreter cannot take a tensor as a range bound
        while d0 < D:
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            x = tl.load(src_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                        mask=mask_st[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)  # (S, T, Dc)
            if KEY_NORM and not FROM_LOGITS:
                ss += tl.sum(x * x, axis=2)
            for c in tl.static_range(C):
                do = tl.load(douts[c] + tok[None, :, None] * D + offs_d[None, None, :],
                             mask=mask_t[None, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)  # (1, T, Dc)
                sel = offs_c[None, None, :] == c
                if not FROM_LOGITS:
                    qg = tl.load(qg_ptr + c * D + offs_d[None, None, :], mask=mask_d[None, None, :], other=0.0)
                    qx += tl.where(sel, tl.sum(x * qg, axis=2)[:, :, None], 0.0)
                a += tl.where(sel, tl.sum(x * do, axis=2)[:, :, None], 0.0)
            d0 += BLOCK_D
    valid = mask_s[:, None, None] & mask_c[None, None, :]
    out = offs_c[None, None, :].to(tl.int64) * n * N + rows[:, :, None]  # (S, T, C) in (C, n, N)
    mask_out = valid & mask_t[None, :, None]
    if FROM_LOGITS:  # (S, T, C), as the forward computed them
        logit, r = _forward_logits(logit_in_ptr, rstd_in_ptr, out, mask_out, rows, mask_st, KEY_NORM, BLOCK_S, BLOCK_T)
    else:
        if KEY_NORM:
            r = tl.rsqrt(ss / D + eps)
        else:
            r = tl.full((BLOCK_S, BLOCK_T), 1.0, tl.float32)
        logit = qx * r[:, :, None]  # (S, T, C)
    w, dl = _softmax_bwd(a, logit, lse_ptr, dlse_ptr, valid, offs_c, mask_c, tok, mask_t, N)  # (S, T, C)
    tl.store(w_ptr + out, w, mask=mask_out)
    tl.store(dlr_ptr + out, dl * r[:, :, None], mask=mask_out)
    if KEY_NORM:  # through r = rsqrt(mean x² + eps)
        tl.store(coef_ptr + rows, -(r * r * tl.sum(dl * logit, axis=2) / D), mask=mask_st)


@triton.jit
def _trip_rows(tile, s0, n, N, n_tiles, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr):
    """The rows s·N + t (S, T) int64 of sources s0 .. s0 + BLOCK_S - 1 of token block ``tile`` and their mask (none
    past n, the last token or the last block)."""
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    idx = s0 + tl.arange(0, BLOCK_S)
    rows = idx.to(tl.int64)[:, None] * N + offs_t.to(tl.int64)[None, :]
    return rows, (idx < n)[:, None] & ((offs_t < N) & (tile < n_tiles))[None, :]


@triton.jit
def _load_raw(src_ptr, rows, mask_st, offs_d, mask_d, D):
    """The sources at ``rows`` (S, T) (``_trip_rows``) as (S, T, D) in their own dtype, nothing where masked (the
    prefetch past a program's last trip reads nothing)."""
    return tl.load(src_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                   mask=mask_st[:, :, None] & mask_d[None, None, :], other=0.0)


@triton.jit
def _trip_scalars(w_ptr, dlr_ptr, coef_ptr, rows, mask_st, n, N, C: tl.constexpr, KEY_NORM: tl.constexpr):
    """The first kernel's scalars of a trip's sources at ``rows`` (S, T): w and dlogit·r of each consumer (two tuples
    of C (S, T)) and the key norm's coefficient (S, T) (w's first for raw keys, unused), fp32, 0 where masked."""
    ws = ()
    dlrs = ()
    for c in tl.static_range(C):
        ws = ws + (tl.load(w_ptr + c * n * N + rows, mask=mask_st, other=0.0),)
        dlrs = dlrs + (tl.load(dlr_ptr + c * n * N + rows, mask=mask_st, other=0.0),)
    if KEY_NORM:
        coef = tl.load(coef_ptr + rows, mask=mask_st, other=0.0)
    else:
        coef = ws[0]
    return ws, dlrs, coef


@triton.jit
def _grads_block(x, ws, dlrs, coef, mask_s, rows, dqg, qg_ptr, douts, dsrc_ptr, n_add, tok, mask_t, mask_td, offs_c,
                 offs_d, mask_d, N, D, C: tl.constexpr, KEY_NORM: tl.constexpr):
    """A trip of the split gradients kernel over the sources of x (S, T, D) fp32 at ``rows`` (S, T), with their
    scalars (``_trip_scalars``): their gradients written (added to what rows [0, n_add) hold) and the query-gradient
    partial dqg (BLOCK_C, D) returned with their terms."""
    mask_x = mask_s[:, None, None] & mask_td[None, :, :]
    dx = _earlier_dsrc(dsrc_ptr, rows, offs_d, mask_x, n_add, N, D)
    if KEY_NORM:
        dx += coef[:, :, None] * x
    for c in tl.static_range(C):
        qg = tl.load(qg_ptr + c * D + offs_d[None, None, :], mask=mask_d[None, None, :], other=0.0)
        do = tl.load(douts[c] + tok[None, :, None] * D + offs_d[None, None, :], mask=mask_td[None, :, :],
                     other=0.0).to(tl.float32)
        dlr = dlrs[c]
        dx += ws[c][:, :, None] * do + dlr[:, :, None] * qg
        dq = tl.sum(tl.sum(dlr[:, :, None] * x, axis=0), axis=0)  # (D,)
        dqg += tl.where(offs_c[:, None] == c, dq[None, :], 0.0)
    tl.store(dsrc_ptr + rows[:, :, None] * D + offs_d[None, None, :], dx.to(dsrc_ptr.dtype.element_ty), mask=mask_x)
    return dqg


@triton.jit
def _grads_rows(src_ptr, qg_ptr, douts, w_ptr, dlr_ptr, coef_ptr, dsrc_ptr, dqs, s0, n, n_add, tok, mask_t, mask_td,
                offs_d, mask_d, N, D, C: tl.constexpr, KEY_NORM: tl.constexpr, BLOCK_S: tl.constexpr):
    """The split gradients of sources s0 .. s0 + BLOCK_S - 1 as separate rows (1, T, D) (``ROWS``): each loaded,
    every consumer's terms added to each, one fused multiply-add a term, and written; returns the consumers'
    query-gradient partials (a tuple of C (1, T, D)) with this trip's terms."""
    xs = ()
    dxs = ()
    for j in tl.static_range(BLOCK_S):  # every row's loads first, so that they are in flight together
        x, mask_s, rows = _load_chunk(src_ptr, s0 + j, n, tok, mask_td, offs_d, N, D, 1)  # (1, T, D)
        dx = _earlier_dsrc(dsrc_ptr, rows, offs_d, mask_s[:, None, None] & mask_td[None, :, :], n_add, N, D)
        if KEY_NORM:
            dx += tl.load(coef_ptr + rows, mask=mask_s[:, None] & mask_t[None, :], other=0.0)[:, :, None] * x
        xs = xs + (x,)
        dxs = dxs + (dx,)
    for c in tl.static_range(C):
        # no fill values: past d or the last token they reach only dx there, which is not stored (no zeroing of
        # registers before the loads)
        qg = tl.load(qg_ptr + c * D + offs_d[None, None, :], mask=mask_d[None, None, :])
        do = tl.load(douts[c] + tok[None, :, None] * D + offs_d[None, None, :], mask=mask_td[None, :, :]).to(tl.float32)
        dq = dqs[c]
        for j in tl.static_range(BLOCK_S):
            row = (s0 + j).to(tl.int64) * N + tok  # (T,)
            mask_r = mask_t & (s0 + j < n)
            w = tl.load(w_ptr + c * n * N + row, mask=mask_r, other=0.0)[None, :, None]
            dlr = tl.load(dlr_ptr + c * n * N + row, mask=mask_r, other=0.0)[None, :, None]
            dx = dxs[j] + w * do
            dx += dlr * qg
            dxs = dxs[:j] + (dx,) + dxs[j + 1:]
            dq += dlr * xs[j]
        dqs = dqs[:c] + (dq,) + dqs[c + 1:]
    for j in tl.static_range(BLOCK_S):
        rows = (s0 + j).to(tl.int64) * N + tok  # (T,)
        tl.store(dsrc_ptr + rows[None, :, None] * D + offs_d[None, None, :], dxs[j].to(dsrc_ptr.dtype.element_ty),
                 mask=mask_td[None, :, :] & (s0 + j < n))
    return dqs


@triton.jit
def _split_grads_kernel(
    src_ptr,  # sources (n_max, N, d) contiguous; rows [0, n) are read
    qg_ptr,  # gain-folded queries (C, d) fp32
    douts,  # tuple of C upstream gradients of the outputs, each (N, d) contiguous
    w_ptr, dlr_ptr, coef_ptr,  # the first kernel's (C, n, N), (C, n, N), (n, N) fp32
    dsrc_ptr,  # result: gradient of the sources (n, N, d) (rows [0, n_add) added into, the rest written)
    dqg_ptr,  # result: per-program partial gradient of q ⊙ g (programs, C, d) fp32
    n, n_add, N, D,
    C: tl.constexpr, BLOCK_C: tl.constexpr, KEY_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    """Split backward, second kernel: elementwise over d from the first kernel's scalars (no reduction over d, so
    no communication between warps), persistent, with the per-program query-gradient partial in registers:
        dx_s = Σ_c (w_cs dO_c + dlr_cs qg_c) + coef_s x_s,   dqg_c += Σ_s dlr_cs x_s.
    ``ROWS`` (``SPLIT_GRADS_ROWS``): the BLOCK_S sources of a trip as BLOCK_S separate rows and each consumer's
    partial apart (a tuple), so that every term is one fused multiply-add into its accumulator; else one
    (BLOCK_S, T, D) load, whose products are summed over the sources before they are added. ``PREFETCH``
    (``SPLIT_GRADS_PREFETCH``, not with ROWS): 1, the next trip's sources are loaded before this trip's arithmetic, so
    that a program has a trip's loads in flight while it computes (else each trip waits for its own); 2, its scalars
    (w, dlogit·r, the key norm's coefficient) too; 0, none."""
    pid, n_prog, offs_d, offs_c, mask_d, dqg, n_tiles = _persistent_start(N, D, BLOCK_C, BLOCK_T, BLOCK_D)
    if ROWS:
        dqs = (tl.zeros((1, BLOCK_T, BLOCK_D), dtype=tl.float32),) * C  # consumer c's partial, summed over T at the end
    tile = pid
    if PREFETCH > 0:  # one loop over the program's (token block, trip) pairs, each trip's loads a trip ahead
        s0 = pid * 0
        rows, mask_st = _trip_rows(tile, s0, n, N, n_tiles, BLOCK_S, BLOCK_T)
        xr = _load_raw(src_ptr, rows, mask_st, offs_d, mask_d, D)
        if PREFETCH == 2:
            ws, dlrs, coef = _trip_scalars(w_ptr, dlr_ptr, coef_ptr, rows, mask_st, n, N, C, KEY_NORM)
        while tile < n_tiles:
            offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            mask_t = offs_t < N
            mask_td = mask_t[:, None] & mask_d[None, :]
            tok = offs_t.to(tl.int64)
            mask_s = s0 + tl.arange(0, BLOCK_S) < n
            # recomputed, not carried from the last trip's rows1: carried, they cross the loop in another layout (22
            # layout conversions against 1 by the sm_90 compiler)
            rows, mask_st = _trip_rows(tile, s0, n, N, n_tiles, BLOCK_S, BLOCK_T)
            wrap = s0 + BLOCK_S >= n  # the next trip: this token block's next sources, or the next block's first
            s1 = tl.where(wrap, 0, s0 + BLOCK_S)
            tile1 = tl.where(wrap, tile + n_prog, tile)
            rows1, mask_st1 = _trip_rows(tile1, s1, n, N, n_tiles, BLOCK_S, BLOCK_T)
            xr_next = _load_raw(src_ptr, rows1, mask_st1, offs_d, mask_d, D)
            if PREFETCH == 2:  # the next trip's scalars too
                ws1, dlrs1, coef1 = _trip_scalars(w_ptr, dlr_ptr, coef_ptr, rows1, mask_st1, n, N, C, KEY_NORM)
            else:
                ws, dlrs, coef = _trip_scalars(w_ptr, dlr_ptr, coef_ptr, rows, mask_st, n, N, C, KEY_NORM)
            dqg = _grads_block(xr.to(tl.float32), ws, dlrs, coef, mask_s, rows, dqg, qg_ptr, douts, dsrc_ptr, n_add,
                               tok, mask_t, mask_td, offs_c, offs_d, mask_d, N, D, C, KEY_NORM)
            xr = xr_next
            if PREFETCH == 2:
                ws = ws1
                dlrs = dlrs1
                coef = coef1
            s0 = s1
            tile = tile1
    else:
        while tile < n_tiles:
            offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            mask_t = offs_t < N
            mask_td = mask_t[:, None] & mask_d[None, :]
            tok = offs_t.to(tl.int64)
            s0 = pid * 0  # BLOCK_S sources at a time (the upstream gradients again from L1 after the first chunk)
            while s0 < n:
                if ROWS:
                    dqs = _grads_rows(src_ptr, qg_ptr, douts, w_ptr, dlr_ptr, coef_ptr, dsrc_ptr, dqs, s0, n, n_add,
                                      tok, mask_t, mask_td, offs_d, mask_d, N, D, C, KEY_NORM, BLOCK_S)
                else:
                    x, mask_s, rows = _load_chunk(src_ptr, s0, n, tok, mask_td, offs_d, N, D, BLOCK_S)  # (S, T, D)
                    ws, dlrs, coef = _trip_scalars(w_ptr, dlr_ptr, coef_ptr, rows, mask_s[:, None] & mask_t[None, :],
                                                   n, N, C, KEY_NORM)
                    dqg = _grads_block(x, ws, dlrs, coef, mask_s, rows, dqg, qg_ptr, douts, dsrc_ptr, n_add, tok,
                                       mask_t, mask_td, offs_c, offs_d, mask_d, N, D, C, KEY_NORM)
                s0 += BLOCK_S
            tile += n_prog
    if ROWS:
        for c in tl.static_range(C):  # row pid·C + c of (programs, C, d), in the rows' layout
            dq = tl.sum(tl.sum(dqs[c], axis=0, keep_dims=True), axis=1, keep_dims=True)  # (1, 1, D)
            tl.store(dqg_ptr + (pid * C + c).to(tl.int64) * D + offs_d[None, None, :], dq, mask=mask_d[None, None, :])
    else:
        _store_partial(dqg_ptr, dqg, pid, offs_c, offs_d, mask_d, C, D)


@triton.jit
def _merge_fwd_kernel(
    o_ptr,  # phase-1 output of this consumer (N, d)
    lse_ptr,  # its log-sum-exp (N,) fp32
    p_ptr,  # the intra-block partial (N, d)
    qg_ptr,  # gain-folded query (d,) fp32
    h_ptr,  # result: merged output (N, d)
    w_ptr,  # result: weight of the partial in the merged softmax (N,) fp32
    new_ptr,  # SUM: the block's newest output (N, d), summed into the partial here
    psum_ptr,  # SUM: result: partial + new (N, d), in the promoted dtype (the residual's next partial)
    N, D, eps,
    KEY_NORM: tl.constexpr, SUM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < N
    mask_d = offs_d < D
    mask = mask_t[:, None] & mask_d[None, :]
    td = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]
    qg = tl.load(qg_ptr + offs_d, mask=mask_d, other=0.0)
    o = tl.load(o_ptr + td, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + td, mask=mask, other=0.0).to(tl.float32)
    if SUM:  # the running partial sum, rounded to its dtype as a separate add would store it, and merged as stored
        p = (p + tl.load(new_ptr + td, mask=mask, other=0.0).to(tl.float32)).to(psum_ptr.dtype.element_ty)
        tl.store(psum_ptr + td, p, mask=mask)
        p = p.to(tl.float32)
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    z = tl.sum(p * qg[None, :], axis=1)
    if KEY_NORM:
        z = z * tl.rsqrt(tl.sum(p * p, axis=1) / D + eps)
    # online-softmax merge of {phase-1 sources} (lse) with one more source (logit z)
    w = 1.0 / (1.0 + tl.exp(lse - z))
    h = o + w[:, None] * (p - o)
    tl.store(h_ptr + td, h.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(w_ptr + offs_t, w, mask=mask_t)


@triton.jit
def _merge_bwd_kernel(
    h_ptr,  # the merge's output (N, d); KEPT_O: the phase-1 output o instead
    p_ptr,  # the partial (N, d)
    qg_ptr,  # gain-folded query (d,) fp32
    w_ptr,  # forward weight of the partial (N,) fp32
    dh_ptr,  # upstream gradient of h (N, d) contiguous
    do_ptr,  # result: gradient of o (N, d), o's dtype
    dp_ptr,  # result: gradient of the partial (N, d), the partial's dtype
    dlse_ptr,  # result: gradient of the phase-1 log-sum-exp (N,) fp32
    dqg_ptr,  # result: per-program partial gradient of q ⊙ g (programs, d) fp32
    dpin_ptr,  # DP_IN: the partial's gradient from its other readers (N, d), added into dp
    N, D, eps,
    KEY_NORM: tl.constexpr, DP_IN: tl.constexpr, KEPT_O: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    qg = tl.load(qg_ptr + offs_d, mask=mask_d, other=0.0)
    dqg = tl.zeros((BLOCK_D,), dtype=tl.float32)
    n_tiles = tl.cdiv(N, BLOCK_T)
    tile = pid
    while tile < n_tiles:
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < N
        mask = mask_t[:, None] & mask_d[None, :]
        td = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]
        h = tl.load(h_ptr + td, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + td, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + td, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_t, mask=mask_t, other=0.0)
        if KEPT_O:  # h_ptr holds o: through w = σ(z − lse), dz = w(1−w)·dh·(p − o)
            dz = w * (1.0 - w) * tl.sum(dh * (p - h), axis=1)
        else:  # the same from the output, as p − h = (1−w)(p − o)
            dz = w * tl.sum(dh * (p - h), axis=1)
        dp = w[:, None] * dh
        if DP_IN:
            dp += tl.load(dpin_ptr + td, mask=mask, other=0.0).to(tl.float32)
        if KEY_NORM:
            r = tl.rsqrt(tl.sum(p * p, axis=1) / D + eps)
            nk = p * r[:, None]
            z = tl.sum(nk * qg[None, :], axis=1)
            dp += (dz * r)[:, None] * (qg[None, :] - nk * (z / D)[:, None])
            dqg += tl.sum(dz[:, None] * nk, axis=0)
        else:
            dp += dz[:, None] * qg[None, :]
            dqg += tl.sum(dz[:, None] * p, axis=0)
        tl.store(do_ptr + td, ((1.0 - w)[:, None] * dh).to(do_ptr.dtype.element_ty), mask=mask)
        tl.store(dp_ptr + td, dp.to(dp_ptr.dtype.element_ty), mask=mask)
        tl.store(dlse_ptr + offs_t, -dz, mask=mask_t)
        tile += n_prog
    tl.store(dqg_ptr + pid.to(tl.int64) * D + offs_d, dqg, mask=mask_d)


# --- launchers -----------------------------------------------------------------------------------
# Host-side arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr
# functions whose every host call costs microseconds, and a block launches these kernels ~8 times.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@dataclass(frozen=True)
class Tiles:
    """One program's tile: BLOCK_T tokens × all d channels (warps along d: 16 fp32 per thread and
    row), BLOCK_S sources per load, ``one_chunk`` when every source fits in one load; the backward
    holds more per source (the gradient too) and may take fewer sources per load."""

    block_t: int
    block_d: int
    block_s: int
    one_chunk: bool
    num_warps: int
    bwd_block_s: int
    bwd_one_chunk: bool
    bwd_unroll_c: bool
    bwd_warps: int = 0  # the backward's warps (0: num_warps)
    bwd_maxnreg: int = 0  # the backward's cap on registers a thread (0: the compiler's choice)
    bwd_split: bool = False  # the backward as two kernels, scalars then gradients (``split_tiles``)
    tail_s: int = 0  # the forward's second load when one_chunk (``FWD_TAIL``): sources block_s .. block_s + tail_s - 1


# The phase-1 backward at d > 512 (two or more warps a token): None keeps the tiles below (and ``NARROW_WIDE_BWD``);
# (sources per load, warps, consumers unrolled, register cap or 0) replaces them, e.g. in a benchmark row
# ``py:kernels.depth_attn.fused.WIDE_BWD=(8,8,False,128)``; (2,2,True,0) gives the tiles before ``NARROW_WIDE_BWD``
# (benchmarks.depth_attn_tiles times such tiles alone: a seventh field there is the cap).
WIDE_BWD: tuple[int, int, bool, int] | None = None


# Measured on an H200 (``benchmarks.depth_attn_tiles --shapes medium --dtypes bf16 --ops block_n3 block_n4 block_n6
# block_n8``, 4 consumers, 2026-12-03): at d = 1024 a backward over 3 or 4 sources in one load of 4 over 4 warps capped
# at 168 registers (8 bytes of spills, 12 warps an SM against the default's 8) took 0.72 and 0.80 ms against 1.09 and
# 1.13 (two passes of 2 over 2 warps, 255 registers and 376 bytes of spills); from 6 sources on it was slower (1.97
# against 1.64 ms at 6), so the rule stops at 4. Not measured with more than 4 consumers: those keep the default.
NARROW_WIDE_BWD = (4, 4, False, 168)


# The phase-1 backward as two kernels (``_split_scores_kernel`` then ``_split_grads_kernel``): True everywhere, False
# nowhere, None where ``split_backward`` says. A module setting so that a benchmark row can time each
# (``py:kernels.depth_attn.fused.SPLIT_BWD=False``).
SPLIT_BWD: bool | None = None
# Measured on an H200 (``benchmarks.depth_attn_tiles --shapes medium --dtypes bf16 --phase1 one-kernel split
# split-once``, bf16 sources, 2026-12-04): split with its scores reduced once (``SCORES_ONCE``) against one kernel at
# d = 1024, 4 consumers, 2 / 3 / 4 / 5 / 6 / 8 sources: 0.87 / 0.89 / 0.89 / 0.74 / 0.77 / 0.68x, and 0.69x for the
# final output's one consumer over 9 (reduced a chunk at a time). The rule splits from 2 to 9 sources at d = 1024
# (7 lies between measured counts; one source, other widths and more sources were not measured). Reduced a chunk at a
# time, the split lost at 2-4 sources (1.39 / 1.09 / 1.06x): from 2026-12-03 night until then the rule was (5, 9).
SPLIT_SOURCES = (2, 9)
# The split backward's tiles on the GPU: None (``split_tiles``'s) or (tokens, channels a chunk, warps of the scores
# kernel, sources a load, warps of the gradients kernel), e.g. in a benchmark row or a sweep candidate
# (``benchmarks.depth_attn_tiles --phase1 split:4,64,4,1,4``).
SPLIT_TILES: tuple[int, int, int, int, int] | None = None
# The split backward's scores kernel summing its products over the chunks elementwise and reducing over the channels
# once (``_split_scores_kernel``'s ONCE) instead of one reduction a chunk: None (``scores_once``'s rule: from 2
# consumers), True or False. Alone at `medium` (2026-12-04, ms, chunk -> once): 4 consumers over 2 / 3 / 4 sources
# 0.668 / 0.770 / 0.835 -> 0.417 / 0.628 / 0.697, over 5 / 6 / 8 sources 1.225 / 1.297 / 1.487 -> 1.173 / 1.248 /
# 1.460; one consumer over 9 1.145 -> 1.173 (slower).
SCORES_ONCE: bool | None = None


# The split backward's scores kernel taking the logits and the key norm's r_s from the forward (which stores them,
# (C, n, N) and (n, N) fp32, where its backward will run split) instead of summing q_c ⊙ g_c · x_s and x_s² again:
# True or False (``py:kernels.depth_attn.fused.SCORES_FROM_LOGITS=False`` in a benchmark row times the pass before).
# Alone at `medium` (2026-12-04, 4 consumers, the split backward with the chunks of each): 0.66-0.89x the time summing
# them again at 2-8 sources, 0.91x for one consumer over 9; the step about 1 ms faster in the same process (0.958 /
# 0.961x -> 0.964 / 0.970 / 0.964x vanilla's).
SCORES_FROM_LOGITS = True


def scores_from_logits(n: int, d: int, c: int) -> bool:
    """Whether phase 1 over n sources for c consumers at width d keeps its logits and r_s for the split backward
    (``SCORES_FROM_LOGITS`` where the backward runs split)."""
    if SCORES_FROM_LOGITS not in (True, False):
        raise ValueError(f"fused.SCORES_FROM_LOGITS={SCORES_FROM_LOGITS!r}: choose True or False")
    return SCORES_FROM_LOGITS and tiles(n, d, c).bwd_split


# The split backward's gradients kernel under a cap on registers a thread (a launch option, part of its
# specialisation): None leaves them to the compiler (168 at d = 1024 with 2 sources a load: 3 programs of 4 warps an
# SM); 128 compiles without spills by the sm_90 compiler (4 programs), 96 spills 184 bytes. Measured (2026-12-04,
# `medium`): 128 alone 0.95x at 2 sources, 1.00-1.01x from 3 on, and the step no faster with the rows' order reversed;
# 96 1.10-1.42x. Off.
SPLIT_GRADS_MAXNREG: int | None = None


def split_grads_maxnreg() -> int:
    """The split gradients kernel's register cap (``SPLIT_GRADS_MAXNREG``; 0: none, and always none under the
    interpreter)."""
    cap = SPLIT_GRADS_MAXNREG
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or not 32 <= cap <= 255):
        raise ValueError(f"fused.SPLIT_GRADS_MAXNREG={cap!r}: choose None (the compiler's choice) or a register count "
                         "from 32 to 255")
    return 0 if cap is None or interpreting() else cap


# The split backward's gradients kernel over a trip's sources as separate rows, each consumer's query-gradient
# partial apart (``_split_grads_kernel``'s ROWS): True or False. Every term is then one fused multiply-add into its
# accumulator, where one (S, T, D) load multiplies, sums over the sources, then adds; by the sm_90 compiler (bf16
# sources, 4 consumers, d = 1024, 2 sources a trip) 476 instructions a trip against 581, fp32 208 against 312, 164
# registers against 168. Measured slower (2026-12-04, `medium`, the split backward alone): 0.95x at 2 sources but
# 1.08-1.11x at 3-8 and 1.01x for one consumer over 9; the step unchanged (157.0 / 157.6 ms against 157.8 / 157.1). The
# kernel is not bound by its instructions: by the counters it waits on its loads (54% of its stalls) with 3 warps a
# scheduler. At 8 warps a token (78 registers, no barrier: twice the warps an SM, the same tokens in flight) the rows
# were slower still, 1.13-1.24x alone (1.03x over 9 sources), and the step 158.8 / 158.9 ms against 158.7 / 157.8
# (``SPLIT_TILES``' fifth field sets the warps). Off.
SPLIT_GRADS_ROWS = False


# The split gradients kernel loading each trip's sources a trip ahead (``_split_grads_kernel``'s PREFETCH, in loads of
# BLOCK_S sources, not as rows): False, True, or "all" (the trip's scalars w, dlogit·r and the key norm's coefficient
# a trip ahead too). A program's trips are serial and each waits for its loads (one token, 2 sources a trip at
# d = 1024); prefetched, one trip's loads are in flight while the last computes. The held sources take 12 registers
# more (180 by the sm_90 compiler: 2 programs an SM), so the kernel is capped at 168 (no spills, 3 programs an SM, as
# without) unless ``SPLIT_GRADS_MAXNREG`` sets a cap. Measured with True (2026-12-04, `medium`, 4 consumers, the split
# backward alone): 0.95x / 0.97x at 2 / 3 sources, 0.99-1.02x from 4 on, 1.00x for one consumer over 9; the step
# unchanged (160.3 / 159.6 ms against 159.7 / 160.1, alternating). "all" (168 registers, no spills, 10 layout
# conversions: the next trip's scalars come in their own layout) is built and tested on the CPU, not timed. Off.
SPLIT_GRADS_PREFETCH: bool | str = False
PREFETCH_MAXNREG = 168


def split_grads_prefetch() -> int:
    """What the split gradients kernel loads a trip ahead (``SPLIT_GRADS_PREFETCH``): 0 nothing, 1 the sources, 2 the
    sources and the scalars ("all"); refused with ``SPLIT_GRADS_ROWS``, which it does not apply to."""
    setting = SPLIT_GRADS_PREFETCH
    if not (isinstance(setting, bool) or setting == "all"):
        raise ValueError(f"fused.SPLIT_GRADS_PREFETCH={setting!r}: choose False, True (the sources) or 'all' (the "
                         "sources and the scalars)")
    if setting is not False and split_grads_rows():
        raise ValueError(f"fused.SPLIT_GRADS_PREFETCH={setting!r} applies to loads of a trip's sources, not to "
                         "SPLIT_GRADS_ROWS=True: set one of them")
    return 2 if setting == "all" else int(setting)


def split_grads_rows() -> bool:
    """Whether the split gradients kernel takes a trip's sources as separate rows (``SPLIT_GRADS_ROWS``)."""
    if not isinstance(SPLIT_GRADS_ROWS, bool):
        raise ValueError(f"fused.SPLIT_GRADS_ROWS={SPLIT_GRADS_ROWS!r}: choose True or False")
    return SPLIT_GRADS_ROWS


def scores_once(c: int) -> bool:
    """Whether the split scores kernel for c consumers reduces once (``SCORES_ONCE``; unset: from 2 consumers)."""
    if SCORES_ONCE not in (None, True, False):
        raise ValueError(f"fused.SCORES_ONCE={SCORES_ONCE!r}: choose None (the rule: from 2 consumers), True or False")
    return c >= 2 if SCORES_ONCE is None else SCORES_ONCE


# The phase-1 forward's warps a token at d > 512: None keeps one warp per 512 channels (2 at d = 1024); e.g. 4
# (``py:kernels.depth_attn.fused.FWD_WARPS=4``; the backward keeps its own). By the sm_90 compiler (bf16 sources, 4
# consumers, d = 1024) a thread then holds 148 registers instead of 227 with 8 sources in registers, 71 instead of 155
# with 4: more programs an SM, at a reduction over 4 warps instead of 2. Measured slower (2026-12-04, `medium`, bf16, 4
# consumers): 1.04-1.22x alone at 2-9 sources, the step 0.950x against 0.957x without it: off by default.
FWD_WARPS: int | None = None
# The phase-1 forward over 3 or 5 sources in two loads held in registers (2 + 1, 4 + 1 rows) instead of one padded to
# the next power of two (4, 8), whose padded rows cost registers and arithmetic though no bytes. Alone at `medium`,
# bf16, 4 consumers (2026-12-04): 3 sources 0.215 -> 0.191 ms, 5 sources 0.401 -> 0.292; 6 sources as 4 + 2 rows gained
# nothing (0.405 -> 0.409), so a tail is one row. False: one padded load everywhere.
FWD_TAIL = True


# The phase-1 forward with its sources streamed (``_summaries_fwd_stream_kernel``): 1, 2 or 4 rows a load, each
# folded into every consumer's online-softmax state, so a thread holds C accumulators and one load's rows instead of
# up to 8 rows, and every source is read once for all consumers; 0 keeps the kernel of before (every source of a token
# in registers at once when they fit one load of 8, else chunk by chunk with the later consumers reading the chunks
# again). ``FWD_STREAM_PREFETCH`` issues the next load before a load's arithmetic. Applies from ``FWD_STREAM_FROM``
# sources on. By the sm_90 compiler (bf16 sources, 4 consumers, d = 1024; ``python -m benchmarks.depth_attn_ptxas``):
# 127 / 128 registers at 1 row a load without / with the prefetch, 187 / 199 at 2, against 151 (5 sources as 4 + 1)
# and 219 (8). Measured on an H200 (2026-12-04, `medium`, bf16, alone, ms; ``depth_attn_tiles_nvidia_h200_medium_stream.md``):
# 4 consumers over 2-8 sources the one load wins everywhere (1 row prefetched 1.01-1.39x its time, 2 rows 1.11-1.83x;
# the step 0.958x / 0.953x against 0.963x / 0.954x without), but the final output's one consumer over 9 sources, which
# took two chunks, is 0.2949 -> 0.2053 ms with 1 row prefetched (0.2140 without the prefetch, 0.3445 / 0.2773 at 2
# rows). So the rule streams 1 row a load, prefetched, where the sources do not fit one load (from 9).
FWD_STREAM = 1
FWD_STREAM_PREFETCH = True
FWD_STREAM_FROM = 9


def fwd_stream(n: int) -> int:
    """Rows a load of the streamed forward over n sources (``FWD_STREAM``), 0 where it does not apply."""
    if FWD_STREAM not in (0, 1, 2, 4) or isinstance(FWD_STREAM, bool):
        raise ValueError(f"fused.FWD_STREAM={FWD_STREAM!r}: choose 0 (every source in registers at once) or 1, 2, 4 "
                         "(rows a load, streamed)")
    if not isinstance(FWD_STREAM_PREFETCH, bool):
        raise ValueError(f"fused.FWD_STREAM_PREFETCH={FWD_STREAM_PREFETCH!r}: choose True or False")
    if not isinstance(FWD_STREAM_FROM, int) or isinstance(FWD_STREAM_FROM, bool) or FWD_STREAM_FROM < 1:
        raise ValueError(f"fused.FWD_STREAM_FROM={FWD_STREAM_FROM!r}: choose a source count >= 1")
    return min(FWD_STREAM, _pow2(n)) if FWD_STREAM and n >= FWD_STREAM_FROM else 0


def _fwd_tail(n: int, block_s: int, on: bool) -> tuple[int, int]:
    """(head, tail) rows of the forward's loads for n sources whose one load is block_s rows: (block_s, 0) unless
    ``on`` (``FWD_TAIL``) and n is one past a power of two below block_s (3 -> 2 + 1, 5 -> 4 + 1; 6 and 7 stay 8)."""
    head = 1 << (n.bit_length() - 1)
    if not on or n > block_s or n - head != 1:
        return block_s, 0
    return head, 1


def split_backward(n: int, d: int, c: int | None) -> bool:
    """Whether the phase-1 backward over n sources for c consumers at width d runs split (``SPLIT_BWD``; unset:
    ``SPLIT_SOURCES`` sources at d = 1024 on the GPU unless ``WIDE_BWD`` sets the one kernel's tiles, never under the
    interpreter)."""
    if SPLIT_BWD not in (None, True, False):
        raise ValueError(f"fused.SPLIT_BWD={SPLIT_BWD!r}: choose None (the rule), True or False")
    if SPLIT_BWD is not None:
        return SPLIT_BWD
    if WIDE_BWD is not None:  # the one kernel's tiles set above 512 channels: the rule gives way to them
        return False
    return not interpreting() and _pow2(d) == 1024 and SPLIT_SOURCES[0] <= n <= SPLIT_SOURCES[1]


def split_tiles(n: int, d: int, c: int, from_logits: bool | None = None
                ) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """The split backward's tiles: ((tokens, channels a chunk, warps) of the scores kernel, (tokens, channels,
    sources a load) of the gradients kernel, its warps). Scores: one warp a token (its dot products are reductions
    inside a warp), chunks of 256 channels for one source, 128 for two, 64 above; reduced once (``scores_once``), 1024
    values a token's chunk over sources and consumers, at least 64 when the logits come from the forward
    (``from_logits``, default ``SCORES_FROM_LOGITS``), else at least 32 and 16 from 5 sources on. Gradients: one
    token a program over all d, 2 sources a load for 3 or more consumers, else 4. From the sm_90 compiler's report
    (bf16 sources, d = 1024, 4 warps, 4 consumers): scores 72-114 registers from the logits (48 at chunks of 16),
    gradients 168, no spills. Under the interpreter: 32 tokens, 16-channel chunks, 2 sources a load (the chunk loops
    and their ragged ends run in the CPU tests)."""
    block_s, block_d = _pow2(n), _pow2(d)
    if interpreting():
        return (32, min(block_d, 16), 4), (32, block_d, min(block_s, 2)), 4
    if SPLIT_TILES is not None:
        if len(SPLIT_TILES) != 5 or not all(isinstance(v, int) and v > 0 for v in SPLIT_TILES):
            raise ValueError(f"SPLIT_TILES={SPLIT_TILES!r}: expected (tokens, channels a chunk, warps of the scores kernel, "
                             "sources a load, warps of the gradients kernel), positive integers, or None")
        bt, chunk, warps_a, per_load, warps_b = SPLIT_TILES
        return (bt, min(block_d, _pow2(chunk)), warps_a), (1, block_d, min(block_s, _pow2(per_load))), warps_b
    if from_logits is None:
        from_logits = bool(SCORES_FROM_LOGITS)
    if scores_once(c) and from_logits:  # one (S, T, C, chunk) accumulator: alone at `medium` (2026-12-04, 4
        # consumers) chunks of 64 from 5 sources on took 0.94-0.95x the time at 16 and 0.94-0.96x at 32; at 2-4 sources
        # the rule's 128 / 64 / 64 beat 32 (0.82-0.87x)
        chunk = min(block_d, max(64, min(256, 1024 // (block_s * _pow2(c)))))
    elif scores_once(c):  # (S, C, chunk) accumulators twice, about 32 fp32 a thread each: 126-168 registers, no spills
        # from 5 sources (a load of 8 rows) chunks of 16: 80 registers and 3 layout conversions against 168 and 9 at 32,
        # alone at `medium` 0.85-0.87x the time at 32; at 3 sources 16 was 1.13x its chunk of 64
        chunk = min(block_d, 16 if block_s >= 8 else max(32, min(256, 1024 // (block_s * _pow2(c)))))
    else:
        chunk = min(block_d, 256 if block_s == 1 else 128 if block_s == 2 else 64)
    return (4, chunk, 4), (1, block_d, min(block_s, 2 if c >= 3 else 4)), 4


def tiles(n: int, d: int, c: int | None = None) -> Tiles:
    """The tiles of a phase-1 call over n sources for c consumers at width d: the GPU's (``_tiles``, with the split
    backward where ``split_backward`` says; else above 512 channels ``WIDE_BWD`` where set, else ``NARROW_WIDE_BWD``
    for 3 or 4 sources of at most 4 consumers at d = 1024), or the interpreter's: 32 tokens per program (each program
    costs milliseconds there; split only where ``SPLIT_BWD`` is True)."""
    if interpreting():
        block_d, block_t, warps = _pow2(d), 32, 4
        block_s = min(_pow2(n), 8, max(1, 32 * 32 * warps // (block_t * block_d)))
        head, tail = _fwd_tail(n, block_s, bool(FWD_TAIL))
        return Tiles(block_t, block_d, head, n <= block_s, warps, block_s, n <= block_s, True,
                     bwd_split=split_backward(n, d, c), tail_s=tail)
    if FWD_WARPS not in (None, 1, 2, 4, 8, 16):  # refused at any width, though it applies above 512 channels only
        raise ValueError(f"fused.FWD_WARPS={FWD_WARPS!r}: choose None (one warp per 512 channels) or 1, 2, 4, 8, 16")
    fwd_warps = FWD_WARPS if FWD_WARPS is not None and _pow2(d) > 512 else 0
    if split_backward(n, d, c):
        return _tiles(n, d, split=True, fwd_warps=fwd_warps, tail=bool(FWD_TAIL))
    wide = None if _pow2(d) <= 512 else WIDE_BWD
    if wide is None and _pow2(d) == 1024 and 3 <= n <= 4 and c is not None and c <= 4:
        wide = NARROW_WIDE_BWD
    return _tiles(n, d, wide, fwd_warps=fwd_warps, tail=bool(FWD_TAIL))


@functools.lru_cache(maxsize=None)
def _tiles(n: int, d: int, wide: tuple | None = None, split: bool = False, fwd_warps: int = 0,
           tail: bool = False) -> Tiles:
    """Fixed tiles (no autotuning: nothing to time at the first call, one compile per (C, d, n-chunking)); ``split``:
    the backward as two kernels (its own tiles: ``split_tiles``); ``fwd_warps`` (0: as below) the forward's warps, the
    backward keeping its own; ``tail`` (``FWD_TAIL``, part of the cache's key) the forward in two loads.

    GPU: 16 fp32 of a row per thread: one token per program for d >= 512 with one warp per 512
    channels, else as many tokens as make a 512-value row in one warp. A reduction over d then stays
    inside one warp (shuffles) up to d = 512; four warps per 512-channel row, as before, made every
    logit and sum of squares a cross-warp reduction through shared memory, and the kernels were bound by
    it (L1/shared 90% busy, DRAM 7-15%: benchmarks/kernel_counters.py). The forward loads up to 8
    sources at once (at most 128 fp32 of a chunk per thread), so a block of Block AttnRes with up to 8
    summaries is read once for all consumers; the backward, which also holds the chunk's gradient,
    takes 1 at one warp and 2 above. Measured on an H200 (``python -m benchmarks.depth_attn_tiles``, fp32
    sources), Block AttnRes (5 summaries, 4 consumers) and AttnRes (17 sources, 2 consumers), against the
    tiles before: at d = 512 forward 0.133 -> 0.106 ms and 0.316 -> 0.251, backward 0.505 -> 0.335 (0.272
    with one source a load, 2026-12-01 evening) and 1.240 -> 0.663; at d = 1024
    forward 0.591 -> 0.382 and 1.324 -> 0.921, backward 2.082 -> 1.583 and 5.307 -> 2.900."""
    block_d = _pow2(d)
    block_t = max(1, 512 // block_d)
    warps = max(1, block_d // 512)
    block_s = min(_pow2(n), 8)
    head, tail_s = _fwd_tail(n, block_s, tail)
    # one source per backward load at one warp (d <= 512), two above: Block AttnRes's backward at d = 512
    # 0.336 -> 0.272 ms (AttnRes's equal); at d = 1024 one source was slower (1.58 -> 1.76 ms)
    bwd_block_s = 1 if warps == 1 else min(block_s, 2)
    # 16 warps cap a thread at 128 registers: there the backward loops over the consumers instead of
    # unrolling them (unrolled, the compiler overlaps their upstream-gradient loads but keeps them live)
    if wide is not None:
        if len(wide) != 4 or not all(isinstance(v, int) and v >= 0 for v in wide) or not wide[0] or not wide[1]:
            raise ValueError(f"WIDE_BWD={wide!r}: expected (sources per load, warps, consumers unrolled, register cap "
                             "or 0), e.g. (8, 8, False, 128), or None")
        wide_s = min(_pow2(n), _pow2(wide[0]))
        return Tiles(block_t, block_d, head, n <= block_s, fwd_warps or warps, wide_s, n <= wide_s, bool(wide[2]),
                     wide[1], wide[3], split, tail_s)
    return Tiles(block_t, block_d, head, n <= block_s, fwd_warps or warps, bwd_block_s, n <= bwd_block_s, warps < 16,
                 bwd_warps=warps if fwd_warps else 0, bwd_split=split, tail_s=tail_s)


_RESIDENT: dict = {}


def _resident_programs(kernel, args, meta, num_warps: int, device: torch.device) -> int:
    """Programs of a persistent kernel: as many as fit on the GPU at once (registers, threads and
    shared memory of the compiled kernel, cached per specialisation), so one wave covers every token
    block and the per-program partial sums stay few."""
    key = (id(kernel), device.index, *meta.values(), num_warps, *(a.dtype for a in args if isinstance(a, Tensor)))
    if key not in _RESIDENT:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        by_threads = 2048 // (32 * num_warps)
        try:  # compile without launching, then read the kernel's resources
            compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **meta)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            compiled._init_handles()
            per_warp = -(-max(1, compiled.n_regs) * 32 // 256) * 256  # registers go per warp, in units of 256
            by_regs = 65536 // (per_warp * num_warps)
            smem = compiled.metadata.shared
            by_smem = (227 * 1024) // smem if smem else by_threads
            fit = min(by_regs, by_threads, by_smem)
        except Exception as exc:  # a grid-size estimate only: the kernel itself still runs, say so once
            fit = 16 // num_warps
            warnings.warn(f"depth_attn: could not read the resources of {getattr(kernel, '__name__', kernel)} "
                          f"({type(exc).__name__}: {exc}); persistent grid of {fit} programs per SM")
        _RESIDENT[key] = sms * max(1, min(fit, 32))
    return _RESIDENT[key]


def _persistent_grid(kernel, args, meta, num_warps: int, n_tiles: int, device: torch.device) -> int:
    if interpreting():
        return min(n_tiles, 2)
    return max(1, min(n_tiles, _resident_programs(kernel, args, meta, num_warps, device)))


def summaries_fwd(src: Tensor, n: int, qg: Tensor, *, key_norm: bool, eps: float, store_logits: bool,
                  out_dtype: torch.dtype | None = None, store_rstd: bool = False, first_apart: bool = False):
    """src (n_max, B, T, d) contiguous, qg (C, d) fp32 -> out (C, B, T, d) in ``out_dtype`` (default: the
    sources'), lse (C, B, T) fp32, logits (C, n, B, T) fp32 or None, and the key norm's r_s (n, B, T) fp32 with
    ``store_rstd`` (else, and for raw keys, None). With ``first_apart`` out is a tuple of C tensors (B, T, d): consumer
    0's output in a tensor of its own (its sublayer keeps it for the backward without keeping the others' storage),
    consumers 1 .. C-1's views of one (C - 1, B, T, d) tensor."""
    shape = src.shape[1:]
    N, d = src[0].numel() // src.shape[-1], src.shape[-1]
    C = qg.shape[0]
    t = tiles(n, d, C)
    dt = dict(device=src.device, dtype=out_dtype or src.dtype)
    if first_apart:
        out0, rest = torch.empty(shape, **dt), torch.empty(C - 1, *shape, **dt)
        out = (out0, *rest.unbind(0))
    else:
        out = torch.empty(C, *shape, **dt)
        out0, rest = out[0], out[1:]
    rest = rest if C > 1 else out0  # (no consumer past the first: never written)
    lse = torch.empty(C, *shape[:-1], device=src.device, dtype=torch.float32)
    logits = torch.empty(C, n, *shape[:-1], device=src.device, dtype=torch.float32) if store_logits else lse
    store_rstd = store_rstd and key_norm
    rstd = torch.empty(n, *shape[:-1], device=src.device, dtype=torch.float32) if store_rstd else lse
    stream = fwd_stream(n)
    if stream:
        _summaries_fwd_stream_kernel[(_cdiv(N, t.block_t),)](
            src, qg, out0, rest, lse, logits, rstd, n, N, d, eps, C=C, KEY_NORM=key_norm, STORE_LOGITS=store_logits,
            STORE_RSTD=store_rstd, BLOCK_S=stream, BLOCK_T=t.block_t, BLOCK_D=t.block_d, PREFETCH=FWD_STREAM_PREFETCH,
            num_warps=t.num_warps)
        return out, lse, (logits if store_logits else None), (rstd if store_rstd else None)
    _summaries_fwd_kernel[(_cdiv(N, t.block_t),)](
        src, qg, out0, rest, lse, logits, rstd, n, N, d, eps, C=C, KEY_NORM=key_norm, STORE_LOGITS=store_logits,
        ONE_CHUNK=t.one_chunk, BLOCK_S=t.block_s, BLOCK_T=t.block_t, BLOCK_D=t.block_d, TAIL_S=t.tail_s,
        STORE_RSTD=store_rstd, num_warps=t.num_warps)
    return out, lse, (logits if store_logits else None), (rstd if store_rstd else None)


def summaries_bwd(src: Tensor, n: int, qg: Tensor, lse: Tensor, douts: tuple[Tensor, ...], dlse: Tensor,
                  *, key_norm: bool, eps: float, dsrc: Tensor | None = None, n_add: int = 0,
                  out: Tensor | None = None, logits: Tensor | None = None,
                  rstd: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """-> dsrc (n, B, T, d) in the sources' dtype, dqg (C, d) fp32.

    ``dsrc`` given (a buffer's :class:`~kernels.depth_attn.buffer.RowGradients`, (n_max, B, T, d) like
    ``src``): rows [0, n) are written into it, rows [0, n_add) added to what they hold; returned as is.
    ``out`` given (the forward's outputs, (C, B, T, d) contiguous): delta_c = dO_c·o_c is taken from them as
    stored, instead of from a first pass over the sources (where the sources take more than one load).
    ``logits`` (C, n, B, T) and, with the key norm, ``rstd`` (n, B, T) given (the forward's, ``scores_from_logits``):
    the split backward's scores kernel takes them instead of recomputing them; the one kernel ignores them."""
    N, d = src[0].numel() // src.shape[-1], src.shape[-1]
    C = qg.shape[0]
    t = tiles(n, d, C)
    if dsrc is None:
        dsrc, n_add = torch.empty(n, *src.shape[1:], device=src.device, dtype=src.dtype), 0
    elif dsrc.shape[1:] != src.shape[1:] or dsrc.shape[0] < n or not dsrc.is_contiguous() or not 0 <= n_add <= n:
        raise ValueError(f"summaries_bwd: dsrc must be contiguous ({n}+, {', '.join(map(str, src.shape[1:]))}) "
                         f"and 0 <= n_add <= n={n}; got {tuple(dsrc.shape)}, n_add={n_add}")
    if out is not None and (out.shape != (C, *src.shape[1:]) or not out.is_contiguous()):
        raise ValueError(f"summaries_bwd: out must be the contiguous outputs ({C}, {', '.join(map(str, src.shape[1:]))}),"
                         f" got {tuple(out.shape)}")
    if t.bwd_split:
        if logits is not None and (logits.shape != (C, n, *src.shape[1:-1]) or (key_norm and rstd is None)):
            raise ValueError(f"summaries_bwd: logits must be ({C}, {n}, {', '.join(map(str, src.shape[1:-1]))}) with "
                             f"rstd for the key norm; got {tuple(logits.shape)}, rstd {rstd is not None}")
        return dsrc, _split_bwd(src, n, qg, lse, douts, dlse, dsrc, n_add, key_norm, eps, C, N, d, logits, rstd)
    from_out = out is not None and not t.bwd_one_chunk  # one load of every source sums delta from it anyway
    meta = dict(C=C, BLOCK_C=_pow2(C), KEY_NORM=key_norm, ONE_CHUNK=t.bwd_one_chunk, UNROLL_C=t.bwd_unroll_c,
                BLOCK_S=t.bwd_block_s, BLOCK_T=t.block_t, BLOCK_D=t.block_d, DELTA_FROM_OUT=from_out)
    args = (src, qg, lse, douts, dlse, dsrc, None, out if from_out else qg, n, n_add, N, d, eps)
    warps = t.bwd_warps or t.num_warps
    if t.bwd_maxnreg:  # a launch option, compiled into the kernel: part of its specialisation like the tiles
        meta["maxnreg"] = t.bwd_maxnreg
    programs = _persistent_grid(_summaries_bwd_kernel, args[:6] + (qg,) + args[7:], meta, warps,
                                _cdiv(N, t.block_t), src.device)
    dqg = torch.empty(programs, C, d, device=src.device, dtype=torch.float32)
    _summaries_bwd_kernel[(programs,)](*args[:6], dqg, *args[7:], **meta, num_warps=warps)
    return dsrc, dqg.sum(0)


def _split_bwd(src, n, qg, lse, douts, dlse, dsrc, n_add, key_norm, eps, C, N, d, logits=None, rstd=None) -> Tensor:
    """The split backward: scalars (C, n, N) fp32 twice and (n, N), then the gradients (persistent); returns dqg
    (C, d). With the forward's ``logits`` (and ``rstd``) the scores kernel sums only dO_c·x_s."""
    block_s = _pow2(n)
    (bt_a, chunk, warps_a), (bt_b, block_d, block_s_b), warps_b = split_tiles(n, d, C, logits is not None)
    w = torch.empty(C, n, N, device=src.device, dtype=torch.float32)
    dlr = torch.empty_like(w)
    coef = torch.empty(n, N, device=src.device, dtype=torch.float32) if key_norm else w
    common = dict(C=C, BLOCK_C=_pow2(C), KEY_NORM=key_norm, BLOCK_S=block_s)
    from_logits = logits is not None  # the forward's logits and r_s (``scores_from_logits``)
    _split_scores_kernel[(_cdiv(N, bt_a),)](src, qg, lse, douts, dlse, w, dlr, coef, logits if from_logits else w,
                                            rstd if from_logits and key_norm else w, n, N, d, eps, **common,
                                            BLOCK_T=bt_a, BLOCK_D=chunk, ONCE=scores_once(C), FROM_LOGITS=from_logits,
                                            num_warps=warps_a)
    prefetch = split_grads_prefetch()  # 0, 1 or 2
    meta = dict(common, BLOCK_S=block_s_b, BLOCK_T=bt_b, BLOCK_D=block_d, ROWS=split_grads_rows(), PREFETCH=prefetch)
    cap = split_grads_maxnreg() or (PREFETCH_MAXNREG if prefetch and not interpreting() else 0)
    if cap:  # compiled into the kernel; the persistent grid reads the capped kernel's registers
        meta["maxnreg"] = cap
    args = (src, qg, douts, w, dlr, coef, dsrc, None, n, n_add, N, d)
    programs = _persistent_grid(_split_grads_kernel, args[:7] + (qg,) + args[8:], meta, warps_b, _cdiv(N, bt_b),
                                src.device)
    dqg = torch.empty(programs, C, d, device=src.device, dtype=torch.float32)
    _split_grads_kernel[(programs,)](*args[:7], dqg, *args[8:], **meta, num_warps=warps_b)
    return dqg.sum(0)


@functools.lru_cache(maxsize=None)
def _row_tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, warps) of the merge kernels (rows of three tensors), at least 1,024 values a
    program: 16 fp32 per thread and row up to d = 512, 8 above. Swept on an H200 (fp32,
    ``python -m benchmarks.depth_attn_tiles``): at d = 512 two tokens over two warps (forward 0.041 ->
    0.029 ms, backward 0.081 -> 0.055 against four warps); at d = 1024 one token over four warps
    (backward 0.178 ms, against 0.215 over two warps)."""
    block_d = _pow2(d)
    if interpreting():
        return 32, block_d, 4
    block_t = max(1, 1024 // block_d)
    per_warp = 512 if block_d <= 512 else 256
    return block_t, block_d, min(16, max(1, block_t * block_d // per_warp))


def merge_fwd(o: Tensor, lse: Tensor, p: Tensor, qg: Tensor, *, key_norm: bool, eps: float, new: Tensor | None = None):
    """o, p (B, T, d) contiguous, lse (B, T) fp32, qg (d,) fp32 -> h (B, T, d), w (B, T) fp32; with ``new``
    (B, T, d) contiguous, the partial merged is p + new, returned third (the promoted dtype of p and new)."""
    d = o.shape[-1]
    N = o.numel() // d
    block_t, block_d, warps = _row_tiles(d)
    psum = None if new is None else torch.empty(p.shape, device=p.device, dtype=torch.promote_types(p.dtype, new.dtype))
    h = torch.empty(o.shape, device=o.device, dtype=torch.promote_types(o.dtype, p.dtype if psum is None else psum.dtype))
    w = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    _merge_fwd_kernel[(_cdiv(N, block_t),)](o, lse, p, qg, h, w, p if new is None else new, h if psum is None else psum,
                                                  N, d, eps, KEY_NORM=key_norm, SUM=new is not None,
                                                  BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    return (h, w) if new is None else (h, w, psum)


def merge_bwd(h: Tensor, p: Tensor, qg: Tensor, w: Tensor, dh: Tensor, *, o_dtype: torch.dtype, key_norm: bool,
              eps: float, dp_in: Tensor | None = None, kept_o: bool = False):
    """h (the merge's output; ``kept_o``: the phase-1 output o instead), p (B, T, d) contiguous -> do (o_dtype), dp (p's
    dtype), dlse (B, T) fp32, dqg (d,) fp32. ``dp_in`` (B, T, d) contiguous: the partial's gradient from its other
    readers, added into dp."""
    d = h.shape[-1]
    N = h.numel() // d
    block_t, block_d, warps = _row_tiles(d)
    do, dp = torch.empty(h.shape, device=h.device, dtype=o_dtype), torch.empty_like(p)
    dlse = torch.empty(h.shape[:-1], device=h.device, dtype=torch.float32)
    meta = dict(KEY_NORM=key_norm, DP_IN=dp_in is not None, KEPT_O=kept_o, BLOCK_T=block_t, BLOCK_D=block_d)
    args = [h, p, qg, w, dh, do, dp, dlse, qg, dp if dp_in is None else dp_in, N, d, eps]
    programs = _persistent_grid(_merge_bwd_kernel, args, meta, warps, _cdiv(N, block_t), h.device)
    args[8] = dqg = torch.empty(programs, d, device=h.device, dtype=torch.float32)
    _merge_bwd_kernel[(programs,)](*args, **meta, num_warps=warps)
    return do, dp, dlse, dqg.sum(0)


# --- autograd ------------------------------------------------------------------------------------
# Whether phase 1 keeps its outputs for its backward when they are narrower than the sources (bf16 outputs of fp32
# sources, ``out_dtype``): the backward then takes delta_c = dO_c·o_c from them instead of a first pass over the
# sources. True (the default), False, or "auto" (``delta_from_outputs``). A module setting so that a benchmark row can
# time each (``py:kernels.depth_attn.fused.DELTA_FROM_OUTPUTS=auto``).
DELTA_FROM_OUTPUTS = True
DELTA_SETTINGS = (True, False, "auto")


def delta_from_outputs(C: int, d: int) -> bool:
    """Whether phase 1's backward for C consumers at width d takes delta_c from the kept outputs (``DELTA_FROM_OUTPUTS``).

    "auto": above d = 512, or for one consumer. Timed alone on an H200 with bf16 outputs, at each phase-1 call of a
    Block AttnRes step (``benchmarks.depth_attn_tiles --ops block_n2 block_n3 block_n4 block_final --default-only``):
    at d = 512 with 4 consumers it is 1.13-1.18x the pass over 2-4 sources (one source a load at one warp: that pass
    is cheap, and C rows of o and dO a token are not), 0.85x for the final output's one consumer over 5; at
    d = 1024 0.84-0.90x at every call. Yet in the step "auto" lost: attnres_block `small` 0.924-0.926x vanilla against
    0.931x with True, in one process (``throughput_small_auto_delta.md``), so True stays the default."""
    if DELTA_FROM_OUTPUTS not in DELTA_SETTINGS:
        raise ValueError(f"fused.DELTA_FROM_OUTPUTS={DELTA_FROM_OUTPUTS!r}: choose one of "
                         + ", ".join(map(repr, DELTA_SETTINGS)))
    if DELTA_FROM_OUTPUTS == "auto":
        return d > 512 or C == 1
    return DELTA_FROM_OUTPUTS


# Split phase-1 outputs that phase 1 does not keep: consumer 0's in a tensor of its own (``summaries_fwd(first_apart=)``),
# which the residual hands to its sublayer as it is. False: one (C, B, T, d) tensor, and the residual copies consumer
# 0's output so that its sublayer does not keep the other C - 1 for the backward (the way of before 2026-12-07, night;
# for an A/B row: ``attnres_block@py:kernels.depth_attn.fused.FIRST_APART=False`` in benchmarks.throughput).
FIRST_APART = True


def keeps_outputs(src_dtype: torch.dtype, out_dtype: torch.dtype | None, n: int, C: int, d: int) -> bool:
    """Whether phase 1 over n sources of ``src_dtype`` keeps its C outputs of ``out_dtype`` for its backward: narrow
    outputs (``out_dtype`` set and not the sources') where ``delta_from_outputs`` says, unless the backward runs split
    (it sums dO·o from the sources). A merge of such an output keeps it instead of its own result
    (``merge(keep_o=True)``): no tensor more."""
    return (out_dtype is not None and out_dtype != src_dtype and delta_from_outputs(C, d)
            and not tiles(n, d, C).bwd_split)


class SummariesFunction(torch.autograd.Function):
    """Phase 1. ``apply(src, n, split, key_norm, eps, store_logits, out_dtype, qg, grads, *rows)``.

    ``rows`` empty: ``src`` (n, B, T, d) is itself the differentiable input. ``rows`` given: they are
    the n differentiable sources, views of the rows [0, n) of the buffer ``src`` (n_max, B, T, d),
    which is read directly (never stacked) and kept on ``ctx`` outside the saved tensors, because
    later rows of the buffer are written after this call (rows [0, n) never change again). Their
    gradient is accumulated into ``grads`` (the buffer's ``RowGradients``) and handed to autograd as
    None: each row's ``StoreFunction`` takes the finished sum from there (no autograd sum per reader).
    ``split``: return C outputs and C log-sum-exps (one per consumer) instead of two stacked tensors.
    ``out_dtype``: the outputs' dtype (None: the sources'); their gradients come back in it.
    """

    @staticmethod
    def forward(ctx, src, n, split, key_norm, eps, store_logits, out_dtype, qg, grads, *rows):
        if rows and grads is None:
            raise ValueError("summaries: buffered rows need their buffer's RowGradients (SourceBuffer.grads), got None")
        # the split backward's scores kernel takes the logits and r_s from here (``scores_from_logits``)
        for_bwd = scores_from_logits(n, src.shape[-1], qg.shape[0])
        # narrow outputs are kept for the backward's delta_c = dO_c·o_c (``summaries_bwd(out=)``): no first pass over
        # the sources there; under autocast the consumer that reads its output as it is keeps their storage anyway
        keep_out = keeps_outputs(src.dtype, out_dtype or src.dtype, n, qg.shape[0], src.shape[-1])
        # split outputs that are not kept: the first in a tensor of its own, which its consumer's sublayer keeps for
        # the backward without the others' storage (no copy of it in the residual)
        out, lse, logits, rstd = summaries_fwd(src, n, qg, key_norm=key_norm, eps=eps,
                                               store_logits=store_logits or for_bwd, out_dtype=out_dtype,
                                               store_rstd=for_bwd, first_apart=split and not keep_out and FIRST_APART)
        scores = ((logits,) + ((rstd,) if rstd is not None else ())) if for_bwd else ()  # saved for the backward
        if for_bwd and not store_logits:
            logits = None  # kept for the backward only
        ctx.key_norm, ctx.eps, ctx.n, ctx.split, ctx.buffered = key_norm, eps, n, split, bool(rows)
        ctx.keep_out = keep_out
        kept = (out,) if keep_out else ()
        ctx.n_scores = len(scores)
        if rows:
            ctx.src, ctx.grads = src, grads
            ctx.save_for_backward(qg, lse, *kept, *scores)
        else:
            ctx.save_for_backward(qg, lse, *kept, *scores, src)
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(logits)
        outs = (*out, *lse.unbind(0)) if split else (out, lse)  # (a tuple of C, or (C, B, T, d) unbound)
        return (*outs, logits)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        qg, lse = saved[:2]
        out = saved[2] if ctx.keep_out else None
        src = ctx.src if ctx.buffered else saved[-1]
        C = qg.shape[0]
        if ctx.split:
            douts = tuple(g.contiguous() for g in grads[:C])
            dlse = torch.stack(grads[C: 2 * C]).float()  # (C, B, T): small
        else:
            douts = tuple(grads[0].contiguous().unbind(0))
            dlse = grads[1].float().contiguous()
        at = 2 + int(ctx.keep_out)
        logits, rstd = (tuple(saved[at: at + ctx.n_scores]) + (None, None))[:2]  # the forward's, where it kept them
        if ctx.buffered:
            dst, n_add = ctx.grads.target(ctx.n)
            _, dqg = summaries_bwd(src, ctx.n, qg, lse, douts, dlse, key_norm=ctx.key_norm, eps=ctx.eps, dsrc=dst,
                                   n_add=n_add, out=out, logits=logits, rstd=rstd)
            return (None, None, None, None, None, None, None, dqg, None, *(None for _ in range(ctx.n)))
        dsrc, dqg = summaries_bwd(src, ctx.n, qg, lse, douts, dlse, key_norm=ctx.key_norm, eps=ctx.eps, out=out,
                                  logits=logits, rstd=rstd)
        return (dsrc, None, None, None, None, None, None, dqg, None)


class MergeSumFunction(torch.autograd.Function):
    """Phase 2: ``apply(o, lse, prev, new, qg, key_norm, eps, keep_o)`` -> h, w, p (w not differentiable).

    p = prev + new (``new`` itself when ``prev`` is None: returned as is, no copy; the merge of one partial) is
    the partial that is merged, returned so Block AttnRes keeps it as its next partial. The backward takes p's
    gradient from its later readers (the next merge, the block's summary) into the merge's own dp in one pass
    and hands the sum to prev and new alike: no separate add forward, and no autograd sum of the two in backward.
    The backward needs dh·(p − o) = dh·(p − h)/(1 − w): it keeps the output h (the consumer sublayer's input, which
    an eager sublayer holds for its own backward), or with ``keep_o`` the phase-1 output o, for a caller whose o
    is held anyway (phase 1's narrow outputs, kept for its own backward: ``keeps_outputs``), so that h is freed
    as soon as its sublayer is done with it (an eager sublayer keeps an fp32 copy of its input, not h)."""

    @staticmethod
    def forward(ctx, o, lse, prev, new, qg, key_norm, eps, keep_o=False):
        if prev is None:
            h, w = merge_fwd(o, lse, new, qg, key_norm=key_norm, eps=eps)
            p = new
        else:
            h, w, p = merge_fwd(o, lse, prev, qg, key_norm=key_norm, eps=eps, new=new)
        ctx.save_for_backward(o if keep_o else h, p, qg, w)
        ctx.key_norm, ctx.eps, ctx.o_dtype, ctx.keep_o = key_norm, eps, o.dtype, keep_o
        ctx.dtypes = (None if prev is None else prev.dtype, new.dtype)
        ctx.mark_non_differentiable(w)
        ctx.set_materialize_grads(False)
        return h, w, p

    @staticmethod
    def backward(ctx, dh, _dw, dp_in):
        h, p, qg, w = ctx.saved_tensors  # h: o with keep_o
        if dh is None:  # h unused: only p's gradient passes through the sum
            dh = torch.zeros(h.shape, device=h.device, dtype=torch.promote_types(ctx.o_dtype, p.dtype))  # h's dtype
        do, dp, dlse, dqg = merge_bwd(h, p, qg, w, dh.contiguous(), o_dtype=ctx.o_dtype, key_norm=ctx.key_norm,
                                      eps=ctx.eps, dp_in=None if dp_in is None else dp_in.contiguous(),
                                      kept_o=ctx.keep_o)
        dprev, dnew = (None if dt is None else (dp if dt == dp.dtype else dp.to(dt)) for dt in ctx.dtypes)
        return do, dlse, dprev, dnew, dqg, None, None, None


# --- entry points (inputs validated by kernels.depth_attn) -----------------------------------------
@torch.compiler.disable  # under torch.compile: a graph break, the kernels run as they are
def summaries(src: Tensor, n: int, split: bool, key_norm: bool, eps: float, store_logits: bool, qg: Tensor,
              rows: tuple[Tensor, ...] = (), grads=None, out_dtype: torch.dtype | None = None):
    return SummariesFunction.apply(src, n, split, key_norm, eps, store_logits, out_dtype, qg, grads, *rows)


@torch.compiler.disable
def merge(o: Tensor, lse: Tensor, p: Tensor, qg: Tensor, key_norm: bool, eps: float, keep_o: bool = False):
    return MergeSumFunction.apply(o, lse, None, p, qg, key_norm, eps, keep_o)[:2]  # the partial p alone: h, w


@torch.compiler.disable
def merge_sum(o: Tensor, lse: Tensor, prev: Tensor | None, new: Tensor, qg: Tensor, key_norm: bool, eps: float,
              keep_o: bool = False):
    return MergeSumFunction.apply(o, lse, prev, new, qg, key_norm, eps, keep_o)
