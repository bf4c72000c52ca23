"""Depth attention fused in Triton: the two-phase schedule of Block AttnRes (SPEC §3).

Paper: "Attention Residuals", Kimi Team, arXiv 2603.15031 (two-phase computation).

Static pseudo-queries do not depend on the input, so the C consumers of a block can attend the
completed sources at once (phase 1), and each consumer then folds in its intra-block partial with an
online-softmax merge (phase 2). Same semantics as ``reference.py``; all math in fp32 whatever the
sources' dtype (bf16 on the GPU). PyTorch only folds the key gains into the queries (q ⊙ g, with
autograd) and sums per-program partial query gradients (deterministic, no atomics).

Phase 1, ``_summaries_fwd_kernel``: one program per block of BLOCK_T tokens, all C consumers and
all d channels in registers. For every source s (read once for all consumers): the sum of squares
(shared by the consumers), the C logits (q_c ⊙ g_c)·x_s·rstd_s, an online softmax over s (running
max and sum per consumer, fp32) and the C accumulators. Writes each consumer's normalised output
(C, N, d) in the sources' dtype and its log-sum-exp (C, N) fp32 (N = B·T tokens).

Phase 2, ``_merge_fwd_kernel``: for one consumer and its partial p, z = (q ⊙ g)·RMSNorm(p) and
w = σ(z − lse) (the partial's share of the merged softmax), h = o + w·(p − o). Reads o and p,
writes h and w (N,) fp32.

Backward, ``_merge_bwd_kernel`` (per consumer) then ``_summaries_bwd_kernel`` (per block):
    merge:   do = (1−w)·dh,  dz = w(1−w)·dh·(p − o),  dlse = −dz,  dp = w·dh + dz·∂z/∂p
    phase 1: dlogit_cs = w_cs (dO_c·x_s − dO_c·o_c + dlse_c),  w_cs = exp(logit_cs − lse_c)
             dx_s = Σ_c w_cs dO_c + Σ_c dlogit_cs ∂logit_cs/∂x_s
with ∂logit/∂x = r (qg − logit·r·x / d), r = rsqrt(mean x² + eps) for the key RMSNorm. The phase-1
backward reads the sources twice per token block (the first pass sums dO_c·o_c = Σ_s w_cs dO_c·x_s
in fp32, so no fp32 copy of the outputs is kept); the second pass usually hits L2.

On the GPU every kernel is autotuned over its token block and warps (``_prune`` keeps ~3 configs);
under the interpreter one config with big blocks runs.

Sources are never stacked per read: phase 1 reads rows [0, n) of a preallocated (n_max, B, T, d)
buffer (``SourceBuffer``), whose rows are written once, when a source is complete, and never
modified afterwards (so the backward may read them after later rows are filled).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _summaries_fwd_kernel(
    src_ptr,  # sources (n_max, N, d) contiguous; rows [0, n) are read
    qg_ptr,  # gain-folded queries q_c ⊙ g_c (C, d) fp32
    out_ptr,  # result: normalised outputs (C, N, d), the sources' dtype
    lse_ptr,  # result: log-sum-exp of the logits over sources (C, N) fp32
    logits_ptr,  # result: raw logits (C, n, N) fp32, only when STORE_LOGITS
    n, N, D, eps,
    C: tl.constexpr, BLOCK_C: tl.constexpr, KEY_NORM: tl.constexpr, STORE_LOGITS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_t = offs_t < N
    mask_d = offs_d < D
    mask_c = offs_c < C
    mask_td = mask_t[:, None] & mask_d[None, :]
    qg = tl.load(qg_ptr + offs_c[:, None] * D + offs_d[None, :],
                 mask=mask_c[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_C, BLOCK_D)
    tok = offs_t.to(tl.int64)

    # online softmax over sources, fp32 (AttnRes §3: the softmax is specified in fp32)
    m_i = tl.full((BLOCK_C, BLOCK_T), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
    acc = tl.zeros((BLOCK_C, BLOCK_T, BLOCK_D), dtype=tl.float32)
    s = pid * 0  # a while loop: the interpreter cannot take a tensor as a range bound
    x_next = tl.load(src_ptr + tok[:, None] * D + offs_d[None, :], mask=mask_td, other=0.0)  # source 0
    while s < n:
        x = x_next.to(tl.float32)  # (BLOCK_T, BLOCK_D)
        # prefetch the next source while this one is processed: one load always in flight
        x_next = tl.load(src_ptr + ((s + 1).to(tl.int64) * N + tok)[:, None] * D + offs_d[None, :],
                         mask=mask_td & (s + 1 < n), other=0.0)
        logit = tl.sum(x[None, :, :] * qg[:, None, :], axis=2)  # (BLOCK_C, BLOCK_T): (q ⊙ g)·x
        if KEY_NORM:  # the sum of squares is shared by every consumer
            logit = logit * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[None, :]
        if STORE_LOGITS:
            tl.store(logits_ptr + (offs_c[:, None] * n + s).to(tl.int64) * N + tok[None, :], logit,
                     mask=mask_c[:, None] & mask_t[None, :])
        m_new = tl.maximum(m_i, logit)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logit - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, :, None] + p[:, :, None] * x[None, :, :]
        m_i = m_new
        s += 1
    out = acc / l_i[:, :, None]
    rows = offs_c[:, None].to(tl.int64) * N + tok[None, :]  # (BLOCK_C, BLOCK_T) in (C, N)
    mask_ct = mask_c[:, None] & mask_t[None, :]
    tl.store(out_ptr + rows[:, :, None] * D + offs_d[None, None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_ct[:, :, None] & mask_d[None, None, :])
    tl.store(lse_ptr + rows, m_i + tl.log(l_i), mask=mask_ct)


@triton.jit
def _summaries_bwd_kernel(
    src_ptr,  # sources (n_max, N, d) contiguous; rows [0, n) are read
    qg_ptr,  # gain-folded queries (C, d) fp32
    lse_ptr,  # forward log-sum-exp (C, N) fp32
    douts,  # tuple of C upstream gradients of the outputs, each (N, d) contiguous
    dlse_ptr,  # upstream gradient of the log-sum-exp (C, N) fp32
    dsrc_ptr,  # result: gradient of the sources (n, N, d), the sources' dtype
    dqg_ptr,  # result: per-program partial gradient of q ⊙ g (programs, C, d) fp32
    n, N, D, eps,
    C: tl.constexpr, BLOCK_C: tl.constexpr, KEY_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_d = offs_d < D
    mask_c = offs_c < C
    qg = tl.load(qg_ptr + offs_c[:, None] * D + offs_d[None, :],
                 mask=mask_c[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_C, BLOCK_D)
    dqg = tl.zeros((BLOCK_C, BLOCK_D), dtype=tl.float32)
    n_tiles = tl.cdiv(N, BLOCK_T)
    tile = pid
    while tile < n_tiles:  # a few programs per SM, each over many token blocks: few partial sums
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < N
        mask_td = mask_t[:, None] & mask_d[None, :]
        mask_ct = mask_c[:, None] & mask_t[None, :]
        tok = offs_t.to(tl.int64)
        td = tok[:, None] * D + offs_d[None, :]
        do = tl.zeros((BLOCK_C, BLOCK_T, BLOCK_D), dtype=tl.float32)
        for c in tl.static_range(C):
            g = tl.load(douts[c] + td, mask=mask_td, other=0.0).to(tl.float32)
            do += tl.where(offs_c[:, None, None] == c, g[None, :, :], 0.0)
        rows = offs_c[:, None].to(tl.int64) * N + tok[None, :]
        lse = tl.load(lse_ptr + rows, mask=mask_ct, other=0.0)  # (BLOCK_C, BLOCK_T)
        dlse = tl.load(dlse_ptr + rows, mask=mask_ct, other=0.0)
        # pass 1: delta_c = dO_c · o_c = Σ_s w_cs dO_c · x_s, in fp32 from the sources themselves
        delta = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
        s = pid * 0
        x_next = tl.load(src_ptr + tok[:, None] * D + offs_d[None, :], mask=mask_td, other=0.0)
        while s < n:
            x = x_next.to(tl.float32)
            x_next = tl.load(src_ptr + ((s + 1).to(tl.int64) * N + tok)[:, None] * D + offs_d[None, :],
                             mask=mask_td & (s + 1 < n), other=0.0)  # prefetch
            logit = tl.sum(x[None, :, :] * qg[:, None, :], axis=2)
            if KEY_NORM:
                logit = logit * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[None, :]
            w = tl.exp(logit - lse)
            delta += w * tl.sum(do * x[None, :, :], axis=2)
            s += 1
        # pass 2: the gradient of every source
        s = pid * 0
        x_next = tl.load(src_ptr + tok[:, None] * D + offs_d[None, :], mask=mask_td, other=0.0)
        while s < n:
            x = x_next.to(tl.float32)
            x_next = tl.load(src_ptr + ((s + 1).to(tl.int64) * N + tok)[:, None] * D + offs_d[None, :],
                             mask=mask_td & (s + 1 < n), other=0.0)  # prefetch
            dot = tl.sum(x[None, :, :] * qg[:, None, :], axis=2)  # (BLOCK_C, BLOCK_T)
            if KEY_NORM:
                r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # (BLOCK_T,)
                logit = dot * r[None, :]
            else:
                logit = dot
            w = tl.exp(logit - lse)
            dlogit = w * (tl.sum(do * x[None, :, :], axis=2) - delta + dlse)  # softmax backward
            dx = tl.sum(w[:, :, None] * do, axis=0)  # value path (BLOCK_T, BLOCK_D)
            dq_dir = tl.sum(dlogit[:, :, None] * qg[:, None, :], axis=0)  # Σ_c dlogit_c qg_c
            if KEY_NORM:
                # ∂logit/∂x = r (qg − logit · r x / d)
                dl_l = tl.sum(dlogit * logit, axis=0)  # (BLOCK_T,)
                dx += r[:, None] * dq_dir - (r * r * dl_l / D)[:, None] * x
                dqg += tl.sum(dlogit[:, :, None] * (x * r[:, None])[None, :, :], axis=1)
            else:
                dx += dq_dir
                dqg += tl.sum(dlogit[:, :, None] * x[None, :, :], axis=1)
            tl.store(dsrc_ptr + (s.to(tl.int64) * N + tok)[:, None] * D + offs_d[None, :],
                     dx.to(dsrc_ptr.dtype.element_ty), mask=mask_td)
            s += 1
        tile += n_prog
    tl.store(dqg_ptr + (pid * C + offs_c[:, None]).to(tl.int64) * D + offs_d[None, :], dqg,
             mask=mask_c[:, None] & mask_d[None, :])


@triton.jit
def _merge_fwd_kernel(
    o_ptr,  # phase-1 output of this consumer (N, d)
    lse_ptr,  # its log-sum-exp (N,) fp32
    p_ptr,  # the intra-block partial (N, d)
    qg_ptr,  # gain-folded query (d,) fp32
    h_ptr,  # result: merged output (N, d)
    w_ptr,  # result: weight of the partial in the merged softmax (N,) fp32
    N, D, eps,
    KEY_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
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
    o_ptr,  # phase-1 output (N, d)
    p_ptr,  # the partial (N, d)
    qg_ptr,  # gain-folded query (d,) fp32
    w_ptr,  # forward weight of the partial (N,) fp32
    dh_ptr,  # upstream gradient of h (N, d) contiguous
    do_ptr,  # result: gradient of o (N, d), o's dtype
    dp_ptr,  # result: gradient of the partial (N, d), the partial's dtype
    dlse_ptr,  # result: gradient of the phase-1 log-sum-exp (N,) fp32
    dqg_ptr,  # result: per-program partial gradient of q ⊙ g (programs, d) fp32
    N, D, eps,
    KEY_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
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
        o = tl.load(o_ptr + td, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + td, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + td, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_t, mask=mask_t, other=0.0)
        dz = w * (1.0 - w) * tl.sum(dh * (p - o), axis=1)  # through w = σ(z − lse)
        dp = w[:, None] * dh
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
def _prune(configs, named_args, **kwargs):
    """Keep token blocks whose (C, T, d) tile is 2048-8192 fp32 values (or one token when a single
    token is wider) at 16 values per thread (else 8-32): ~3 configs to compile and time. Compiled
    for sm_90 they use 64-220 registers; a few 16-warp backward configs spill and lose the tuning."""
    meta = {**named_args, **kwargs}
    width = meta["BLOCK_D"] * meta.get("BLOCK_C", 1)
    lo, hi = min(2048, 16 * width), max(8192, width)
    sized = [c for c in configs if lo <= width * c.kwargs["BLOCK_T"] <= hi]
    for per_thread in ((16,), (8, 16, 32)):
        keep = [c for c in sized if width * c.kwargs["BLOCK_T"] // (32 * c.num_warps) in per_thread]
        if keep:
            return keep
    return [c for c in configs if c.kwargs["BLOCK_T"] == 1 and c.num_warps == 16]


_CONFIGS = [triton.Config({"BLOCK_T": bt}, num_warps=w) for bt in (1, 2, 4, 8, 16) for w in (4, 8, 16)]


def _tuned(kernel, key):
    """The kernel autotuned over token block and warps (GPU only: the interpreter cannot autotune).
    The kernels only write their outputs, so re-running them while tuning is harmless."""
    return triton.autotune(configs=_CONFIGS, key=key, prune_configs_by={"early_config_prune": _prune})(kernel)


_summaries_fwd_tuned = _tuned(_summaries_fwd_kernel, ["C", "D", "KEY_NORM", "STORE_LOGITS"])
_summaries_bwd_tuned = _tuned(_summaries_bwd_kernel, ["C", "D", "KEY_NORM"])
_merge_fwd_tuned = _tuned(_merge_fwd_kernel, ["D", "KEY_NORM"])
_merge_bwd_tuned = _tuned(_merge_bwd_kernel, ["D", "KEY_NORM"])


def _launch(kernel, tuned, grid, *args, **meta):
    """``grid(BLOCK_T)``: the launch grid. Under the interpreter each program costs milliseconds:
    one config with big blocks; on the GPU the autotuned kernel."""
    if interpreting():
        kernel[grid(32)](*args, **meta, BLOCK_T=32, num_warps=4)
    else:
        tuned[lambda m: grid(m["BLOCK_T"])](*args, **meta)


def _n_programs(N: int, device: torch.device) -> int:
    """Programs of the persistent backward kernels: a few per SM (few partial sums)."""
    if interpreting():
        return min(triton.cdiv(N, 32), 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(N, 4 * sms))


def summaries_fwd(src: Tensor, n: int, qg: Tensor, *, key_norm: bool, eps: float, store_logits: bool):
    """src (n_max, B, T, d) contiguous, qg (C, d) fp32 -> out (C, B, T, d), lse (C, B, T) fp32,
    logits (C, n, B, T) fp32 or None."""
    shape = src.shape[1:]
    N, d = src[0].numel() // src.shape[-1], src.shape[-1]
    C = qg.shape[0]
    out = torch.empty(C, *shape, device=src.device, dtype=src.dtype)
    lse = torch.empty(C, *shape[:-1], device=src.device, dtype=torch.float32)
    logits = torch.empty(C, n, *shape[:-1], device=src.device, dtype=torch.float32) if store_logits else lse
    _launch(_summaries_fwd_kernel, _summaries_fwd_tuned, lambda bt: (triton.cdiv(N, bt),),
            src, qg, out, lse, logits, n, N, d, eps,
            C=C, BLOCK_C=triton.next_power_of_2(C), KEY_NORM=key_norm, STORE_LOGITS=store_logits,
            BLOCK_D=triton.next_power_of_2(d))
    return out, lse, (logits if store_logits else None)


def summaries_bwd(src: Tensor, n: int, qg: Tensor, lse: Tensor, douts: tuple[Tensor, ...], dlse: Tensor,
                  *, key_norm: bool, eps: float) -> tuple[Tensor, Tensor]:
    """-> dsrc (n, B, T, d) in the sources' dtype, dqg (C, d) fp32."""
    N, d = src[0].numel() // src.shape[-1], src.shape[-1]
    C = qg.shape[0]
    programs = _n_programs(N, src.device)
    dsrc = torch.empty(n, *src.shape[1:], device=src.device, dtype=src.dtype)
    dqg = torch.empty(programs, C, d, device=src.device, dtype=torch.float32)
    _launch(_summaries_bwd_kernel, _summaries_bwd_tuned, lambda bt: (programs,),
            src, qg, lse, douts, dlse, dsrc, dqg, n, N, d, eps,
            C=C, BLOCK_C=triton.next_power_of_2(C), KEY_NORM=key_norm, BLOCK_D=triton.next_power_of_2(d))
    return dsrc, dqg.sum(0)


def merge_fwd(o: Tensor, lse: Tensor, p: Tensor, qg: Tensor, *, key_norm: bool, eps: float):
    """o, p (B, T, d) contiguous, lse (B, T) fp32, qg (d,) fp32 -> h (B, T, d), w (B, T) fp32."""
    d = o.shape[-1]
    N = o.numel() // d
    h = torch.empty(o.shape, device=o.device, dtype=torch.promote_types(o.dtype, p.dtype))
    w = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    _launch(_merge_fwd_kernel, _merge_fwd_tuned, lambda bt: (triton.cdiv(N, bt),),
            o, lse, p, qg, h, w, N, d, eps, KEY_NORM=key_norm, BLOCK_D=triton.next_power_of_2(d))
    return h, w


def merge_bwd(o: Tensor, p: Tensor, qg: Tensor, w: Tensor, dh: Tensor, *, key_norm: bool, eps: float):
    """-> do (o's dtype), dp (p's dtype), dlse (B, T) fp32, dqg (d,) fp32."""
    d = o.shape[-1]
    N = o.numel() // d
    programs = _n_programs(N, o.device)
    do, dp = torch.empty_like(o), torch.empty_like(p)
    dlse = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    dqg = torch.empty(programs, d, device=o.device, dtype=torch.float32)
    _launch(_merge_bwd_kernel, _merge_bwd_tuned, lambda bt: (programs,),
            o, p, qg, w, dh, do, dp, dlse, dqg, N, d, eps, KEY_NORM=key_norm, BLOCK_D=triton.next_power_of_2(d))
    return do, dp, dlse, dqg.sum(0)


# --- autograd ------------------------------------------------------------------------------------
class SummariesFunction(torch.autograd.Function):
    """Phase 1. ``apply(src, n, split, key_norm, eps, store_logits, qg, *rows)``.

    ``rows`` empty: ``src`` (n, B, T, d) is itself the differentiable input. ``rows`` given: they are
    the n differentiable sources, views of the rows [0, n) of the buffer ``src`` (n_max, B, T, d),
    which is read directly (never stacked) and kept on ``ctx`` outside the saved tensors, because
    later rows of the buffer are written after this call (rows [0, n) never change again).
    ``split``: return C outputs and C log-sum-exps (one per consumer) instead of two stacked tensors.
    """

    @staticmethod
    def forward(ctx, src, n, split, key_norm, eps, store_logits, qg, *rows):
        out, lse, logits = summaries_fwd(src, n, qg, key_norm=key_norm, eps=eps, store_logits=store_logits)
        ctx.key_norm, ctx.eps, ctx.n, ctx.split, ctx.buffered = key_norm, eps, n, split, bool(rows)
        if rows:
            ctx.src = src
            ctx.save_for_backward(qg, lse)
        else:
            ctx.save_for_backward(qg, lse, src)
        if logits is None:
            logits = lse.new_empty(0)
        ctx.mark_non_differentiable(logits)
        outs = (*out.unbind(0), *lse.unbind(0)) if split else (out, lse)
        return (*outs, logits)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.buffered:
            qg, lse = ctx.saved_tensors
            src = ctx.src
        else:
            qg, lse, src = ctx.saved_tensors
        C = qg.shape[0]
        if ctx.split:
            douts = tuple(g.contiguous() for g in grads[:C])
            dlse = torch.stack(grads[C: 2 * C]).float()  # (C, B, T): small
        else:
            douts = tuple(grads[0].contiguous().unbind(0))
            dlse = grads[1].float().contiguous()
        dsrc, dqg = summaries_bwd(src, ctx.n, qg, lse, douts, dlse, key_norm=ctx.key_norm, eps=ctx.eps)
        if ctx.buffered:
            return (None, None, None, None, None, None, dqg, *dsrc.unbind(0))
        return (dsrc, None, None, None, None, None, dqg)


class MergeFunction(torch.autograd.Function):
    """Phase 2. ``apply(o, lse, p, qg, key_norm, eps)`` -> h, w (w not differentiable)."""

    @staticmethod
    def forward(ctx, o, lse, p, qg, key_norm, eps):
        h, w = merge_fwd(o, lse, p, qg, key_norm=key_norm, eps=eps)
        ctx.save_for_backward(o, p, qg, w)
        ctx.key_norm, ctx.eps = key_norm, eps
        ctx.mark_non_differentiable(w)
        return h, w

    @staticmethod
    def backward(ctx, dh, _dw):
        o, p, qg, w = ctx.saved_tensors
        do, dp, dlse, dqg = merge_bwd(o, p, qg, w, dh.contiguous(), key_norm=ctx.key_norm, eps=ctx.eps)
        return do, dlse, dp, dqg, None, None


# --- entry points (inputs validated by kernels.depth_attn) -----------------------------------------
@torch.compiler.disable  # under torch.compile: a graph break, the kernels run as they are
def summaries(src: Tensor, n: int, split: bool, key_norm: bool, eps: float, store_logits: bool, qg: Tensor,
              rows: tuple[Tensor, ...] = ()):
    return SummariesFunction.apply(src, n, split, key_norm, eps, store_logits, qg, *rows)


@torch.compiler.disable
def merge(o: Tensor, lse: Tensor, p: Tensor, qg: Tensor, key_norm: bool, eps: float):
    return MergeFunction.apply(o, lse, p, qg, key_norm, eps)
