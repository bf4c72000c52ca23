"""mHC read and write fused in Triton (mHC, arXiv 2512.24880, §4.3: kernel fusion and recomputation).

Same semantics as ``reference.py``. The streams are token-major, (N, n, d) with N = B·T, so one
token's n·d values are contiguous. Three ops, each one pass over the streams:

- **pre** (``_pre_fwd_kernel``, BLOCK_T tokens per program): stream the n·d values of the tokens once,
  accumulating Σx² and y = (x ⊙ g) φ (``tl.dot``, fp32); z = y · rsqrt(Σx²/nd + eps); then per token
  H^pre = σ(α_pre z_pre + b_pre), H^post = 2σ(α_post z_post + b_post) and H^res = 20 Sinkhorn
  iterations on an (n, n) register tile (log domain, fp32); a second sweep over the same tokens
  (L2-resident) writes h = Σ_i H^pre_i X_i. Stored for later: the coefficients (n²+2n fp32, the write
  needs them), z (n²+2n fp32) and the RMS factor r (1 fp32). Nothing of size d is stored besides h.
- **post** (``_post_fwd_kernel``): X' = H^res X + H^postᵀ f; reads n·d + d, writes n·d.
- **post + next pre** (``_pre_fwd_kernel`` with ``FUSE_POST``, the paper's fused write/read): the first
  sweep makes X' = H^res X + H^postᵀ f chunk by chunk, stores it and projects it; then as pre. Reads
  n·d + d, writes n·d + d (+ the L2 re-read of X'), instead of 2·n·d + d read by post then pre.
  Its backward is pre's backward on X', then post's with the resulting dX'.

Backward (recomputation instead of storage: only z and r are kept per token):

- ``_post_bwd_kernel``: df = Σ_i H^post_i dX'_i and the per-token reductions over d
  dH^res_ij = ⟨dX'_i, X_j⟩, dH^post_i = ⟨dX'_i, f⟩; one pass. Its stream gradient H^resᵀ dX' is left to
  the read's backward (``GradientLink``) when the write used the read's own streams and coefficients,
  so the two halves of dX are written once, not twice and then summed. With bf16 streams (n = 1, 2, 4) the
  default is ``_post_bwd_tc_kernel`` instead: the same results, each reduction a tensor-core product over a block
  of tokens' stream rows (``POST_BWD_PROJ``).
- ``_pre_bwd_kernel``: dH^pre_i = ⟨dh, X_i⟩ (one sweep), then per token the gradients of the logits:
  σ' for H^pre and H^post, and the Sinkhorn iterations recomputed from the logits and
  backpropagated last first (O(T) steps on an (n, n) register tile; only the 2n normalisers per
  iteration go to a transient L2-resident scratch row); it writes per token w = r dz (K) and the
  coefficients of dX (H^pre, c = ⟨dz, z⟩ r² / nd).
- ``_pre_dx_kernel``, over a (tokens, channels) grid:
  dX = H^pre dh + g ⊙ (φ w) − c x [+ H^resᵀ dX' from the write], φ w one tl.dot per stream
  (no Sinkhorn registers: every SM streams).
- ``_phi_grad_kernel``: P = Σ_tokens xᵀ (r dz) (nd × (n²+2n), fp32 ``tl.dot``, deterministic partial
  sums per token split); dφ = g ⊙ P and dg = Σ_k φ ⊙ P. dα and db are sums over tokens of the
  per-token logit gradients, done with ``torch.sum``.

Per sublayer and token the streams cross HBM: forward 2·nd + 2·d (pre reads X, writes h; post
reads X and f, writes X'; pre's second sweep over X hits L2), backward about 6·nd (post reads dX'
and X; pre reads X twice, the second time mostly from L2, reads dX' and writes dX; the φ gradient
reads X once more).

All math is fp32 whatever the streams' dtype; inputs are made contiguous by the launchers.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting, sm_count as _sm_count
from .recompute import StreamRecompute

# Precision of the projections z = x'φ, φ dz and Σ xᵀ dz (tl.dot on fp32 operands). The paper keeps φ
# and the projection in fp32 (Eq. 10). "ieee" (default) is exact fp32 on CUDA cores; "tf32x3" splits
# each operand into two tf32 parts and keeps three products (about fp32 accuracy on tensor cores).
# With K = n²+2n = 24 columns the tensor-core path gains nothing: on an H200 (bf16 streams, n = 4)
# mhc_pre took 0.178 ms in ieee vs 0.339 ms in tf32x3 at d = 512 and 0.601 vs 1.223 ms at d = 1024.
# benchmarks/ops_mhc.py times both.
DOT_PRECISIONS = ("ieee", "tf32x3")
DOT_PRECISION = "ieee"
# The fused write + next read in one forward pass (``_pre_fwd_kernel`` with FUSE_POST): measured slower
# on an H200 than the write kernel followed by the read kernel (`small`: 0.60 ms against 0.05 + 0.27
# ms, `python -m benchmarks.ops_mhc`), so by default the forward runs the two kernels; the backward is
# the same either way (it recomputes from the stored X').
POST_PRE_ONE_PASS = False

# Kernel variants of 2026-12-02 night, timed against each other in one process by benchmarks/ops_mhc.py
# (``NAMED_VARIANTS`` below; ops_mhc_variants.md); every variant computes the same math and is tested against the
# reference. At `medium` with bf16 streams the tensor-core set below (now the default) took a sublayer's write + read,
# forward and backward, from 3.965 to 3.565 ms. Measured and removed: the sums over d kept lane by lane and reduced
# once after the channel loop (slower everywhere, 3.965 -> 4.074; commit f9b393a has them).
# PRE_PROJ: the read's projection x'φ for **bf16** streams. "fp32": tl.dot at DOT_PRECISION. "bf16x3" (default): x is
#   exact in bf16; φ, with the norm gain folded in, is split into three bf16 parts (hi + mid + lo holds its 24 bits),
#   so three tensor-core products with fp32 accumulation give the fp32 projection. Other stream dtypes take "fp32".
PRE_PROJ = "bf16x3"
# PHI_GRAD_PROJ: φ's gradient Σ_t xᵀ w for **bf16** streams; "bf16x3" (default): w split into three bf16 parts in the
#   kernel (x exact in bf16), three tensor-core products. Other stream dtypes take "fp32".
PHI_GRAD_PROJ = "bf16x3"
# DX_PROJ: φ w inside dX, for **16-bit** streams (dX is stored in bf16 / fp16): "fp32" (DOT_PRECISION), "tf32" (one
#   tensor-core product on 10-bit operands), "bf16x2" (default: w and φ each split in two bf16 parts, three products,
#   about 16 bits, beyond what the bf16 dX keeps). fp32 streams always take "fp32".
DX_PROJ = "bf16x2"
# PRE_FWD_BLOCKS (2026-12-04 night, untimed): the GPU_BLOCKS entry of the read's forward when its projection is the
#   fp32 CUDA-core tl.dot (fp32 streams, the model's default; bf16 streams with PRE_PROJ="fp32"). "pre_fwd" (default):
#   16 tokens, 4 warps, 2×2 outputs of the (tokens, K) projection a thread, whose operands it reads from shared memory
#   at 4.0 bytes an FFMA. "pre_fwd_w2": 32 tokens, 2 warps, 4×4 outputs a thread, 2.1 bytes an FFMA
#   (docs/kernel_mhc.md, 2026-12-04).
PRE_FWD_BLOCKS = "pre_fwd"
# POST_BWD_PROJ (2026-12-05): the write's backward for **bf16** streams with n a power of two. "fp32":
#   ``_post_bwd_kernel``, its reductions over d and n on CUDA cores (shuffles and shared memory: the L1/shared pipe
#   was 84% busy at `small`, kernel_counters_h200_mhc_tc.md). "bf16x3" (default since 2026-12-05):
#   ``_post_bwd_tc_kernel``, every reduction a tensor-core product (G Xᵀ, G Fᵀ, P G, Q G over a block of tokens'
#   stream rows), the fp32 factors in three bf16 parts. Other streams (and n = 3) take "fp32". On an H100, one
#   process each (ops_mhc_post_bwd_tc_h100.md, throughput_{small,medium}_post_bwd_tc_h100.md): a `medium`
#   sublayer's write + read forward and backward 3.771 -> 2.514 ms; mhc's step 0.603 -> 0.622x vanilla at `small`,
#   0.685 -> 0.704x at `medium`.
POST_BWD_PROJ = "bf16x3"
# PRE_SUMS (2026-12-05; timed with POST_BWD_PROJ="bf16x3" on an H100: the step 0.707x against 0.704x at `medium`,
#   0.619x against 0.622x at `small`, within the noise, so opt-in): the read's sums over the streams for **bf16**
#   streams with n a power of two, the same way: "bf16x3" makes the forward's h = Σ_i H^pre_i X_i one tensor-core
#   product P X a chunk (P block-diagonal of H^pre in three bf16 parts; with PRE_PROJ="bf16x3" only) and the
#   backward's dH^pre_i = ⟨dh, X_i⟩ the diagonal of X dhᵀ; "fp32" (default) keeps the (tokens, n, channels)
#   reductions on CUDA cores.
PRE_SUMS = "fp32"
# DX_LAYOUT (built 2026-12-05; timed 2026-12-06 on an H100, the default since): the read's dX for **bf16** streams
#   (with DX_PROJ="bf16x2", n = 1, 2, 4). "rows" (default): ``_pre_dx_rows_kernel``, the tile's rows the block's
#   stream rows: φ w of every stream one tensor-core product, H^pre dh and c X elementwise, H^resᵀ dX' a
#   block-diagonal product. "stream" (the default before): ``_pre_dx_kernel``, a (tokens, channels) tile a stream,
#   the sum over the write's streams H^resᵀ dX' a (tokens, n, channels) reduction. Timed in one process each
#   (ops_mhc_dx_rows_h100.md, throughput_{small,medium}_dx_rows_h100.md): a `medium` sublayer's write + read forward
#   and backward 2.488 -> 2.275 ms (1.069 -> 1.045 at `small`, within the rounds' range); mhc's step 0.621/0.623 ->
#   0.650/0.652x vanilla at `small`, 0.704 -> 0.736x at `medium` (docs/kernel_mhc.md).
DX_LAYOUT = "rows"
# DX_ROWS_BLOCKS (2026-12-06): the GPU_BLOCKS entry of ``_pre_dx_rows_kernel`` (DX_LAYOUT="rows"). "pre_dx_rows"
#   (default): 16 tokens and 64 channels, 154 registers; "pre_dx_rows_d128": 16 tokens and 128 channels, 241 registers
#   and 108.5 warp instructions a token and 32 channels against 150. Timed on an H100: the op 1.064 against 1.045 ms at
#   `small` and 2.292 against 2.275 at `medium`; mhc's `medium` step 0.742x against 0.736x (within the noise).
DX_ROWS_BLOCKS = "pre_dx_rows"
# SINKHORN (2026-12-06; timed on an H100 the same day: slower, so opt-in): the layout of the 20 Sinkhorn iterations in the read's forward and backward kernels.
#   "tile" (default): the (BLOCK_T, NP, NP) tile spread over the block's threads, its sums over i and over j
#   shuffles and, across warps, shared memory and barriers (the forward's iteration: 291 sm_90a instructions a warp,
#   16 SHFL, 16 STS, 16 LDS, 6 BAR). "token": a thread holds a whole token's n² entries as a tuple of (BLOCK_T,)
#   vectors, so the sums are its own register arithmetic; a write + read forward and backward 1.069 -> 1.100 ms at
#   `small`, 2.488 -> 2.524 at `medium` (ops_mhc_dx_rows_h100.md, docs/kernel_mhc.md).
SINKHORN = "tile"
# READ_BLOCKS (2026-12-06): the GPU_BLOCKS entry of the read's forward on tensor cores (bf16 streams, PRE_PROJ="bf16x3").
#   "pre_fwd_tc" (default): 64 tokens, 64 channels, one stage; "pre_fwd_tc_t32": 32 tokens, two stages, the default
#   before. In one sweep on an H100 (ops_mhc_blocks_read64_h100.md, the write + read forward): 0.174 against 0.213-0.229
#   ms for the 32-token rows timed after the first at `small`, 0.536 against 0.682-0.821 at `medium`; results the same
#   bits as 32 tokens'.
READ_BLOCKS = "pre_fwd_tc"
# READ_LAYOUT: the read's forward for **bf16** streams with PRE_PROJ="bf16x3". "fused": ``_pre_fwd_kernel``, a
#   program a block of tokens through its whole n·d projection, the Sinkhorn iterations and h (256 programs at `small`
#   for 132 SMs: 19% of its bytes' time on an H100, profile_step_small_graphs_read64_h100.md). "split" (2026-12-06
#   late): three kernels, each with more programs or less to wait on: the projection a program a (token block, stream)
#   into per-stream parts (``_read_proj_kernel``), the parts summed and the coefficients (``_read_coef_kernel``, no
#   stream loads), and h over a (tokens, channels) grid (``_read_sum_kernel``); the price: the streams read twice
#   from memory, and n·KP + n fp32 a token of parts. "auto" (the default since 2026-12-06, end): "split" where the
#   fused kernel would launch fewer than READ_SPLIT_BELOW programs an SM, else "fused"; "fused" off a GPU (the
#   interpreter has no SMs). Timed on an H100, one process each: mhc's graphed `small` step 26.9 / 26.8 -> 26.6 / 26.5
#   ms with the split read (0.661 / 0.665 -> 0.668 / 0.673x vanilla; its three kernels 1.52 ms a step against the fused
#   read's 1.82, throughput_small_read_split_h100.md, profile_step_small_graphs_read_split_kinds_h100.md), and "auto"
#   26.4 / 26.5 against the fused read's 26.8 / 26.7 (throughput_small_auto_read_h100.md); alone at `medium` (512
#   programs) the fused read wins, 0.318 against 0.328 ms (ops_mhc_read_split_h100.md).
READ_LAYOUT = "auto"
READ_SPLIT_BELOW = 2  # programs an SM of the fused read under which "auto" splits it
# PRE_BWD_LAYOUT (2026-12-06, end): the read's backward up to dX's coefficients. "fused" (default): ``_pre_bwd_kernel``
#   sweeps X and dh for dH^pre, then runs the Sinkhorn backward, a program 32 tokens (512 at `small`: 26% of its
#   bytes' time on an H100, profile_step_small_graphs_read64_h100.md). "split": the sweep as a kernel of its own at 8
#   tokens a program (``_pre_sweep_kernel``, dH^pre (N, n) fp32 through memory), then ``_pre_bwd_kernel`` without it,
#   as the split read does for the forward. Timed on an H100, one process: mhc's graphed `small` step 26.5 / 26.5 ms
#   against 26.7 / 26.8 with it (throughput_small_bwd_split_h100.md): slower, so opt-in, kept as the measured
#   counter-example (the one-kernel backward's 512 programs are already about four an SM; the split adds a launch and
#   dH^pre's round trip and leaves the Sinkhorn backward's latency where it was).
PRE_BWD_LAYOUT = "fused"
# DX_ROWS_TOKEN_BLOCKS (built 2026-12-06, end; timed on an H100 2026-12-06, evening: no gain, so 1): token blocks a program of the read's rows dX
#   (DX_LAYOUT="rows") walks for one channel tile. Each program loads Φ for its channel tile, 2·KP·n·BLOCK_D bf16 (32
#   KB at n = 4 and 64 channels), more than the stream bytes of its own (16 tokens, 64 channels) tile (about 26 KB):
#   at `small` 268 MB from L2 a launch beside 218 MB from memory (136 µs a launch, 53% of its bytes' time on an H100).
#   With 4 blocks a program Φ is loaded a quarter as often. 1 (default): a program a token block, as before. Timed:
#   mhc's graphed `small` step 26.5 / 26.4 ms at 1 against 26.7 / 26.6 at 4 (throughput_small_dx_tb_h100.md); as graph
#   replays the write + read forward and backward within 2% either way (ops_mhc_dx_tb_graphs_h100.md): L2 serves Φ.
DX_ROWS_TOKEN_BLOCKS = 1
# PHI_GRAD_BLOCKS (2026-12-06, evening): the GPU_BLOCKS entry of φ's gradient. "phi_grad" (the default): 64 tokens
#   a step, 128 rows of n·d a program, 8 warps, 3 stages, the fastest of the block sweep at `medium` on an H100 (a
#   write + read forward and backward 1.928 against 2.023 ms, ops_mhc_blocks_phi_grad_h100.md). "phi_grad_r64": 32
#   tokens, 64 rows, 4 warps, the blocks before. In mhc's graphed step, alternating in one process on an H100: `medium`
#   221.5 / 221.5 -> 218.3 / 218.4 ms (0.769 -> 0.780x vanilla, throughput_medium_phi_medium_h100.md), `small` 26.2 /
#   26.2 -> 25.9 / 25.9 ms (0.672 -> 0.679x, throughput_small_phi_small_h100.md; the sweep's event timer had counted
#   launch gaps there, 1.2-1.8 ms against 0.58 as graph replays).
PHI_GRAD_BLOCKS = "phi_grad"
VARIANT_CHOICES = {"PRE_PROJ": ("fp32", "bf16x3"), "PHI_GRAD_PROJ": ("fp32", "bf16x3"),
                   "DX_PROJ": ("fp32", "tf32", "bf16x2"), "PRE_FWD_BLOCKS": ("pre_fwd", "pre_fwd_w2"),
                   "POST_BWD_PROJ": ("fp32", "bf16x3"), "PRE_SUMS": ("fp32", "bf16x3"),
                   "DX_LAYOUT": ("stream", "rows"), "DX_ROWS_BLOCKS": ("pre_dx_rows", "pre_dx_rows_d128"),
                   "SINKHORN": ("tile", "token"), "READ_BLOCKS": ("pre_fwd_tc", "pre_fwd_tc_t32"),
                   "READ_LAYOUT": ("auto", "fused", "split"), "PRE_BWD_LAYOUT": ("fused", "split"),
                   "DX_ROWS_TOKEN_BLOCKS": (1, 2, 4, 8), "PHI_GRAD_BLOCKS": ("phi_grad", "phi_grad_r64")}

# Named sets of the settings above: what `benchmarks.ops_mhc --variants NAME ...` times side by side and what the
# tests' ``variant`` fixture runs every chain test with (less tests/kernels/test_mhc_fused.py's ``NOT_EVERY_TEST``),
# one table so that a variant timed is a variant tested. Each must give the reference's results; the tensor-core ones
# apply to 16-bit streams only (on fp32 streams they must leave the fp32 path).
NAMED_VARIANTS = {
    "default": {},
    # the tensor-core projections (the defaults since 2026-12-02 night), spelt out: they stay tested if the defaults
    # move. bf16 streams: the read's projection and φ's gradient bf16x3, φ w in dX bf16x2, the write's backward bf16x3
    "tc": {"PRE_PROJ": "bf16x3", "PHI_GRAD_PROJ": "bf16x3", "DX_PROJ": "bf16x2", "POST_BWD_PROJ": "bf16x3"},
    # the projections before 2026-12-02 night (fp32 on CUDA cores; dX' is now loaded once either way)
    "before": {"PRE_PROJ": "fp32", "PHI_GRAD_PROJ": "fp32", "DX_PROJ": "fp32", "POST_BWD_PROJ": "fp32"},
    "one_pass": {"POST_PRE_ONE_PASS": True},  # the write fused with the next read in one kernel (slower, 2026-11-30)
    "dx_tf32": {"DX_PROJ": "tf32"},  # 16-bit streams: φ w in dX on tf32 tensor cores
    # fp32 streams (or PRE_PROJ=fp32): the read's forward at 32 tokens and 2 warps, 4×4 outputs of x'φ a thread
    # (2026-12-04 night, untimed): `--dtype fp32 --fused-only --variants default pre_fwd_w2 --rounds 5`
    "pre_fwd_w2": {"PRE_FWD_BLOCKS": "pre_fwd_w2"},
    # bf16 streams: the write's backward with its reductions as tensor-core products (the default since 2026-12-05),
    # and on CUDA cores as before
    "post_bwd_tc": {"POST_BWD_PROJ": "bf16x3"},
    "post_bwd_fp32": {"POST_BWD_PROJ": "fp32"},
    # and the read's sums over the streams (h, dH^pre) the same way (2026-12-05)
    "tc_sums": {"POST_BWD_PROJ": "bf16x3", "PRE_SUMS": "bf16x3"},
    # bf16 streams: the read's dX on the block's stream rows, each term one tensor-core product (built 2026-12-05, the
    # default since 2026-12-06), and a (tokens, channels) tile a stream as before
    "dx_rows": {"DX_LAYOUT": "rows"},
    "dx_stream": {"DX_LAYOUT": "stream"},
    "dx_rows_d128": {"DX_LAYOUT": "rows", "DX_ROWS_BLOCKS": "pre_dx_rows_d128"},  # at 128 channels (2026-12-06)
    # the read's Sinkhorn iterations (forward and backward) a thread a token: no shuffles, shared memory or barriers
    # (2026-12-06; slower)
    "token_sinkhorn": {"SINKHORN": "token"},
    # bf16 streams: the read's forward on tensor cores at 32 tokens and two stages (READ_BLOCKS, the default before
    # 2026-12-06 late; 64 tokens at one stage since)
    "read_t32": {"READ_BLOCKS": "pre_fwd_tc_t32", "READ_LAYOUT": "fused"},
    # bf16 streams: the read's forward as three kernels, the projection a program a (token block, stream) (2026-12-06
    # late; READ_LAYOUT="auto" picks it on a GPU where the fused read has fewer than two programs an SM), and the fused
    # read whatever the token count (what "auto" picks off a GPU and at `medium`)
    "read_split": {"READ_LAYOUT": "split"},
    "read_fused": {"READ_LAYOUT": "fused"},
    # the read's backward with its sweep over X and dh as a kernel of its own (2026-12-06, end; 1% slower in the step)
    "bwd_split": {"PRE_BWD_LAYOUT": "split"},
    # the read's rows dX walking 4 or 8 token blocks a program, Φ loaded once for them (2026-12-06, end; no gain in
    # the step on an H100, 2026-12-06 evening)
    "dx_rows_tb4": {"DX_LAYOUT": "rows", "DX_ROWS_TOKEN_BLOCKS": 4},
    "dx_rows_tb8": {"DX_LAYOUT": "rows", "DX_ROWS_TOKEN_BLOCKS": 8},
    # φ's gradient at its blocks before 2026-12-06 evening: 32 tokens and 64 rows of n·d a program, 4 warps
    # (PHI_GRAD_BLOCKS; 128 rows and 8 warps since)
    "phi_r64": {"PHI_GRAD_BLOCKS": "phi_grad_r64"},
}


def _variant(name: str) -> str:
    value = globals()[name]
    if value not in VARIANT_CHOICES[name]:
        raise ValueError(f"kernels.mhc.fused.{name}={value!r}: choose one of "
                         f"{', '.join(map(str, VARIANT_CHOICES[name]))}")
    return value


@triton.jit
def _bf16_dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b on bf16 operands, fp32 accumulation (tensor cores). Under the interpreter the operands are upcast
    first: exact, so the products are the GPU's (Triton 3.6's interpreter gets bf16 tl.dot wrong)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _split_kernel(src_ptr, gain_ptr, dst_ptr, R, K: tl.constexpr, KP: tl.constexpr, PARTS: tl.constexpr,
                  HAS_GAIN: tl.constexpr, TRANS: tl.constexpr, BLOCK_R: tl.constexpr):
    """dst[p] = the p-th bf16 part of (g ⊙ src) (R, K) fp32, columns zero-padded to KP: (PARTS, R, KP), or with
    TRANS (PARTS, KP, R). Each part is what the parts before it left: Σ_p dst[p] holds 8·PARTS bits of every value."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, KP)
    mask_r = offs_r < R
    v = tl.load(src_ptr + offs_r[:, None] * K + offs_k[None, :], mask=mask_r[:, None] & (offs_k < K)[None, :],
                other=0.0)
    if HAS_GAIN:
        v = v * tl.load(gain_ptr + offs_r, mask=mask_r, other=0.0)[:, None]
    for p in tl.static_range(PARTS):
        part = v.to(tl.bfloat16)
        if TRANS:
            tl.store(dst_ptr + p * KP * R + offs_k[None, :] * R + offs_r[:, None], part, mask=mask_r[:, None])
        else:
            tl.store(dst_ptr + p * R * KP + offs_r[:, None] * KP + offs_k[None, :], part, mask=mask_r[:, None])
        v = v - part.to(tl.float32)


def split_bf16(src: Tensor, gain: Tensor | None, parts: int, kp: int, *, trans: bool = False) -> Tensor:
    """(parts, R, kp) bf16 (``trans``: (parts, kp, R)) whose sum over parts is g ⊙ src to 8·parts bits; one launch."""
    R, K = src.shape
    out = torch.empty((parts, kp, R) if trans else (parts, R, kp), device=src.device, dtype=torch.bfloat16)
    block_r = 64
    _split_kernel[(triton.cdiv(R, block_r),)](src, src if gain is None else gain, out, R, K=K, KP=kp, PARTS=parts,
                                              HAS_GAIN=gain is not None, TRANS=trans, BLOCK_R=block_r)
    return out


# --- per-token helpers: the (BLOCK_T, NP, NP) Sinkhorn tile ---------------------------------------


@triton.jit
def _lse(v, AXIS: tl.constexpr):
    """log Σ exp over AXIS; -inf entries are padding; an all-padding slice gives 0 (not NaN)."""
    m = tl.max(v, axis=AXIS)
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(v - tl.expand_dims(m, AXIS)), axis=AXIS)
    return tl.where(s > 0.0, m + tl.log(tl.where(s > 0.0, s, 1.0)), 0.0)


@triton.jit
def _sinkhorn_step(lm):
    """One iteration on log M (BLOCK_T, NP, NP): normalise the columns (axis 1), then the rows."""
    lm = lm - tl.expand_dims(_lse(lm, 1), 1)
    return lm - tl.expand_dims(_lse(lm, 2), 2)


@triton.jit
def _sinkhorn_log(logits, valid, ITERS: tl.constexpr):
    """log H^res after ITERS iterations; padded entries (not ``valid``) stay -inf."""
    lm = tl.where(valid, logits, float("-inf"))
    for _ in range(ITERS):
        lm = _sinkhorn_step(lm)
    return lm


@triton.jit
def _sinkhorn_fwd_bwd(logits, valid, dh_res, scratch_ptr, rows, mask_t, ITERS: tl.constexpr, NP: tl.constexpr):
    """(H^res, dL/dlogits) from dL/dH^res: the iterations once forward, then backpropagated last first.

    A log-domain normalisation y = v − lse(v) has dv = dy − exp(y) Σ dy (sum along the normalised
    axis), so iteration t needs its states after the column step (a_t) and after the row step (b_t).
    The forward keeps only its 2n normalisers per iteration (column c_t, row r_t) in a per-token
    scratch row (written and read back by this program, L2-resident); walking back,
    a_t = b_t + r_t and b_{t-1} = a_t + c_t rebuild the states: O(ITERS) steps, nothing large stored.
    """
    offs_n = tl.arange(0, NP)
    sp = scratch_ptr + rows[:, None] * (2 * ITERS * NP) + offs_n[None, :]  # (BLOCK_T, NP) row pointers
    m2 = mask_t[:, None] & (offs_n < NP)[None, :]
    lm = tl.where(valid, logits, float("-inf"))
    for t in range(ITERS):
        c = _lse(lm, 1)  # column normalisers (BLOCK_T, NP over j)
        lm = lm - tl.expand_dims(c, 1)
        r = _lse(lm, 2)  # row normalisers (BLOCK_T, NP over i)
        lm = lm - tl.expand_dims(r, 2)
        tl.store(sp + (2 * t) * NP, c, mask=m2)
        tl.store(sp + (2 * t + 1) * NP, r, mask=m2)
    tl.debug_barrier()  # the normalisers are read back below, possibly by other threads of the block
    h_res = tl.exp(lm)
    g = tl.where(valid, dh_res * h_res, 0.0)  # dL/d log H^res
    for t in range(ITERS):
        back = ITERS - 1 - t
        c = tl.load(sp + (2 * back) * NP, mask=m2, other=0.0)
        r = tl.load(sp + (2 * back + 1) * NP, mask=m2, other=0.0)
        a = lm + tl.expand_dims(r, 2)  # the state after this iteration's column step
        g = g - tl.exp(lm) * tl.expand_dims(tl.sum(g, axis=2), 2)  # through the row step
        g = g - tl.exp(a) * tl.expand_dims(tl.sum(g, axis=1), 1)  # through the column step
        lm = a + tl.expand_dims(c, 1)  # the state before this iteration
    return h_res, g


# --- per-token helpers, a thread a token (SINKHORN="token"): the n² entries of H^res as a tuple of (BLOCK_T,) vectors,
# so that the sums over i and over j are in a thread's registers (no shuffles, no shared memory, no barriers)


@triton.jit
def _res_logits(z_ptr, alpha_ptr, bres_ptr, rows, mask_t, N_STREAMS: tl.constexpr):
    """α_res z_res + b_res of the block's tokens: a tuple of n² (BLOCK_T,) vectors, entry (i, j) at i·n + j."""
    K: tl.constexpr = N_STREAMS * N_STREAMS + 2 * N_STREAMS
    zrow = z_ptr + rows * K + 2 * N_STREAMS
    a_res = tl.load(alpha_ptr + 2)
    out = ()
    for k in tl.static_range(N_STREAMS * N_STREAMS):
        out = out + (a_res * tl.load(zrow + k, mask=mask_t, other=0.0) + tl.load(bres_ptr + k),)
    return out


@triton.jit
def _lse_line(lm, start: tl.constexpr, step: tl.constexpr, N_STREAMS: tl.constexpr):
    """log Σ exp of the n entries lm[start], lm[start + step], ... (a column: step n; a row: step 1)."""
    m = lm[start]
    for q in tl.static_range(1, N_STREAMS):
        m = tl.maximum(m, lm[start + q * step])
    s = tl.exp(lm[start] - m)
    for q in tl.static_range(1, N_STREAMS):
        s += tl.exp(lm[start + q * step] - m)
    return m + tl.log(s)


@triton.jit
def _line_sum(v, start: tl.constexpr, step: tl.constexpr, N_STREAMS: tl.constexpr):
    """Σ of the n entries v[start], v[start + step], ... (a column: step n; a row: step 1)."""
    acc = v[start]
    for q in tl.static_range(1, N_STREAMS):
        acc += v[start + q * step]
    return acc


@triton.jit
def _token_normalise(lm, COLUMNS: tl.constexpr, N_STREAMS: tl.constexpr):
    """One half of a Sinkhorn iteration on a token's entries: with COLUMNS the column normalisers c_j = lse_i
    lm[i, j], else the row normalisers r_i = lse_j lm[i, j] (a tuple of n), and lm with them subtracted."""
    norms = ()
    for q in tl.static_range(N_STREAMS):
        if COLUMNS:
            norms = norms + (_lse_line(lm, q, N_STREAMS, N_STREAMS),)
        else:
            norms = norms + (_lse_line(lm, q * N_STREAMS, 1, N_STREAMS),)
    out = ()
    for k in tl.static_range(N_STREAMS * N_STREAMS):
        if COLUMNS:
            out = out + (lm[k] - norms[k % N_STREAMS],)
        else:
            out = out + (lm[k] - norms[k // N_STREAMS],)
    return norms, out


@triton.jit
def _token_sinkhorn_log(lm, ITERS: tl.constexpr, N_STREAMS: tl.constexpr):
    """``_sinkhorn_log`` on a token's entries (``_res_logits``): log H^res after ITERS iterations."""
    for _ in range(ITERS):
        _, lm = _token_normalise(lm, True, N_STREAMS)
        _, lm = _token_normalise(lm, False, N_STREAMS)
    return lm


@triton.jit
def _token_sinkhorn_fwd_bwd(lm, dh_res, scratch_ptr, rows, mask_t, ITERS: tl.constexpr, NP: tl.constexpr,
                            N_STREAMS: tl.constexpr):
    """``_sinkhorn_fwd_bwd`` on a token's entries: dL/dlogits (a tuple of n²) from dL/dH^res (``dh_res``, the same
    layout), the normalisers kept in the same scratch rows (N, ITERS, 2, NP)."""
    sp = scratch_ptr + rows * (2 * ITERS * NP)
    for t in range(ITERS):
        c, lm = _token_normalise(lm, True, N_STREAMS)
        r, lm = _token_normalise(lm, False, N_STREAMS)
        for q in tl.static_range(N_STREAMS):
            tl.store(sp + (2 * t) * NP + q, c[q], mask=mask_t)
            tl.store(sp + (2 * t + 1) * NP + q, r[q], mask=mask_t)
    tl.debug_barrier()  # a replicated layout may store a token's row from another thread than the one reading it
    g = ()
    for k in tl.static_range(N_STREAMS * N_STREAMS):
        g = g + (dh_res[k] * tl.exp(lm[k]),)  # dL/d log H^res
    for t in range(ITERS):
        back = ITERS - 1 - t
        c = ()
        r = ()
        for q in tl.static_range(N_STREAMS):
            c = c + (tl.load(sp + (2 * back) * NP + q, mask=mask_t, other=0.0),)
            r = r + (tl.load(sp + (2 * back + 1) * NP + q, mask=mask_t, other=0.0),)
        rs = ()  # through the row step: g -= exp(lm) Σ_j g
        for i in tl.static_range(N_STREAMS):
            rs = rs + (_line_sum(g, i * N_STREAMS, 1, N_STREAMS),)
        a = ()
        ng = ()
        for k in tl.static_range(N_STREAMS * N_STREAMS):
            ng = ng + (g[k] - tl.exp(lm[k]) * rs[k // N_STREAMS],)
            a = a + (lm[k] + r[k // N_STREAMS],)  # the state after this iteration's column step
        g = ng
        cs = ()  # through the column step: g -= exp(a) Σ_i g
        for j in tl.static_range(N_STREAMS):
            cs = cs + (_line_sum(g, j, N_STREAMS, N_STREAMS),)
        ng = ()
        nl = ()
        for k in tl.static_range(N_STREAMS * N_STREAMS):
            ng = ng + (g[k] - tl.exp(a[k]) * cs[k % N_STREAMS],)
            nl = nl + (a[k] + c[k % N_STREAMS],)  # the state before this iteration
        g = ng
        lm = nl
    return g


@triton.jit
def _coefficients(
    z_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, rows, mask_t,
    N_STREAMS: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr,
):
    """Per token of the block: z_pre, z_res tiles, H^pre, H^post, the H^res logits and log H^res."""
    K: tl.constexpr = N_STREAMS * N_STREAMS + 2 * N_STREAMS
    offs_n = tl.arange(0, NP)
    mask_n = offs_n < N_STREAMS
    m2 = mask_t[:, None] & mask_n[None, :]
    valid = (mask_n[:, None] & mask_n[None, :])[None, :, :]  # (1, NP, NP): real (i, j) entries
    zrow = z_ptr + rows * K  # (BLOCK_T,) pointers to each token's z
    z_pre = tl.load(zrow[:, None] + offs_n[None, :], mask=m2, other=0.0)
    z_post = tl.load(zrow[:, None] + N_STREAMS + offs_n[None, :], mask=m2, other=0.0)
    res_offs = 2 * N_STREAMS + offs_n[:, None] * N_STREAMS + offs_n[None, :]  # (NP, NP), row-major
    z_res = tl.load(zrow[:, None, None] + res_offs[None, :, :], mask=mask_t[:, None, None] & valid, other=0.0)
    a_pre = tl.load(alpha_ptr)
    a_post = tl.load(alpha_ptr + 1)
    a_res = tl.load(alpha_ptr + 2)
    b_pre = tl.load(bpre_ptr + offs_n, mask=mask_n, other=0.0)
    b_post = tl.load(bpost_ptr + offs_n, mask=mask_n, other=0.0)
    b_res = tl.load(bres_ptr + offs_n[:, None] * N_STREAMS + offs_n[None, :],
                    mask=mask_n[:, None] & mask_n[None, :], other=0.0)
    h_pre = tl.sigmoid(a_pre * z_pre + b_pre[None, :])
    h_post = 2.0 * tl.sigmoid(a_post * z_post + b_post[None, :])
    logits = a_res * z_res + b_res[None, :, :]
    return h_pre, h_post, logits, valid


# --- forward ------------------------------------------------------------------------------------


@triton.jit
def _project(xv, y, i, offs_d, mask_d, phi_ptr, gain_ptr, offs_k, mask_k,
             D: tl.constexpr, K: tl.constexpr, HAS_GAIN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y += (x ⊙ g) φ for a (BLOCK_T, BLOCK_D) fp32 chunk of stream i (φ fp32 (n·d, K))."""
    if HAS_GAIN:
        xv = xv * tl.load(gain_ptr + i * D + offs_d, mask=mask_d, other=0.0)[None, :]
    ph = tl.load(phi_ptr + (i * D + offs_d)[:, None] * K + offs_k[None, :],
                 mask=mask_d[:, None] & mask_k[None, :], other=0.0)
    return y + tl.dot(xv, ph, input_precision=DOT_PRECISION)


@triton.jit
def _project_parts(xb, y, i, offs_d, mask_d, parts_ptr, offs_k, ND: tl.constexpr, D: tl.constexpr,
                   KP: tl.constexpr, PARTS: tl.constexpr, INTERP: tl.constexpr):
    """y += x φ' for a (BLOCK_T, BLOCK_D) bf16 chunk of stream i, φ' = g ⊙ φ in PARTS bf16 parts (PARTS, n·d, KP),
    smallest part first (tensor cores, fp32 accumulation)."""
    for p in tl.static_range(PARTS):
        ph = tl.load(parts_ptr + (PARTS - 1 - p) * ND * KP + (i * D + offs_d)[:, None] * KP + offs_k[None, :],
                     mask=mask_d[:, None], other=0.0)
        y = _bf16_dot(xb, ph, y, INTERP)
    return y


@triton.jit
def _token_channel_tile(N, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (tokens, channels) grid's tile: its token rows (int64: N·n·d can pass 2³¹) with their mask, and its channels
    with theirs."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return offs_t.to(tl.int64), offs_t < N, offs_d, offs_d < D


@triton.jit
def _read_coefficients(y, ss, eps, z_ptr, r_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, hpre_ptr, hpost_ptr,
                       hres_ptr, rows, mask_t, ND: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr,
                       KP: tl.constexpr, ITERS: tl.constexpr, TOKEN_SINKHORN: tl.constexpr):
    """A token block's read coefficients from its projection y = x'φ before the norm (BLOCK_T, KP) and Σx² over the
    n·d values (BLOCK_T,): stores z = r·y and r (kept for backward), H^pre, H^post and H^res; returns H^pre
    (BLOCK_T, NP)."""
    K: tl.constexpr = N_STREAMS * N_STREAMS + 2 * N_STREAMS
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    offs_n = tl.arange(0, NP)
    m2 = mask_t[:, None] & (offs_n < N_STREAMS)[None, :]
    r = tl.rsqrt(ss / ND + eps)
    z = y * r[:, None]
    tl.store(z_ptr + rows[:, None] * K + offs_k[None, :], z, mask=mask_t[:, None] & mask_k[None, :])
    tl.store(r_ptr + rows, r, mask=mask_t)
    tl.debug_barrier()  # z is read back below in the (token, i, j) layout, by other threads of the block

    h_pre, h_post, logits, valid = _coefficients(z_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, rows, mask_t,
                                                 N_STREAMS, NP, ITERS)
    if TOKEN_SINKHORN:  # a thread a token (SINKHORN="token")
        lm = _token_sinkhorn_log(_res_logits(z_ptr, alpha_ptr, bres_ptr, rows, mask_t, N_STREAMS), ITERS, N_STREAMS)
        for k in tl.static_range(N_STREAMS * N_STREAMS):
            tl.store(hres_ptr + rows * (N_STREAMS * N_STREAMS) + k, tl.exp(lm[k]), mask=mask_t)
    else:
        h_res = tl.exp(_sinkhorn_log(logits, valid, ITERS))
        res_offs = offs_n[:, None] * N_STREAMS + offs_n[None, :]
        tl.store(hres_ptr + rows[:, None, None] * (N_STREAMS * N_STREAMS) + res_offs[None, :, :], h_res,
                 mask=mask_t[:, None, None] & valid)
    tl.store(hpre_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], h_pre, mask=m2)
    tl.store(hpost_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], h_post, mask=m2)
    return h_pre


@triton.jit
def _read_proj_kernel(
    x_ptr,  # bf16 streams (N, n, d), contiguous
    parts_ptr,  # φ' = g ⊙ φ in PARTS bf16 parts (PARTS, n·d, KP)
    yp_ptr,  # result: each stream's part of the projection, y_i = x_i φ'_i (N, n, KP) fp32
    ssp_ptr,  # result: each stream's Σ x_i² (N, n) fp32
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, KP: tl.constexpr, PARTS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, INTERP: tl.constexpr,
):
    """READ_LAYOUT="split", the first of three kernels: a program a (token block, stream), n times the programs of the
    one-kernel read, each stream's part of the projection on tensor cores (``_project_parts``)."""
    pid = tl.program_id(0)
    i = tl.program_id(1)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)
    ND: tl.constexpr = N_STREAMS * D
    offs_k = tl.arange(0, KP)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    y = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xr = tl.load(x_ptr + rows[:, None] * ND + i * D + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :],
                     other=0.0)
        xv = xr.to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
        y = _project_parts(xr, y, i, offs_d, mask_d, parts_ptr, offs_k, ND, D, KP, PARTS, INTERP)
    tl.store(yp_ptr + (rows * N_STREAMS + i)[:, None] * KP + offs_k[None, :], y, mask=mask_t[:, None])
    tl.store(ssp_ptr + rows * N_STREAMS + i, ss, mask=mask_t)


@triton.jit
def _read_coef_kernel(
    yp_ptr, ssp_ptr,  # the streams' parts of the projection (N, n, KP) and of Σx² (N, n), fp32
    alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr,  # as ``_pre_fwd_kernel``'s
    hpre_ptr, hpost_ptr, hres_ptr, z_ptr, r_ptr,  # results, as ``_pre_fwd_kernel``'s
    N, eps,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr, TOKEN_SINKHORN: tl.constexpr = False,
):
    """READ_LAYOUT="split", the second: the parts summed over the streams, then the coefficients (no stream loads)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)
    offs_k = tl.arange(0, KP)
    y = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for i in tl.static_range(N_STREAMS):
        y += tl.load(yp_ptr + (rows * N_STREAMS + i)[:, None] * KP + offs_k[None, :], mask=mask_t[:, None], other=0.0)
        ss += tl.load(ssp_ptr + rows * N_STREAMS + i, mask=mask_t, other=0.0)
    _read_coefficients(y, ss, eps, z_ptr, r_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, hpre_ptr, hpost_ptr,
                       hres_ptr, rows, mask_t, N_STREAMS * D, N_STREAMS, NP, KP, ITERS, TOKEN_SINKHORN)


@triton.jit
def _read_sum_kernel(
    x_ptr,  # streams (N, n, d), contiguous
    hpre_ptr,  # H^pre (N, n) fp32
    h_ptr,  # result: h = Σ_i H^pre_i X_i (N, d), x's dtype
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """READ_LAYOUT="split", the third: h over a (tokens, channels) grid, as the write's forward runs."""
    rows, mask_t, offs_d, mask_d = _token_channel_tile(N, D, BLOCK_T, BLOCK_D)
    offs_n = tl.arange(0, NP)
    m2 = mask_t[:, None] & (offs_n < N_STREAMS)[None, :]
    x3 = tl.load(x_ptr + rows[:, None, None] * (N_STREAMS * D) + offs_n[None, :, None] * D + offs_d[None, None, :],
                 mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
    h_pre = tl.load(hpre_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], mask=m2, other=0.0)
    h = tl.sum(h_pre[:, :, None] * x3, axis=1)
    tl.store(h_ptr + rows[:, None] * D + offs_d[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _pre_fwd_kernel(
    x_ptr,  # streams (N, n, d), contiguous, fp32 / bf16 / fp16; written here when FUSE_POST
    xin_ptr,  # FUSE_POST: the previous streams X_{l-1} (N, n, d), x's dtype
    f_ptr,  # FUSE_POST: the previous sublayer's output f_{l-1} (N, d), any float dtype
    hpost_in_ptr,  # FUSE_POST: the previous H^post (N, n) fp32
    hres_in_ptr,  # FUSE_POST: the previous H^res (N, n, n) fp32
    phi_ptr,  # φ (n·d, K) fp32, K = n²+2n, columns [pre | post | res row-major]
    gain_ptr,  # RMSNorm gain (n·d,) fp32; read only when HAS_GAIN
    alpha_ptr,  # (3,) fp32: α_pre, α_post, α_res
    bpre_ptr,  # (n,) fp32
    bpost_ptr,  # (n,) fp32
    bres_ptr,  # (n, n) fp32
    h_ptr,  # result: the read h (N, d), x's dtype
    hpre_ptr,  # result: H^pre (N, n) fp32
    hpost_ptr,  # result: H^post (N, n) fp32
    hres_ptr,  # result: H^res (N, n, n) fp32
    z_ptr,  # result: z = x'φ (N, K) fp32, kept for backward
    r_ptr,  # result: r = rsqrt(mean x² + eps) (N,) fp32, kept for backward
    N, eps,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, ITERS: tl.constexpr,
    HAS_GAIN: tl.constexpr, FUSE_POST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PARTS: tl.constexpr = 0, INTERP: tl.constexpr = False, TC_SUMS: tl.constexpr = False,
    TOKEN_SINKHORN: tl.constexpr = False,
):
    """PARTS > 0 (bf16 streams, PRE_PROJ="bf16x3"): ``phi_ptr`` is φ' = g ⊙ φ as PARTS bf16 parts (PARTS, n·d, KP)
    from ``split_bf16`` and the projection runs on tensor cores (``_project_parts``); HAS_GAIN is then False.
    TC_SUMS (PRE_SUMS="bf16x3", with PARTS > 0): sweep 2 is h = P X on tensor cores, X the block's (BLOCK_T·n, BLOCK_D)
    stream rows and P (BLOCK_T, BLOCK_T·n) block-diagonal of H^pre in three bf16 parts."""
    K: tl.constexpr = N_STREAMS * N_STREAMS + 2 * N_STREAMS
    NN: tl.constexpr = N_STREAMS * N_STREAMS
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)  # N·n·d can pass 2³¹
    ND: tl.constexpr = N_STREAMS * D
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K

    # sweep 1: Σx² and y = (x ⊙ g) φ over the n·d values of each token. FUSE_POST: x is first made
    # here, X_i = Σ_j H^res_ij X^in_j + H^post_i f (the previous sublayer's write), stored, and rounded
    # to the streams' dtype before use, so z is computed from exactly the stored streams.
    offs_n = tl.arange(0, NP)
    mask_n = offs_n < N_STREAMS
    m2 = mask_t[:, None] & mask_n[None, :]
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    y = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    if FUSE_POST:
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            mtd = mask_t[:, None] & mask_d[None, :]
            x_in = tl.load(xin_ptr + rows[:, None, None] * ND + offs_n[None, :, None] * D + offs_d[None, None, :],
                           mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
            f = tl.load(f_ptr + rows[:, None] * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
            for i in tl.static_range(N_STREAMS):
                h_row = tl.load(hres_in_ptr + rows[:, None] * NN + i * N_STREAMS + offs_n[None, :], mask=m2,
                                other=0.0)  # H^res[i, :] (BLOCK_T, NP), from L1
                hp_i = tl.load(hpost_in_ptr + rows * N_STREAMS + i, mask=mask_t, other=0.0)
                xv = (tl.sum(h_row[:, :, None] * x_in, axis=1) + hp_i[:, None] * f).to(x_ptr.dtype.element_ty)
                tl.store(x_ptr + rows[:, None] * ND + i * D + offs_d[None, :], xv, mask=mtd)
                xv = xv.to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
                y = _project(xv, y, i, offs_d, mask_d, phi_ptr, gain_ptr, offs_k, mask_k, D, K, HAS_GAIN,
                             DOT_PRECISION)
    else:
        for i in tl.static_range(N_STREAMS):
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < D
                xr = tl.load(x_ptr + rows[:, None] * ND + i * D + offs_d[None, :],
                             mask=mask_t[:, None] & mask_d[None, :], other=0.0)
                xv = xr.to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
                if PARTS > 0:
                    y = _project_parts(xr, y, i, offs_d, mask_d, phi_ptr, offs_k, ND, D, KP, PARTS, INTERP)
                else:
                    y = _project(xv, y, i, offs_d, mask_d, phi_ptr, gain_ptr, offs_k, mask_k, D, K, HAS_GAIN,
                                 DOT_PRECISION)
    # z is read back in the (token, i, j) layout and (FUSE_POST) the streams in sweep 2, by other threads of the
    # block: _read_coefficients has a barrier between its stores and those reads
    h_pre = _read_coefficients(y, ss, eps, z_ptr, r_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, hpre_ptr, hpost_ptr,
                               hres_ptr, rows, mask_t, ND, N_STREAMS, NP, KP, ITERS, TOKEN_SINKHORN)

    # sweep 2 (same tokens, from L2): h = Σ_i H^pre_i X_i
    if TC_SUMS:
        R: tl.constexpr = BLOCK_T * N_STREAMS
        tl.debug_barrier()  # H^pre, stored above, is read back as a block-diagonal tile by other threads
        offs_r = tl.arange(0, R)
        offs_b = tl.arange(0, BLOCK_T)
        p0, p1, p2 = _bf16_parts3(_block_diag(hpre_ptr, offs_b, offs_r, pid, N, N_STREAMS, BLOCK_T, False))
        srow = (pid * R + offs_r).to(tl.int64)  # rows of the (N·n, d) streams
        mask_r = srow < N * N_STREAMS
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            xs = tl.load(x_ptr + srow[:, None] * D + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :],
                         other=0.0)  # (R, BLOCK_D) bf16
            h = _bf16_dot(p2, xs, tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32), INTERP)  # smallest part first
            h = _bf16_dot(p1, xs, h, INTERP)
            h = _bf16_dot(p0, xs, h, INTERP)
            tl.store(h_ptr + rows[:, None] * D + offs_d[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=mask_t[:, None] & mask_d[None, :])
    for d0 in range(0, D if not TC_SUMS else 0, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x3 = tl.load(x_ptr + rows[:, None, None] * ND + offs_n[None, :, None] * D + offs_d[None, None, :],
                     mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
        h = tl.sum(h_pre[:, :, None] * x3, axis=1)
        tl.store(h_ptr + rows[:, None] * D + offs_d[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _post_fwd_kernel(
    x_ptr,  # streams (N, n, d), contiguous
    f_ptr,  # sublayer output (N, d), contiguous, any float dtype
    hpost_ptr,  # H^post (N, n) fp32
    hres_ptr,  # H^res (N, n, n) fp32
    out_ptr,  # result: X' (N, n, d), x's dtype
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows, mask_t, offs_d, mask_d = _token_channel_tile(N, D, BLOCK_T, BLOCK_D)
    ND: tl.constexpr = N_STREAMS * D
    offs_n = tl.arange(0, NP)
    mask_n = offs_n < N_STREAMS
    m2 = mask_t[:, None] & mask_n[None, :]
    mtd = mask_t[:, None] & mask_d[None, :]
    x3 = tl.load(x_ptr + rows[:, None, None] * ND + offs_n[None, :, None] * D + offs_d[None, None, :],
                 mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
    f = tl.load(f_ptr + rows[:, None] * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
    for i in tl.static_range(N_STREAMS):
        h_row = tl.load(hres_ptr + rows[:, None] * (N_STREAMS * N_STREAMS) + i * N_STREAMS + offs_n[None, :],
                        mask=m2, other=0.0)  # H^res[i, :] (BLOCK_T, NP)
        h_post = tl.load(hpost_ptr + rows * N_STREAMS + i, mask=mask_t, other=0.0)
        new = tl.sum(h_row[:, :, None] * x3, axis=1) + h_post[:, None] * f
        tl.store(out_ptr + rows[:, None] * ND + i * D + offs_d[None, :], new.to(out_ptr.dtype.element_ty), mask=mtd)


# --- backward -----------------------------------------------------------------------------------


@triton.jit
def _post_bwd_kernel(
    x_ptr,  # streams (N, n, d), contiguous
    f_ptr,  # sublayer output (N, d), contiguous
    hpost_ptr,  # H^post (N, n) fp32
    hres_ptr,  # H^res (N, n, n) fp32
    dout_ptr,  # upstream gradient dX' (N, n, d), contiguous
    dx_ptr,  # result: dX = H^resᵀ dX' (N, n, d), x's dtype; written only when STORE_DX
    df_ptr,  # result: df = Σ_i H^post_i dX'_i (N, d), f's dtype
    dhpost_ptr,  # result: dH^post (N, n) fp32
    dhres_ptr,  # result: dH^res (N, n, n) fp32
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, STORE_DX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    NN: tl.constexpr = N_STREAMS * N_STREAMS
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)
    ND: tl.constexpr = N_STREAMS * D
    offs_n = tl.arange(0, NP)
    mask_n = offs_n < N_STREAMS
    m2 = mask_t[:, None] & mask_n[None, :]
    valid = (mask_n[:, None] & mask_n[None, :])[None, :, :]
    res_offs = offs_n[:, None] * N_STREAMS + offs_n[None, :]
    h_res = tl.load(hres_ptr + rows[:, None, None] * NN + res_offs[None, :, :], mask=mask_t[:, None, None] & valid,
                    other=0.0)
    h_post = tl.load(hpost_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], mask=m2, other=0.0)
    col = offs_n[None, None, :]  # j of the (token, i, j) tile
    acc_res = tl.zeros((BLOCK_T, NP, NP), dtype=tl.float32)
    acc_post = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mtd = mask_t[:, None] & mask_d[None, :]
        g3 = tl.load(dout_ptr + rows[:, None, None] * ND + offs_n[None, :, None] * D + offs_d[None, None, :],
                     mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)  # dX'_i
        f = tl.load(f_ptr + rows[:, None] * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
        tl.store(df_ptr + rows[:, None] * D + offs_d[None, :],
                 tl.sum(h_post[:, :, None] * g3, axis=1).to(df_ptr.dtype.element_ty), mask=mtd)
        acc_post += tl.sum(g3 * f[:, None, :], axis=2)
        for j in tl.static_range(N_STREAMS):
            xj = tl.load(x_ptr + rows[:, None] * ND + j * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
            if STORE_DX:
                h_col = tl.sum(tl.where(col == j, h_res, 0.0), axis=2)  # H^res[:, j] (BLOCK_T, NP over i)
                dxj = tl.sum(h_col[:, :, None] * g3, axis=1)
                tl.store(dx_ptr + rows[:, None] * ND + j * D + offs_d[None, :], dxj.to(dx_ptr.dtype.element_ty),
                         mask=mtd)
            part = tl.sum(g3 * xj[:, None, :], axis=2)  # ⟨dX'_i, X_j⟩ over this chunk, (BLOCK_T, NP over i)
            acc_res += tl.where(col == j, part[:, :, None], 0.0)
    tl.store(dhpost_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], acc_post, mask=m2)
    tl.store(dhres_ptr + rows[:, None, None] * NN + res_offs[None, :, :], acc_res, mask=mask_t[:, None, None] & valid)


@triton.jit
def _bf16_parts3(v):
    """(hi, mid, lo): three bf16 parts of an fp32 tile, each what the parts before it left; they hold its 24 bits."""
    hi = v.to(tl.bfloat16)
    v = v - hi.to(tl.float32)
    mid = v.to(tl.bfloat16)
    return hi, mid, (v - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _block_diag(vals_ptr, row_offs, col_offs, pid, N, N_STREAMS: tl.constexpr, BLOCK_T: tl.constexpr,
                TRANS: tl.constexpr):
    """A block-diagonal fp32 tile built from per-token coefficients, loaded once. With TRANS False, ``vals`` is H^post
    or H^pre (N, n) and the tile is (BLOCK_T, R) with [t, t·n + i] = vals[t, i]; with TRANS True, ``vals`` is H^res
    (N, n, n) and the tile is (R, R) with [t·n + j, t·n + i] = H^res[t, i, j]. R = BLOCK_T·n."""
    if TRANS:
        tr = row_offs // N_STREAMS  # token of the row (local)
        tc = col_offs // N_STREAMS
        tok = pid * BLOCK_T + tr
        ptr = vals_ptr + tok.to(tl.int64)[:, None] * (N_STREAMS * N_STREAMS) \
            + (col_offs % N_STREAMS)[None, :] * N_STREAMS + (row_offs % N_STREAMS)[:, None]
        mask = (tr[:, None] == tc[None, :]) & (tok < N)[:, None]
    else:
        tok = pid * BLOCK_T + row_offs  # rows are tokens
        tc = col_offs // N_STREAMS
        ptr = vals_ptr + tok.to(tl.int64)[:, None] * N_STREAMS + (col_offs % N_STREAMS)[None, :]
        mask = (row_offs[:, None] == tc[None, :]) & (tok < N)[:, None]
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _post_bwd_tc_kernel(
    x_ptr,  # streams (N, n, d) bf16, contiguous: read as the (N·n, d) matrix of stream rows
    f_ptr,  # sublayer output (N, d), contiguous, bf16 / fp16 / fp32
    hpost_ptr,  # H^post (N, n) fp32
    hres_ptr,  # H^res (N, n, n) fp32
    dout_ptr,  # upstream gradient dX' (N, n, d) bf16, contiguous
    dx_ptr,  # result: dX = H^resᵀ dX' (N, n, d) bf16; written only when STORE_DX
    df_ptr,  # result: df = Σ_i H^post_i dX'_i (N, d), f's dtype
    dhpost_ptr,  # result: dH^post (N, n) fp32
    dhres_ptr,  # result: dH^res (N, n, n) fp32
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, STORE_DX: tl.constexpr, F_PARTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr,
):
    """The write's backward with every reduction on tensor cores (bf16 streams, n a power of two;
    ``POST_BWD_PROJ="bf16x3"``). The BLOCK_T tokens' stream rows are one (R, BLOCK_D) tile G of dX' and one
    X of the streams per channel chunk (R = BLOCK_T·n, row t·n + i), so

    - G Xᵀ (R, R), summed over the chunks, holds ⟨dX'_i, X_j⟩ of token t at [t·n + i, t·n + j]: dH^res is its
      diagonal n×n blocks (the rest is discarded);
    - G Fᵀ (R, BLOCK_T) holds ⟨dX'_i, f⟩ at [t·n + i, t]: dH^post;
    - df = P G with P (BLOCK_T, R) block-diagonal of H^post, dX = Q G with Q (R, R) block-diagonal of H^resᵀ.

    bf16 × bf16 products are exact in fp32; the fp32 factors (P, Q, f when fp32) are split in three bf16 parts
    (hi + mid + lo, 24 bits), so every result is the fp32 one up to the order of the sums. No shuffles: the
    fp32 kernel's reductions over d and over n were its cost (84% of the L1/shared pipe at `small`).
    """
    R: tl.constexpr = BLOCK_T * N_STREAMS
    NN: tl.constexpr = N_STREAMS * N_STREAMS
    pid = tl.program_id(0)
    offs_r = tl.arange(0, R)  # local stream rows t·n + i
    offs_b = tl.arange(0, BLOCK_T)  # local tokens
    srow = (pid * R + offs_r).to(tl.int64)  # rows of the (N·n, d) matrices
    mask_r = srow < N * N_STREAMS
    rows = (pid * BLOCK_T + offs_b).to(tl.int64)
    mask_t = rows < N
    # P (BLOCK_T, R) and Q (R, R), each in three bf16 parts
    p0, p1, p2 = _bf16_parts3(_block_diag(hpost_ptr, offs_b, offs_r, pid, N, N_STREAMS, BLOCK_T, False))
    if STORE_DX:
        q0, q1, q2 = _bf16_parts3(_block_diag(hres_ptr, offs_r, offs_r, pid, N, N_STREAMS, BLOCK_T, True))
    acc_res = tl.zeros((R, R), dtype=tl.float32)
    acc_post = tl.zeros((R, BLOCK_T), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mrd = mask_r[:, None] & mask_d[None, :]
        mtd = mask_t[:, None] & mask_d[None, :]
        g = tl.load(dout_ptr + srow[:, None] * D + offs_d[None, :], mask=mrd, other=0.0)  # (R, BLOCK_D) bf16
        xv = tl.load(x_ptr + srow[:, None] * D + offs_d[None, :], mask=mrd, other=0.0)
        acc_res = _bf16_dot(g, tl.trans(xv), acc_res, INTERP)
        f = tl.load(f_ptr + rows[:, None] * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
        for _ in tl.static_range(F_PARTS):  # f in bf16 parts (one when f is bf16)
            fp = f.to(tl.bfloat16)
            acc_post = _bf16_dot(g, tl.trans(fp), acc_post, INTERP)
            f = f - fp.to(tl.float32)
        df = _bf16_dot(p2, g, tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32), INTERP)  # smallest part first
        df = _bf16_dot(p1, g, df, INTERP)
        df = _bf16_dot(p0, g, df, INTERP)
        tl.store(df_ptr + rows[:, None] * D + offs_d[None, :], df.to(df_ptr.dtype.element_ty), mask=mtd)
        if STORE_DX:
            dx = _bf16_dot(q2, g, tl.zeros((R, BLOCK_D), dtype=tl.float32), INTERP)
            dx = _bf16_dot(q1, g, dx, INTERP)
            dx = _bf16_dot(q0, g, dx, INTERP)
            tl.store(dx_ptr + srow[:, None] * D + offs_d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mrd)
    # keep the diagonal blocks: row t·n + i, column t·n + j -> dH^res[t, i, j];
    # row t·n + i, column t -> dH^post[t, i]
    tr = offs_r // N_STREAMS
    tok = (pid * BLOCK_T + tr).to(tl.int64)
    ii = offs_r % N_STREAMS
    on_res = (tr[:, None] == tr[None, :]) & (tok < N)[:, None]
    tl.store(dhres_ptr + tok[:, None] * NN + ii[:, None] * N_STREAMS + (offs_r % N_STREAMS)[None, :], acc_res,
             mask=on_res)
    on_post = (tr[:, None] == offs_b[None, :]) & (tok < N)[:, None]
    tl.store(dhpost_ptr + tok[:, None] * N_STREAMS + ii[:, None] + 0 * offs_b[None, :], acc_post, mask=on_post)


@triton.jit
def _dpre_sweep(d_pre, x_ptr, dh_ptr, rows, mask_t, m2, offs_n, D: tl.constexpr, N_STREAMS: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """d_pre (BLOCK_T, NP) + dH^pre_i = ⟨dh, X_i⟩ of the block's tokens, fp32 on CUDA cores, BLOCK_D channels a trip."""
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x3 = tl.load(x_ptr + rows[:, None, None] * (N_STREAMS * D) + offs_n[None, :, None] * D + offs_d[None, None, :],
                     mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
        d_pre += tl.sum(x3 * dh[:, None, :], axis=2)
    return d_pre


@triton.jit
def _pre_sweep_kernel(
    x_ptr,  # streams (N, n, d), contiguous
    dh_ptr,  # upstream gradient of h (N, d), contiguous
    dhpre_ptr,  # upstream gradient of H^pre (N, n) fp32; read only when HAS_DPRE
    out_ptr,  # result: dH^pre_i = ⟨dh, X_i⟩ (+ the upstream dH^pre) (N, n) fp32
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, HAS_DPRE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """PRE_BWD_LAYOUT="split", the first of two: the read backward's sweep over X and dh alone, a program a few
    tokens (more programs than the one-kernel backward's, and none waits on the Sinkhorn); fp32 sums."""
    rows, mask_t, _, _ = _token_channel_tile(N, D, BLOCK_T, BLOCK_D)
    offs_n = tl.arange(0, NP)
    m2 = mask_t[:, None] & (offs_n < N_STREAMS)[None, :]
    d_pre = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    d_pre = _dpre_sweep(d_pre, x_ptr, dh_ptr, rows, mask_t, m2, offs_n, D, N_STREAMS, BLOCK_D)
    if HAS_DPRE:
        d_pre += tl.load(dhpre_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], mask=m2, other=0.0)
    tl.store(out_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], d_pre, mask=m2)


@triton.jit
def _pre_bwd_kernel(
    x_ptr,  # streams (N, n, d), contiguous
    dh_ptr,  # upstream gradient of h (N, d), contiguous
    dhpre_ptr,  # upstream gradient of H^pre (N, n) fp32; read only when HAS_DPRE
    dhpost_ptr,  # upstream gradient of H^post (N, n) fp32
    dhres_ptr,  # upstream gradient of H^res (N, n, n) fp32
    z_ptr,  # forward z (N, K) fp32
    r_ptr,  # forward r (N,) fp32
    alpha_ptr,  # (3,) fp32
    bpre_ptr,  # (n,) fp32
    bpost_ptr,  # (n,) fp32
    bres_ptr,  # (n, n) fp32
    dlogit_ptr,  # result: dL/d(α·z + b) (N, K) fp32, in z's column layout
    w_ptr,  # result: r · dz = r α ⊙ dlogit (N, K) fp32: φ's gradient Σ_t vec(X_t)ᵀ w_t, and dX's φ w
    coef_ptr,  # result: per token H^pre (n) and the RMS factor's share c (1), (N, n + 1) fp32
    scratch_ptr,  # Sinkhorn normalisers (N, ITERS, 2, NP) fp32, transient (see _sinkhorn_fwd_bwd)
    N, eps,
    D: tl.constexpr, N_STREAMS: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, ITERS: tl.constexpr,
    HAS_DPRE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TC_SUMS: tl.constexpr = False, DH_PARTS: tl.constexpr = 1, INTERP: tl.constexpr = False,
    TOKEN_SINKHORN: tl.constexpr = False, SWEEP: tl.constexpr = True,
):
    """The read's backward up to the per-token coefficients of dX (``_pre_dx_kernel`` then makes dX):
    one sweep over X and dh for dH^pre_i = ⟨dh, X_i⟩, then per token the logit gradients (σ', the
    Sinkhorn iterations recomputed and backpropagated), w = r dz and c = ⟨dz, z⟩ r² / nd.
    TC_SUMS (PRE_SUMS="bf16x3", bf16 streams, n = NP): the sweep is X dhᵀ on tensor cores over the block's
    (BLOCK_T·n, BLOCK_D) stream rows, dh in DH_PARTS bf16 parts (one when dh is bf16); dH^pre is its diagonal.
    Without SWEEP (PRE_BWD_LAYOUT="split") ``_pre_sweep_kernel`` made dH^pre, read as ``dhpre_ptr`` (HAS_DPRE)."""
    K: tl.constexpr = N_STREAMS * N_STREAMS + 2 * N_STREAMS
    NN: tl.constexpr = N_STREAMS * N_STREAMS
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)
    ND: tl.constexpr = N_STREAMS * D
    offs_n = tl.arange(0, NP)
    mask_n = offs_n < N_STREAMS
    m2 = mask_t[:, None] & mask_n[None, :]

    # sweep: dH^pre_i = ⟨dh, X_i⟩
    d_pre = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    if SWEEP and TC_SUMS:
        R: tl.constexpr = BLOCK_T * N_STREAMS
        offs_r = tl.arange(0, R)
        srow = (tl.program_id(0) * R + offs_r).to(tl.int64)  # rows of the (N·n, d) streams
        mask_r = srow < N * N_STREAMS
        acc = tl.zeros((R, BLOCK_T), dtype=tl.float32)  # ⟨X_i, dh⟩ of token t at [t·n + i, t]
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            xs = tl.load(x_ptr + srow[:, None] * D + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :],
                         other=0.0)  # (R, BLOCK_D) bf16
            dh = tl.load(dh_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :],
                         other=0.0).to(tl.float32)
            for _ in tl.static_range(DH_PARTS):
                dh_p = dh.to(tl.bfloat16)
                acc = _bf16_dot(xs, tl.trans(dh_p), acc, INTERP)
                dh = dh - dh_p.to(tl.float32)
        offs_b = tl.arange(0, BLOCK_T)
        acc3 = tl.reshape(acc, (BLOCK_T, NP, BLOCK_T))  # [t, i, t']
        d_pre = tl.sum(tl.where(offs_b[:, None, None] == offs_b[None, None, :], acc3, 0.0), axis=2)
    if SWEEP and not TC_SUMS:
        d_pre = _dpre_sweep(d_pre, x_ptr, dh_ptr, rows, mask_t, m2, offs_n, D, N_STREAMS, BLOCK_D)
    if HAS_DPRE:
        d_pre += tl.load(dhpre_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], mask=m2, other=0.0)

    # per token: the gradients of the logits α·z + b
    h_pre, h_post, logits, valid = _coefficients(z_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, rows, mask_t,
                                                 N_STREAMS, NP, ITERS)
    d_post = tl.load(dhpost_ptr + rows[:, None] * N_STREAMS + offs_n[None, :], mask=m2, other=0.0)
    res_offs = offs_n[:, None] * N_STREAMS + offs_n[None, :]
    dl_pre = d_pre * h_pre * (1.0 - h_pre)  # σ'
    dl_post = d_post * h_post * (1.0 - 0.5 * h_post)  # (2σ)' = 2σ(1 − σ)
    dl_row = dlogit_ptr + rows * K
    if TOKEN_SINKHORN:  # a thread a token (SINKHORN="token")
        d_res = ()
        for k in tl.static_range(NN):
            d_res = d_res + (tl.load(dhres_ptr + rows * NN + k, mask=mask_t, other=0.0),)
        dl_res = _token_sinkhorn_fwd_bwd(_res_logits(z_ptr, alpha_ptr, bres_ptr, rows, mask_t, N_STREAMS), d_res,
                                         scratch_ptr, rows, mask_t, ITERS, NP, N_STREAMS)
        for k in tl.static_range(NN):
            tl.store(dl_row + 2 * N_STREAMS + k, dl_res[k], mask=mask_t)
    else:
        d_res = tl.load(dhres_ptr + rows[:, None, None] * NN + res_offs[None, :, :],
                        mask=mask_t[:, None, None] & valid, other=0.0)
        _, dl_res = _sinkhorn_fwd_bwd(logits, valid, d_res, scratch_ptr, rows, mask_t, ITERS, NP)
        tl.store(dl_row[:, None, None] + 2 * N_STREAMS + res_offs[None, :, :], dl_res,
                 mask=mask_t[:, None, None] & valid)
    tl.store(dl_row[:, None] + offs_n[None, :], dl_pre, mask=m2)
    tl.store(dl_row[:, None] + N_STREAMS + offs_n[None, :], dl_post, mask=m2)
    tl.debug_barrier()  # read back below in z's flat column layout, by other threads of the block

    # dz = α ⊙ dlogit, flat (BLOCK_T, KP); the RMS factor's share: c = ⟨dz, z⟩ r² / nd
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    mtk = mask_t[:, None] & mask_k[None, :]
    a_col = tl.where(offs_k < N_STREAMS, tl.load(alpha_ptr),
                     tl.where(offs_k < 2 * N_STREAMS, tl.load(alpha_ptr + 1), tl.load(alpha_ptr + 2)))
    dz = tl.load(dlogit_ptr + rows[:, None] * K + offs_k[None, :], mask=mtk, other=0.0) * a_col[None, :]
    z = tl.load(z_ptr + rows[:, None] * K + offs_k[None, :], mask=mtk, other=0.0)
    r = tl.load(r_ptr + rows, mask=mask_t, other=0.0)
    c = tl.sum(dz * z, axis=1) * r * r / ND
    tl.store(w_ptr + rows[:, None] * K + offs_k[None, :], dz * r[:, None], mask=mtk)
    tl.store(coef_ptr + rows[:, None] * (N_STREAMS + 1) + offs_n[None, :], h_pre, mask=m2)
    tl.store(coef_ptr + rows * (N_STREAMS + 1) + N_STREAMS, c, mask=mask_t)


@triton.jit
def _pre_dx_kernel(
    x_ptr,  # streams (N, n, d), contiguous
    dh_ptr,  # upstream gradient of h (N, d), contiguous
    w_ptr,  # r · dz (N, K) fp32, from _pre_bwd_kernel
    coef_ptr,  # H^pre and c (N, n + 1) fp32, from _pre_bwd_kernel
    phit_ptr,  # φᵀ (K, n·d) fp32, contiguous: row k is column k of φ
    gain_ptr,  # RMSNorm gain (n·d,) fp32; read only when HAS_GAIN
    dout_ptr,  # the write's upstream gradient dX' (N, n, d); read only when HAS_DOUT (adds H^resᵀ dX')
    hres_ptr,  # H^res (N, n, n) fp32 as the write used it; read only when HAS_DOUT
    dx_ptr,  # result: dX (N, n, d), x's dtype
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_GAIN: tl.constexpr,
    HAS_DOUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PROJ: tl.constexpr = 0, NP: tl.constexpr = 1, INTERP: tl.constexpr = False,
):
    """dX_i = H^pre_i dh + g ⊙ (φ_i w) − c X_i (+ Σ_k H^res_ki dX'_k: the write's share) on one (tokens,
    channels) tile of every stream: an elementwise kernel over a 2-D grid, so that every SM streams (the
    fused version held the Sinkhorn tile's registers and ran one program per SM). φ_i w is one
    (BLOCK_T, KP) @ (KP, BLOCK_D) tl.dot a stream (w loaded once a program; a loop of K outer
    products instead waited on two loads per step: 0.42 ms a call at `small`).

    PROJ (DX_PROJ, 16-bit streams only): 0 tl.dot at DOT_PRECISION; 1 one tf32 tensor-core product; 2 w and φ in two
    bf16 parts each, three products (``phit_ptr`` then holds g ⊙ φ as (2, KP, n·d) bf16 parts, HAS_GAIN False).
    The write's dX' of all n streams is loaded as one (BLOCK_T, NP, BLOCK_D) tile before the loop over the streams
    (203 -> 142 registers; it had been loaded once per stream of dX)."""
    ND: tl.constexpr = N_STREAMS * D
    NN: tl.constexpr = N_STREAMS * N_STREAMS
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mtd = mask_t[:, None] & mask_d[None, :]
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
    dh = tl.load(dh_ptr + rows[:, None] * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
    c = tl.load(coef_ptr + rows * (N_STREAMS + 1) + N_STREAMS, mask=mask_t, other=0.0)
    if PROJ == 2:
        w_hi = w.to(tl.bfloat16)
        w_lo = (w - w_hi.to(tl.float32)).to(tl.bfloat16)
    offs_n = tl.arange(0, NP)
    m2 = mask_t[:, None] & (offs_n < N_STREAMS)[None, :]
    if HAS_DOUT:
        g3 = tl.load(dout_ptr + rows[:, None, None] * ND + offs_n[None, :, None] * D + offs_d[None, None, :],
                     mask=m2[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)  # dX'_k, every k
    for i in tl.static_range(N_STREAMS):
        hp_i = tl.load(coef_ptr + rows * (N_STREAMS + 1) + i, mask=mask_t, other=0.0)
        if PROJ == 2:
            cols = offs_k[:, None] * ND + i * D + offs_d[None, :]
            ph_hi = tl.load(phit_ptr + cols, mask=mask_d[None, :], other=0.0)  # (KP, BLOCK_D) bf16
            ph_lo = tl.load(phit_ptr + KP * ND + cols, mask=mask_d[None, :], other=0.0)
            proj = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            proj = _bf16_dot(w_lo, ph_hi, proj, INTERP)
            proj = _bf16_dot(w_hi, ph_lo, proj, INTERP)
            proj = _bf16_dot(w_hi, ph_hi, proj, INTERP)
        else:
            ph = tl.load(phit_ptr + offs_k[:, None] * ND + i * D + offs_d[None, :],
                         mask=mask_k[:, None] & mask_d[None, :], other=0.0)  # (KP, BLOCK_D)
            if PROJ == 1:
                proj = tl.dot(w, ph, input_precision="tf32")
            else:
                proj = tl.dot(w, ph, input_precision=DOT_PRECISION)
        if HAS_GAIN:
            proj = proj * tl.load(gain_ptr + i * D + offs_d, mask=mask_d, other=0.0)[None, :]
        xv = tl.load(x_ptr + rows[:, None] * ND + i * D + offs_d[None, :], mask=mtd, other=0.0).to(tl.float32)
        dx = hp_i[:, None] * dh + proj - c[:, None] * xv
        if HAS_DOUT:
            h_col = tl.load(hres_ptr + rows[:, None] * NN + offs_n[None, :] * N_STREAMS + i, mask=m2, other=0.0)
            dx += tl.sum(h_col[:, :, None] * g3, axis=1)  # Σ_k H^res_ki dX'_k
        tl.store(dx_ptr + rows[:, None] * ND + i * D + offs_d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mtd)


@triton.jit
def _pre_dx_rows_kernel(
    x_ptr,  # streams (N, n, d) bf16, contiguous: read as the (N·n, d) matrix of stream rows
    dh_ptr,  # upstream gradient of h (N, d) bf16, contiguous
    w_ptr,  # r · dz (N, K) fp32, from _pre_bwd_kernel
    coef_ptr,  # H^pre and c (N, n + 1) fp32, from _pre_bwd_kernel
    phit_ptr,  # g ⊙ φ, transposed, in two bf16 parts (2, KP, n·d) from split_bf16
    dout_ptr,  # the write's upstream gradient dX' (N, n, d) bf16; read only when HAS_DOUT
    hres_ptr,  # H^res (N, n, n) fp32 as the write used it; read only when HAS_DOUT
    dx_ptr,  # result: dX (N, n, d) bf16
    N,
    D: tl.constexpr, N_STREAMS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_DOUT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr, TOKEN_BLOCKS: tl.constexpr = 1,
):
    """dX on one (tokens, channels) tile with its rows the block's R = BLOCK_T·n stream rows (row t·n + i: stream i
    of token t) and every product on tensor cores (``DX_LAYOUT="rows"``, bf16 streams, DX_PROJ="bf16x2"):

        dX = (w Φ reshaped to the rows) + H^pre ⊙ dh − c ⊙ X (+ Q G)

    w Φ is one product for every stream: w (BLOCK_T, KP) @ Φ (KP, n·BLOCK_D), Φ's column i·BLOCK_D + c holding
    (g ⊙ φ)[i·d + c, :], both in two bf16 parts as ``_pre_dx_kernel``'s PROJ = 2 takes them (three products); in row-
    major order its (BLOCK_T, n·BLOCK_D) result is the (R, BLOCK_D) tile. Q (R, R) holds H^res[t, i, j] at
    [t·n + j, t·n + i] (three parts) and G is the rows of dX'. The per-stream kernel runs a (BLOCK_T, KP) @
    (KP, BLOCK_D) product a stream and sums over the write's streams with (tokens, n, channels) tiles.
    TOKEN_BLOCKS (DX_ROWS_TOKEN_BLOCKS): a program walks that many token blocks of its channel tile, loading Φ
    (2·KP·n·BLOCK_D bf16: 32 KB at n = 4, 64 channels, more than the tile's own stream bytes) once for them."""
    R: tl.constexpr = BLOCK_T * N_STREAMS
    ND: tl.constexpr = N_STREAMS * D
    offs_r = tl.arange(0, R)
    tok_l = offs_r // N_STREAMS  # the row's token in the block
    ii = offs_r % N_STREAMS  # the row's stream
    offs_b = tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    # Φ for every stream at once, (KP, n·BLOCK_D): column i·BLOCK_D + c holds (g ⊙ φ)[i·d + c, :], two bf16 parts of
    # each (three products, as PROJ = 2); loaded once for the program's TOKEN_BLOCKS token blocks
    offs_k = tl.arange(0, KP)
    offs_j = tl.arange(0, N_STREAMS * BLOCK_D)  # column i·BLOCK_D + c of Φ
    ch = tl.program_id(1) * BLOCK_D + offs_j % BLOCK_D
    cols = offs_k[:, None] * ND + ((offs_j // BLOCK_D) * D + ch)[None, :]  # (KP, n·BLOCK_D)
    ph_hi = tl.load(phit_ptr + cols, mask=(ch < D)[None, :], other=0.0)
    ph_lo = tl.load(phit_ptr + KP * ND + cols, mask=(ch < D)[None, :], other=0.0)

    for tb in range(TOKEN_BLOCKS):
        pid = tl.program_id(0) * TOKEN_BLOCKS + tb  # the token block
        srow = (pid * R + offs_r).to(tl.int64)  # rows of the (N·n, d) matrices
        mask_r = srow < N * N_STREAMS
        tok = (pid * BLOCK_T + tok_l).to(tl.int64)
        rows = (pid * BLOCK_T + offs_b).to(tl.int64)
        mrd = mask_r[:, None] & mask_d[None, :]

        # φ_i w for every stream at once: w (BLOCK_T, KP) @ Φ (KP, n·BLOCK_D); row-major, (BLOCK_T, n·BLOCK_D) is
        # (R, BLOCK_D) with row t·n + i
        wv = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=(rows < N)[:, None] & (offs_k < K)[None, :],
                     other=0.0)  # (BLOCK_T, KP) fp32
        w_hi = wv.to(tl.bfloat16)
        w_lo = (wv - w_hi.to(tl.float32)).to(tl.bfloat16)
        proj = _bf16_dot(w_lo, ph_hi, tl.zeros((BLOCK_T, N_STREAMS * BLOCK_D), dtype=tl.float32), INTERP)
        proj = _bf16_dot(w_hi, ph_lo, proj, INTERP)
        proj = _bf16_dot(w_hi, ph_hi, proj, INTERP)
        acc = tl.reshape(proj, (R, BLOCK_D))

        # H^pre_i dh − c X, elementwise on the rows (each token's dh read n times, from L1)
        hp = tl.load(coef_ptr + tok * (N_STREAMS + 1) + ii, mask=mask_r, other=0.0)
        c = tl.load(coef_ptr + tok * (N_STREAMS + 1) + N_STREAMS, mask=mask_r, other=0.0)
        dh = tl.load(dh_ptr + tok[:, None] * D + offs_d[None, :], mask=mrd, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + srow[:, None] * D + offs_d[None, :], mask=mrd, other=0.0).to(tl.float32)
        acc += hp[:, None] * dh - c[:, None] * xv

        if HAS_DOUT:  # + H^resᵀ dX': Q G, H^res loaded once and split in three bf16 parts
            g = tl.load(dout_ptr + srow[:, None] * D + offs_d[None, :], mask=mrd, other=0.0)  # (R, BLOCK_D) bf16
            q0, q1, q2 = _bf16_parts3(_block_diag(hres_ptr, offs_r, offs_r, pid, N, N_STREAMS, BLOCK_T, True))
            acc = _bf16_dot(q2, g, acc, INTERP)
            acc = _bf16_dot(q1, g, acc, INTERP)
            acc = _bf16_dot(q0, g, acc, INTERP)
        tl.store(dx_ptr + srow[:, None] * D + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mrd)


@triton.jit
def _phi_grad_kernel(
    x_ptr,  # streams viewed as (N, n·d), contiguous
    w_ptr,  # r · dz (N, K) fp32
    part_ptr,  # result: partial Σ_tokens xᵀ w (SPLIT, n·d, K) fp32
    N, ND, BLOCKS_PER_SPLIT,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT3: tl.constexpr = False, INTERP: tl.constexpr = False,
):
    """SPLIT3 (bf16 streams, PHI_GRAD_PROJ="bf16x3"): x stays bf16 (exact) and w is split into three bf16 parts,
    smallest first, each a tensor-core product with fp32 accumulation."""
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < ND
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    acc = tl.zeros((BLOCK_R, KP), dtype=tl.float32)
    it = split * 0  # a while loop: the interpreter cannot take a runtime bound in range()
    while it < BLOCKS_PER_SPLIT:
        offs_t = (split * BLOCKS_PER_SPLIT + it) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < N
        rows = offs_t.to(tl.int64)
        x_t = tl.load(x_ptr + rows[None, :] * ND + offs_r[:, None], mask=mask_r[:, None] & mask_t[None, :],
                      other=0.0)  # (BLOCK_R, BLOCK_T)
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        if SPLIT3:
            w_hi = w.to(tl.bfloat16)
            rest = w - w_hi.to(tl.float32)
            w_mid = rest.to(tl.bfloat16)
            acc = _bf16_dot(x_t, (rest - w_mid.to(tl.float32)).to(tl.bfloat16), acc, INTERP)
            acc = _bf16_dot(x_t, w_mid, acc, INTERP)
            acc = _bf16_dot(x_t, w_hi, acc, INTERP)
        else:
            acc += tl.dot(x_t.to(tl.float32), w, input_precision=DOT_PRECISION)
        it += 1
    tl.store(part_ptr + (split * ND + offs_r.to(tl.int64))[:, None] * K + offs_k[None, :], acc,
             mask=mask_r[:, None] & mask_k[None, :])


# --- launchers ----------------------------------------------------------------------------------


def _pow2(v: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(v))


# Under the interpreter each program costs milliseconds: by default one block covers a test shape.
# Tests shrink these to exercise several programs, channel chunks and token splits.
INTERPRETER_BLOCKS = {"block_t": 32, "block_d": None, "block_r": None, "split": 1}


# (BLOCK_T, largest BLOCK_D, num_warps, num_stages[, maxnreg]) per kernel on the GPU, chosen by compiling
# for sm_90 and reading ptxas's register counts (<= 128 registers per thread); not autotuned.
# The pre kernels take 32 tokens per program, so each program's read of φ from L2 (n·d·K fp32)
# serves more tokens; the post kernels are purely bandwidth-bound. `python -m benchmarks.ops_mhc
# --sweep-blocks` measures the alternatives: on an H200 at `small` (benchmarks/results/ops_mhc_blocks.md)
# post_fwd (8, 128, 4, 3) ran the write in 0.10 ms against 0.32 for (16, 64, 8, 2), post_bwd (8, 64, 4, 2)
# the fused write + read forward and backward in 1.99 ms against 3.12 for (8, 32, 4, 2); the pre
# kernels' defaults were within 2% of the fastest. pre_bwd then also made dX (a second sweep with a
# tl.dot per stream and channel chunk, 0.9 ms of a `small` step's 1.3 ms per sublayer, one program per
# SM); dX is now ``_pre_dx_kernel`` over a (tokens, channels) grid ("pre_dx"), and pre_bwd keeps the
# first sweep and the Sinkhorn backward. The sweeps of 2026-11-30 evening (ops_mhc_blocks_pre_fwd_dx.md,
# ops_mhc_blocks_final.md) chose pre_fwd (16, 64, 4, 2) with the fp32 projection (the write + read
# forward 0.225 ms, from 0.350 at (32, 16, 4, 1)) and pre_dx (32, 32, 4, 1); in a sweep the candidate
# timed first reads 10-25% slow (clocks), so close calls were taken from rows timed later.
GPU_BLOCKS = {
    "pre_fwd": (16, 64, 4, 2),
    # PRE_FWD_BLOCKS="pre_fwd_w2" (off by default, untimed): the fp32 projection at 4×4 outputs a thread; sm_90,
    # n = 4, d = 512 and 1024: 134 registers (166 with the norm gain), no spills; capped at 128 it spills with the gain
    "pre_fwd_w2": (32, 64, 2, 2),
    # PRE_PROJ="bf16x3" (tensor cores), READ_BLOCKS: 64 tokens at one stage since 2026-12-06 (the projection a
    # wgmma; 32 tokens compile to mma.sync). At two stages 64 tokens are faster still but race: z wrong on 43 of 16k
    # tokens at `small`, different from launch to launch (mhc_read_check_read64_h100.md), so not a candidate
    "pre_fwd_tc": (64, 64, 4, 1),
    "pre_fwd_tc_t32": (32, 64, 4, 2),  # READ_BLOCKS="pre_fwd_tc_t32": the default before (beat 16 tokens)
    # READ_LAYOUT="split" (blocks not swept): the projection at the read's blocks, one stage (two race at 64 tokens); the
    # coefficients at 64 tokens; h as the write's forward runs
    "read_proj": (64, 64, 4, 1),
    "read_coef": (64, 16, 4, 1),
    "read_sum": (8, 128, 4, 3),
    "pre_fwd_post": (32, 16, 4, 1),  # the one-pass write + read (POST_PRE_ONE_PASS): its earlier default
    "pre_bwd": (32, 32, 8, 1),
    # PRE_BWD_LAYOUT="split" (2026-12-06, end; blocks not swept): the sweep 8 tokens a program (2,048 programs at
    # `small`), the coefficients' backward without it at 32 tokens and 4 warps; sm_90a, n = 4: 32 and 48 registers
    "pre_sweep": (8, 128, 4, 2),
    "pre_bwd_coef": (32, 16, 4, 1),
    "pre_dx": (32, 32, 4, 1),
    "post_fwd": (8, 128, 4, 3),
    "post_bwd": (8, 64, 4, 2),
    # POST_BWD_PROJ="bf16x3" (the default): 16 tokens (R = 64 stream rows at n = 4); not swept
    "post_bwd_tc": (16, 64, 4, 2),
    # DX_LAYOUT="rows" (the default since 2026-12-06): 16 tokens (R = 64 stream rows at n = 4); (16, 128, 4, 2):
    # fewer instructions a token (108.5 against 150), 241 registers, not faster (DX_ROWS_BLOCKS)
    "pre_dx_rows": (16, 64, 4, 2),
    "pre_dx_rows_d128": (16, 128, 4, 2),  # DX_ROWS_BLOCKS="pre_dx_rows_d128"
    # φ's gradient Σ_t vec(X_t)ᵀ w_t: (tokens a step, rows of n·d a program, warps, stages), the programs split over the
    # tokens to about four an SM; 43% of its bytes' time at `small` on an H100 at (32, 64, 4, 3)
    # (profile_step_small_graphs_read64_h100.md); (64, 128, 8, 3) since 2026-12-06 evening (PHI_GRAD_BLOCKS)
    "phi_grad": (64, 128, 8, 3),
    "phi_grad_r64": (32, 64, 4, 3),  # PHI_GRAD_BLOCKS="phi_grad_r64": the blocks before
}


def _blocks(d: int, kernel: str) -> tuple[int, int, dict]:
    """(BLOCK_T, BLOCK_D, launch options) of one kernel; tl.dot needs BLOCK_T, BLOCK_D >= 16."""
    if interpreting():
        return INTERPRETER_BLOCKS["block_t"], INTERPRETER_BLOCKS["block_d"] or _pow2(d, 16), {"num_warps": 4}
    block_t, block_d, warps, stages, *maxnreg = GPU_BLOCKS[kernel]
    launch = {"num_warps": warps, "num_stages": stages}
    if maxnreg and maxnreg[0]:
        launch["maxnreg"] = maxnreg[0]
    return block_t, min(block_d, _pow2(d, 16)), launch


def _consts(n: int) -> tuple[int, int, int]:
    k = n * n + 2 * n
    return k, _pow2(n), _pow2(k, 16)


def pre_fwd(x, phi, gain, alpha, b_pre, b_post, b_res, *, iters, eps, post=None):
    """The read of streams ``x`` (N, n, d). With ``post = (x_in, f, h_post_in, h_res_in)`` the streams are
    first made from the previous sublayer's write, X = H^res_in X_in + H^post_inᵀ f: in the same pass
    when ``POST_PRE_ONE_PASS`` (``x`` is then an empty buffer that the kernel fills), else by the write
    kernel into ``x`` first."""
    N, n, d = x.shape
    if post is not None and not POST_PRE_ONE_PASS:
        _post_fwd_into(x, *post)
        post = None
    k, np_, kp = _consts(n)
    parts = 3 if _variant("PRE_PROJ") == "bf16x3" and x.dtype == torch.bfloat16 and post is None else 0
    if parts:  # φ' = g ⊙ φ in three bf16 parts: the projection on tensor cores (PRE_PROJ)
        phi, gain = split_bf16(phi, gain, parts, kp), None
    fp32_blocks, tc_blocks = _variant("PRE_FWD_BLOCKS"), _variant("READ_BLOCKS")  # checked whichever path runs
    if parts and read_layout(_variant("READ_LAYOUT"), N, tc_blocks, x.device) == "split":
        return _pre_fwd_split(x, phi, alpha, b_pre, b_post, b_res, parts, iters=iters, eps=eps)
    block_t, block_d, launch = _blocks(d, "pre_fwd_post" if post is not None else tc_blocks if parts
                                       else fp32_blocks)
    f32 = dict(device=x.device, dtype=torch.float32)
    h = torch.empty(N, d, device=x.device, dtype=x.dtype)
    h_pre, h_post, h_res = torch.empty(N, n, **f32), torch.empty(N, n, **f32), torch.empty(N, n, n, **f32)
    z, r = torch.empty(N, k, **f32), torch.empty(N, **f32)
    x_in, f, hp_in, hr_in = (x, x, z, z) if post is None else post
    tc_sums = bool(parts) and _pre_sums_on_tensor_cores(x, block_t)
    _pre_fwd_kernel[(triton.cdiv(N, block_t),)](
        x, x_in, f, hp_in, hr_in, phi, phi if gain is None else gain, alpha, b_pre, b_post, b_res, h, h_pre,
        h_post, h_res, z, r, N, eps, D=d, N_STREAMS=n, NP=np_, KP=kp, ITERS=iters, HAS_GAIN=gain is not None,
        FUSE_POST=post is not None, BLOCK_T=block_t, BLOCK_D=block_d,
        DOT_PRECISION=DOT_PRECISION, PARTS=parts, INTERP=interpreting(), TC_SUMS=tc_sums,
        TOKEN_SINKHORN=_variant("SINKHORN") == "token", **launch)
    return h, h_pre, h_post, h_res, z, r


def read_layout(setting: str, tokens: int, blocks: str, device: torch.device) -> str:
    """The read's forward layout for READ_LAYOUT ``setting``: "auto" is "split" on a GPU where the fused kernel at
    GPU_BLOCKS[``blocks``] would launch fewer than READ_SPLIT_BELOW programs (token blocks) an SM for ``tokens``,
    else "fused"; off a GPU "fused"."""
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return "fused"
    programs = triton.cdiv(tokens, GPU_BLOCKS[blocks][0])
    return "split" if programs < READ_SPLIT_BELOW * _sm_count(device) else "fused"


def _pre_fwd_split(x, parts_phi, alpha, b_pre, b_post, b_res, parts, *, iters, eps):
    """READ_LAYOUT="split": ``pre_fwd``'s results from three kernels (``parts_phi``: φ' in ``parts`` bf16 parts)."""
    N, n, d = x.shape
    k, np_, kp = _consts(n)
    f32 = dict(device=x.device, dtype=torch.float32)
    yp, ssp = torch.empty(N, n, kp, **f32), torch.empty(N, n, **f32)
    block_t, block_d, launch = _blocks(d, "read_proj")
    _read_proj_kernel[(triton.cdiv(N, block_t), n)](
        x, parts_phi, yp, ssp, N, D=d, N_STREAMS=n, KP=kp, PARTS=parts, BLOCK_T=block_t, BLOCK_D=block_d,
        INTERP=interpreting(), **launch)
    h_pre, h_post, h_res = torch.empty(N, n, **f32), torch.empty(N, n, **f32), torch.empty(N, n, n, **f32)
    z, r = torch.empty(N, k, **f32), torch.empty(N, **f32)
    block_t, _, launch = _blocks(d, "read_coef")
    _read_coef_kernel[(triton.cdiv(N, block_t),)](
        yp, ssp, alpha, b_pre, b_post, b_res, h_pre, h_post, h_res, z, r, N, eps, D=d, N_STREAMS=n, NP=np_, KP=kp,
        ITERS=iters, BLOCK_T=block_t, TOKEN_SINKHORN=_variant("SINKHORN") == "token", **launch)
    h = torch.empty(N, d, device=x.device, dtype=x.dtype)
    block_t, block_d, launch = _blocks(d, "read_sum")
    _read_sum_kernel[(triton.cdiv(N, block_t), triton.cdiv(d, block_d))](
        x, h_pre, h, N, D=d, N_STREAMS=n, NP=np_, BLOCK_T=block_t, BLOCK_D=block_d, **launch)
    return h, h_pre, h_post, h_res, z, r


def pre_bwd(x, dh, d_pre, d_post, d_res, dout, h_res, z, r, phi, gain, alpha, b_pre, b_post, b_res, *, iters, eps):
    """dX (and the per-token logit gradients); with ``dout`` (the write's dX') and its ``h_res``, dX also
    gets H^resᵀ dX'. Two kernels: the per-token coefficients, then dX over a (tokens, channels) grid."""
    N, n, d = x.shape
    k, np_, kp = _consts(n)
    sweep = _variant("PRE_BWD_LAYOUT") == "fused"
    block_t, block_d, launch = _blocks(d, "pre_bwd" if sweep else "pre_bwd_coef")
    f32 = dict(device=x.device, dtype=torch.float32)
    dlogit, w, coef = torch.empty(N, k, **f32), torch.empty(N, k, **f32), torch.empty(N, n + 1, **f32)
    scratch = torch.empty(N, iters, 2, np_, **f32)
    if not sweep:  # PRE_BWD_LAYOUT="split": dH^pre by a kernel of its own, then the coefficients' backward
        sweep_t, sweep_d, sweep_launch = _blocks(d, "pre_sweep")
        summed = torch.empty(N, n, **f32)
        _pre_sweep_kernel[(triton.cdiv(N, sweep_t),)](
            x, dh, z if d_pre is None else d_pre, summed, N, D=d, N_STREAMS=n, NP=np_, HAS_DPRE=d_pre is not None,
            BLOCK_T=sweep_t, BLOCK_D=sweep_d, **sweep_launch)
        d_pre = summed
    tc_sums = sweep and _pre_sums_on_tensor_cores(x, block_t)
    _pre_bwd_kernel[(triton.cdiv(N, block_t),)](
        x, dh, z if d_pre is None else d_pre, d_post, d_res, z, r, alpha, b_pre, b_post, b_res, dlogit, w, coef,
        scratch, N, eps, D=d, N_STREAMS=n, NP=np_, KP=kp, ITERS=iters, HAS_DPRE=d_pre is not None,
        BLOCK_T=block_t, BLOCK_D=max(block_d, 16) if tc_sums else block_d, TC_SUMS=tc_sums,
        DH_PARTS={torch.bfloat16: 1, torch.float16: 2}.get(dh.dtype, 3), INTERP=interpreting(),
        TOKEN_SINKHORN=_variant("SINKHORN") == "token", SWEEP=sweep, **launch)
    dx = torch.empty_like(x)
    proj = {"fp32": 0, "tf32": 1, "bf16x2": 2}[_variant("DX_PROJ")] if x.dtype != torch.float32 else 0
    if proj == 2:  # g ⊙ φ, transposed, in two bf16 parts (DX_PROJ)
        phit, gain = split_bf16(phi, gain, 2, kp, trans=True), None
    else:
        phit = phi.t().contiguous()
    if proj == 2 and _dx_on_rows(x, dh, dout):
        block_t, block_d, launch = _blocks(d, _variant("DX_ROWS_BLOCKS"))
        block_t, block_d = max(block_t, 16), max(block_d, 16)  # tensor-core tiles
        tb = _variant("DX_ROWS_TOKEN_BLOCKS")
        _pre_dx_rows_kernel[(triton.cdiv(N, block_t * tb), triton.cdiv(d, block_d))](
            x, dh, w, coef, phit, x if dout is None else dout, z if h_res is None else h_res, dx, N, D=d,
            N_STREAMS=n, K=k, KP=kp, HAS_DOUT=dout is not None, BLOCK_T=block_t, BLOCK_D=block_d,
            INTERP=interpreting(), TOKEN_BLOCKS=tb, **launch)
        return dx, dlogit, w
    block_t, block_d, launch = _blocks(d, "pre_dx")
    _pre_dx_kernel[(triton.cdiv(N, block_t), triton.cdiv(d, block_d))](
        x, dh, w, coef, phit, phi if gain is None else gain, x if dout is None else dout,
        z if h_res is None else h_res, dx, N, D=d, N_STREAMS=n, K=k, KP=kp, HAS_GAIN=gain is not None,
        HAS_DOUT=dout is not None, BLOCK_T=block_t, BLOCK_D=block_d, DOT_PRECISION=DOT_PRECISION, PROJ=proj,
        NP=np_, INTERP=interpreting(), **launch)
    return dx, dlogit, w


def phi_grad(x, w):
    """Σ_tokens vec(X)ᵀ w: (n·d, K) fp32, from x (N, n, d) and w (N, K) fp32."""
    N, n, d = x.shape
    nd, k = n * d, w.shape[1]
    if interpreting():
        block_t, split = INTERPRETER_BLOCKS["block_t"], INTERPRETER_BLOCKS["split"]
        block_r = INTERPRETER_BLOCKS["block_r"] or _pow2(nd, 16)
        launch = {"num_warps": 4}
    else:  # GPU_BLOCKS["phi_grad"]: (tokens a step, rows of n·d a program, warps, stages)
        block_t, block_r, launch = _blocks(nd, _variant("PHI_GRAD_BLOCKS"))
        split = max(1, min(triton.cdiv(N, block_t), 4 * _sm_count(x.device) // triton.cdiv(nd, block_r)))
    blocks = triton.cdiv(triton.cdiv(N, block_t), split)
    part = torch.empty(split, nd, k, device=x.device, dtype=torch.float32)
    split3 = _variant("PHI_GRAD_PROJ") == "bf16x3" and x.dtype == torch.bfloat16
    _phi_grad_kernel[(triton.cdiv(nd, block_r), split)](
        x, w, part, N, nd, blocks, K=k, KP=_pow2(k, 16), BLOCK_T=block_t, BLOCK_R=block_r,
        DOT_PRECISION=DOT_PRECISION, SPLIT3=split3, INTERP=interpreting(), **launch)
    return part.sum(0)


def post_fwd(x, f, h_post, h_res):
    out = torch.empty_like(x)
    _post_fwd_into(out, x, f, h_post, h_res)
    return out


def _post_fwd_into(out, x, f, h_post, h_res):
    """X' = H^res X + H^postᵀ f into ``out`` (N, n, d)."""
    N, n, d = x.shape
    block_t, block_d, launch = _blocks(d, "post_fwd")
    _post_fwd_kernel[(triton.cdiv(N, block_t), triton.cdiv(d, block_d))](
        x, f, h_post, h_res, out, N, D=d, N_STREAMS=n, NP=_pow2(n), BLOCK_T=block_t, BLOCK_D=block_d, **launch)


def _post_bwd_on_tensor_cores(x: Tensor, dout: Tensor) -> bool:
    """Whether the write's backward takes ``_post_bwd_tc_kernel``: POST_BWD_PROJ="bf16x3", bf16 streams and
    stream gradients, n a power of two up to 4 (R = BLOCK_T·n stream rows make a tensor-core tile)."""
    n = x.shape[1]
    return (_variant("POST_BWD_PROJ") == "bf16x3" and x.dtype == torch.bfloat16 and dout.dtype == torch.bfloat16
            and n in (1, 2, 4))


def _dx_on_rows(x: Tensor, dh: Tensor, dout: Tensor | None) -> bool:
    """Whether the read's dX takes ``_pre_dx_rows_kernel``: DX_LAYOUT="rows" with DX_PROJ="bf16x2" (the caller's
    check), bf16 streams, dh and dX', n = 1, 2, 4."""
    return (_variant("DX_LAYOUT") == "rows" and x.dtype == torch.bfloat16 and dh.dtype == torch.bfloat16
            and (dout is None or dout.dtype == torch.bfloat16) and x.shape[1] in (1, 2, 4))


def _pre_sums_on_tensor_cores(x: Tensor, block_t: int) -> bool:
    """Whether the read's sums over the streams run on tensor cores: PRE_SUMS="bf16x3", bf16 streams, n = 1, 2, 4
    (the forward's also needs PRE_PROJ="bf16x3"). Its tiles need 16 tokens a program at least."""
    if not (_variant("PRE_SUMS") == "bf16x3" and x.dtype == torch.bfloat16 and x.shape[1] in (1, 2, 4)):
        return False
    if block_t < 16:
        raise ValueError(f"PRE_SUMS='bf16x3' needs 16 tokens a program or more, not {block_t}")
    return True


def post_bwd(x, f, h_post, h_res, dout, *, store_dx=True):
    N, n, d = x.shape
    dx, df = (torch.empty_like(x) if store_dx else None), torch.empty_like(f)
    d_post = torch.empty(N, n, device=x.device, dtype=torch.float32)
    d_res = torch.empty(N, n, n, device=x.device, dtype=torch.float32)
    if _post_bwd_on_tensor_cores(x, dout):
        block_t, block_d, launch = _blocks(d, "post_bwd_tc")
        block_t = max(block_t, 16)  # tl.dot tiles: P is (BLOCK_T, R)
        f_parts = {torch.bfloat16: 1, torch.float16: 2}.get(f.dtype, 3)
        _post_bwd_tc_kernel[(triton.cdiv(N, block_t),)](
            x, f, h_post, h_res, dout, x if dx is None else dx, df, d_post, d_res, N,
            D=d, N_STREAMS=n, STORE_DX=store_dx, F_PARTS=f_parts, BLOCK_T=block_t, BLOCK_D=max(block_d, 16),
            INTERP=interpreting(), **launch)
        return dx, df, d_post, d_res
    block_t, block_d, launch = _blocks(d, "post_bwd")
    _post_bwd_kernel[(triton.cdiv(N, block_t),)](
        x, f, h_post, h_res, dout, x if dx is None else dx, df, d_post, d_res, N,
        D=d, N_STREAMS=n, NP=_pow2(n), STORE_DX=store_dx, BLOCK_T=block_t, BLOCK_D=block_d, **launch)
    return dx, df, d_post, d_res


# --- autograd ---------------------------------------------------------------------------------


class GradientLink:
    """Hands the write's upstream gradient dX' to the read's backward, which adds H^resᵀ dX' to its own
    dX in the same pass: no separate dX from the write, and no gradient sum of two (N, n, d) tensors.

    Made by ``mhc_pre`` and attached to the H^post and H^res it returns. ``mhc_post`` uses it only for
    the very streams object that read produced them from, and only when those coefficients carry
    gradient to the read; then the read's backward is certain to run after the write's (it needs the
    write's dH^post, dH^res), and it consumes what the write left. Anywhere else the write returns
    its own dX, as autograd usually does.
    """

    def __init__(self, x: Tensor):
        self.x = weakref.ref(x)  # the streams the read was given (identity, not a copy)
        self.dout: Tensor | None = None  # Σ dX' of the writes that used this read's coefficients
        self.h_res: Tensor | None = None  # (N, n, n) fp32, as the writes used it
        self.task = -1  # the backward pass (autograd graph task) that left dout

    def usable_by(self, x: Tensor, h_post: Tensor, h_res: Tensor) -> bool:
        return (self.x() is x and getattr(h_post, "_mhc_link", None) is self and torch.is_grad_enabled()
                and x.requires_grad and h_post.requires_grad and h_res.requires_grad)

    def add(self, dout: Tensor, h_res: Tensor) -> None:
        self.h_res = h_res
        task = torch._C._current_graph_task_id()
        if self.dout is None or self.task != task:  # a pass that never reached the read leaves nothing behind
            self.dout, self.task = dout, task
        else:
            self.dout = self.dout + dout

    def take(self) -> tuple[Tensor | None, Tensor | None]:
        """(Σ dX', H^res) left by this backward pass's writes, or (None, None)."""
        dout, h_res, self.dout, self.h_res = self.dout, self.h_res, None, None
        if dout is None or self.task != torch._C._current_graph_task_id():
            return None, None
        return dout, h_res


_PARTS: dict[tuple[int, torch.device], Tensor] = {}


def _parts(n: int, device) -> Tensor:
    """(K, 3) 0/1 matrix: which of pre, post, res each column of z belongs to (cached per n, device)."""
    key = (n, torch.device(device))
    if key not in _PARTS:
        part = torch.tensor([0] * n + [1] * n + [2] * (n * n))
        _PARTS[key] = torch.nn.functional.one_hot(part, 3).float().to(device)
    return _PARTS[key]


class MhcPreFunction(torch.autograd.Function):
    """(h, H^pre, H^post, H^res) from the streams (N, n, d); backward recomputes Sinkhorn from z."""

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, gain, iters, eps, link):
        params = [t.detach().float().contiguous() for t in (phi, alpha, b_pre, b_post, b_res)]
        gain32 = None if gain is None else gain.detach().float().contiguous()
        h, h_pre, h_post, h_res, z, r = pre_fwd(x, params[0], gain32, *params[1:], iters=iters, eps=eps)
        ctx.save_for_backward(x, z, r, gain32, *params)
        ctx.iters, ctx.eps, ctx.link = iters, eps, link
        ctx.dtypes = [t.dtype for t in (phi, alpha, b_pre, b_post, b_res)] + [None if gain is None else gain.dtype]
        return h, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dh, d_pre, d_post, d_res):
        x, z, r, gain, phi, alpha, b_pre, b_post, b_res = ctx.saved_tensors
        dx, grads = _read_backward(ctx, x, z, r, gain, phi, alpha, b_pre, b_post, b_res, dh, d_pre, d_post, d_res)
        return (dx, *grads, None, None, None)


def _read_backward(ctx, x, z, r, gain, phi, alpha, b_pre, b_post, b_res, dh, d_pre, d_post, d_res, dx_extra=None):
    """dX of a read (with the linked write's H^resᵀ dX' and ``dx_extra``, a direct gradient of X, added)
    and the gradients of its parameters [φ, α, b_pre, b_post, b_res, gain] in their own dtypes."""
    N, n, d = x.shape
    zeros = lambda *s: torch.zeros(*s, device=x.device, dtype=torch.float32)  # noqa: E731
    dh = torch.zeros(N, d, device=x.device, dtype=x.dtype) if dh is None else dh.contiguous()
    d_pre = None if d_pre is None else d_pre.float().contiguous()
    d_post = zeros(N, n) if d_post is None else d_post.float().contiguous()
    d_res = zeros(N, n, n) if d_res is None else d_res.float().contiguous()
    dout, h_res = ctx.link.take()  # the write's dX' (N, n, d) and H^res, or None
    dx, dlogit, w = pre_bwd(x, dh, d_pre, d_post, d_res, None if dout is None else dout.contiguous(), h_res, z,
                            r, phi, gain, alpha, b_pre, b_post, b_res, iters=ctx.iters, eps=ctx.eps)
    if dx_extra is not None:
        dx += dx_extra.reshape(dx.shape)
    # α and b: sums over tokens of the per-token logit gradients (dα_k = Σ dlogit_k ⊙ z_k per part)
    k = z.shape[1]
    sums = torch.cat([dlogit * z, dlogit], 1).sum(0)  # (2K,): [Σ dlogit ⊙ z | Σ dlogit]
    d_alpha = sums[:k] @ _parts(n, x.device)  # (3,)
    d_b = sums[k:].split([n, n, n * n])
    p = phi_grad(x, w)  # Σ_t vec(X_t)ᵀ r_t dz_t: (nd, K)
    d_phi = p if gain is None else p * gain[:, None]
    d_gain = None if gain is None else (phi * p).sum(-1)
    grads = [d_phi, d_alpha, d_b[0], d_b[1], d_b[2].view(n, n), d_gain]
    return dx, [None if g is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes)]


class MhcPostFunction(torch.autograd.Function):
    """X' = H^res X + H^postᵀ f on (N, n, d) streams."""

    @staticmethod
    def forward(ctx, x, f, h_post, h_res, link, recompute, layer):
        h_post32, h_res32 = h_post.float().contiguous(), h_res.float().contiguous()
        keep = recompute is None or recompute.keeps(layer)
        ctx.save_for_backward(x if keep else None, f, h_post32, h_res32)  # the write's inputs first (recompute.py)
        ctx.coeff_dtype, ctx.link, ctx.recompute, ctx.layer = h_post.dtype, link, recompute, layer
        if recompute is not None:
            recompute.record_write(layer, ctx)
        return post_fwd(x, f, h_post32, h_res32)

    @staticmethod
    def backward(ctx, dout):
        x, f, h_post, h_res = ctx.saved_tensors
        if x is None:  # X_l dropped in forward (StreamRecompute): rebuilt from its block's kept streams
            x = ctx.recompute.streams(ctx.layer, post_fwd)
        dout = dout.contiguous()
        linked = ctx.link is not None and ctx.needs_input_grad[0]
        if linked:
            ctx.link.add(dout, h_res)  # the read's backward adds H^resᵀ dX' to its dX
        dx, df, d_post, d_res = post_bwd(x, f, h_post, h_res, dout, store_dx=ctx.needs_input_grad[0] and not linked)
        return dx, df, d_post.to(ctx.coeff_dtype), d_res.to(ctx.coeff_dtype), None, None, None


class MhcPostPreFunction(torch.autograd.Function):
    """The write of sublayer l and the read of sublayer l+1 in one forward pass over the streams:
    (X_l, f_l, H^post_l, H^res_l; parameters of l+1) -> (X_{l+1}, h_{l+1}, H^pre, H^post, H^res of l+1).

    Backward: the read's backward (``_pre_bwd_kernel`` and ``_pre_dx_kernel``, which also adds H^res_{l+1}ᵀ dX_{l+2} handed over
    by the next write) gives dX_{l+1}; the write's backward (``_post_bwd_kernel``) then gives df_l, dH^post_l,
    dH^res_l, and leaves dX_{l+1} on ``link_in`` for the read of sublayer l (or returns its own dX_l).
    """

    @staticmethod
    def forward(ctx, x_in, f, h_post_in, h_res_in, phi, alpha, b_pre, b_post, b_res, gain, iters, eps, link_in, link,
                recompute, layer):
        ctx.set_materialize_grads(False)
        hp_in, hr_in = h_post_in.float().contiguous(), h_res_in.float().contiguous()
        params = [t.detach().float().contiguous() for t in (phi, alpha, b_pre, b_post, b_res)]
        gain32 = None if gain is None else gain.detach().float().contiguous()
        x = torch.empty_like(x_in)  # X_{l+1}, filled by the kernel
        h, h_pre, h_post, h_res, z, r = pre_fwd(x, params[0], gain32, *params[1:], iters=iters, eps=eps,
                                                post=(x_in, f, hp_in, hr_in))
        # the write's inputs first (recompute.py reads them); with a StreamRecompute only the kept streams
        keep_in, keep_out = (True, True) if recompute is None else (recompute.keeps(layer), recompute.keeps(layer + 1))
        ctx.save_for_backward(x_in if keep_in else None, f, hp_in, hr_in, x if keep_out else None, z, r, gain32,
                              *params)
        ctx.iters, ctx.eps, ctx.link_in, ctx.link = iters, eps, link_in, link
        ctx.coeff_dtype, ctx.recompute, ctx.layer = h_post_in.dtype, recompute, layer
        if recompute is not None:
            recompute.record_write(layer, ctx)
        ctx.dtypes = [t.dtype for t in (phi, alpha, b_pre, b_post, b_res)] + [None if gain is None else gain.dtype]
        return x, h, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dx, dh, d_pre, d_post, d_res):
        x_in, f, hp_in, hr_in, x, z, r, gain, phi, alpha, b_pre, b_post, b_res = ctx.saved_tensors
        if x is None:  # X_{l+1} dropped in forward (StreamRecompute): rebuilt (or left by the next write's backward)
            x = ctx.recompute.streams(ctx.layer + 1, post_fwd)
        if x_in is None:
            x_in = ctx.recompute.streams(ctx.layer, post_fwd)
        # dX_{l+1}: the read's share, the next write's H^resᵀ dX_{l+2} (link) and any direct gradient dx
        dx, grads = _read_backward(ctx, x, z, r, gain, phi, alpha, b_pre, b_post, b_res, dh, d_pre, d_post, d_res,
                                   dx_extra=dx)
        linked = ctx.link_in is not None and ctx.needs_input_grad[0]
        if linked:
            ctx.link_in.add(dx, hr_in)  # the read of sublayer l adds H^res_lᵀ dX_{l+1} to its dX_l
        dx_in, df, dp, dr = post_bwd(x_in, f, hp_in, hr_in, dx, store_dx=ctx.needs_input_grad[0] and not linked)
        if ctx.recompute is not None:
            ctx.recompute.release(ctx.layer + 1)  # the read of sublayer l+1 was X_{l+1}'s last use
        return (dx_in, df, dp.to(ctx.coeff_dtype), dr.to(ctx.coeff_dtype), *grads, None, None, None, None, None, None)


def mhc_pre(x: Tensor, phi, alpha, b_pre, b_post, b_res, norm_gain, *, sinkhorn_iters: int, eps: float):
    """x (..., n, d) -> h (..., d) in x's dtype, H^pre (..., n), H^post (..., n), H^res (..., n, n) fp32."""
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    link = GradientLink(x)
    h, h_pre, h_post, h_res = MhcPreFunction.apply(x.reshape(-1, n, d).contiguous(), phi, alpha, b_pre, b_post,
                                                   b_res, norm_gain, sinkhorn_iters, eps, link)
    h_post, h_res = h_post.view(*lead, n), h_res.view(*lead, n, n)
    h_post._mhc_link = h_res._mhc_link = link
    return h.view(*lead, d), h_pre.view(*lead, n), h_post, h_res


@torch.compiler.disable  # a StreamRecompute's bookkeeping (weak references to the nodes) stays out of any graph
def _apply_recomputed(function, *args):
    return function.apply(*args)


def _apply(function, *args):
    """``function.apply(*args)``, whose last two arguments are (recompute, layer): with a StreamRecompute, a call
    outside torch.compile's graph."""
    recompute = args[-2]
    return function.apply(*args) if recompute is None else _apply_recomputed(function, *args)


def mhc_post(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor, *, recompute: StreamRecompute | None = None,
             layer: int = 0) -> Tensor:
    """x (..., n, d), out (..., d), h_post (..., n), h_res (..., n, n) -> X' (..., n, d) in x's dtype.
    ``recompute``: keep x for backward only where it says (x is X_layer), rebuild it otherwise."""
    n, d = x.shape[-2:]
    link = getattr(h_res, "_mhc_link", None)
    link = link if link is not None and link.usable_by(x, h_post, h_res) else None
    new = _apply(MhcPostFunction, x.reshape(-1, n, d).contiguous(), out.reshape(-1, d).contiguous(),
                 h_post.reshape(-1, n), h_res.reshape(-1, n, n), link, recompute, layer)
    return new.view(x.shape)


def mhc_post_pre(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor, phi, alpha, b_pre, b_post, b_res, norm_gain,
                 *, sinkhorn_iters: int, eps: float, recompute: StreamRecompute | None = None, layer: int = 0):
    """(X' = H^res X + H^postᵀ out, then the read of X': h, H^pre, H^post, H^res), one pass over the streams.
    ``recompute``: keep x (X_layer) and X' (X_layer+1) for backward only where it says, rebuild them otherwise."""
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    link_in = getattr(h_res, "_mhc_link", None)
    link_in = link_in if link_in is not None and link_in.usable_by(x, h_post, h_res) else None
    link = GradientLink(x)  # the read's link, pointed at X' below
    new, h, h_pre, h_post, h_res = _apply(
        MhcPostPreFunction, x.reshape(-1, n, d).contiguous(), out.reshape(-1, d).contiguous(), h_post.reshape(-1, n),
        h_res.reshape(-1, n, n), phi, alpha, b_pre, b_post, b_res, norm_gain, sinkhorn_iters, eps, link_in, link,
        recompute, layer)
    new = new.view(x.shape)
    link.x = weakref.ref(new)  # the streams object the caller holds (a view of the kernel's output)
    h_post, h_res = h_post.view(*lead, n), h_res.view(*lead, n, n)
    h_post._mhc_link = h_res._mhc_link = link
    return new, h.view(*lead, d), h_pre.view(*lead, n), h_post, h_res
