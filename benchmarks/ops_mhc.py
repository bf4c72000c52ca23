"""Fused mHC read / write (kernels/mhc) vs its PyTorch reference and torch.compile of it, on a CUDA GPU.

    python -m benchmarks.ops_mhc [--shapes small medium d2048] [--n 4] [--dtype bf16|fp32] [--fused-only]
        [--variants NAME ...] [--rounds R] [--tag T]
    python -m benchmarks.ops_mhc --sweep-blocks [--shapes small medium] [--kernels pre_bwd pre_dx] [--dtype bf16|fp32]

In ONE process (timings on a shared host swing between invocations):

1. Ceilings: device-to-device copy bandwidth and the fp32 CUDA-core matmul rate (benchmarks/roofline.py).
2. Per shape and fused variant, a parity check first: the bf16 fused ops (h, H^pre, H^post, H^res, X' and the gradients
   of X, f, φ, α, b_pre, b_post, b_res under random upstream gradients; then the same for `mhc_post_pre`)
   against the fp32 reference on the same bf16-valued inputs; a failure makes the script exit non-zero
   after the table is written.
3. Median times (triton.testing.do_bench) of forward (`mhc_pre`, `mhc_post`, and one sublayer's
   pre + post, under no_grad) and of forward+backward of the sublayer; and of `post+pre`, the op the
   model runs per sublayer (`mhc_post_pre`: a write fused with the next read), forward and
   forward+backward, for: the fused ops with the
   projections in "tf32x3" and in "ieee" fp32, the reference, and torch.compile of the reference.
4. Minimal bytes (every op's inputs read once, outputs written once; bf16 streams, fp32
   coefficients), CUDA-core FLOPs (counted below), roofline = max(bytes / copy bandwidth,
   FLOPs / fp32 rate), and the fraction of it each backend achieves.

Writes benchmarks/results/ops_mhc.md (command, GPU, date).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import math

import torch

from benchmarks import roofline
from benchmarks.roofline import Ceilings, Table, bench_ms, held, read_rows

# (name, B, T, d): model=small (d=512, 16×1024), model=medium (d=1024, 16×2048), and d=2048
SHAPES = {"small": (16, 1024, 512), "medium": (16, 2048, 1024), "d2048": (8, 2048, 2048)}
ITERS = 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PARITY_TOL = {"bf16": 2e-2, "fp32": 1e-4}  # relative error (L2) of any output or gradient vs the fp32 reference
SINKHORN_HALF_STEP = 5  # log-domain normalisation per entry: max, subtract, exp, sum, subtract (+ a log per row)


def make_inputs(B, T, n, d, seed, *, dtype=torch.bfloat16, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    k = n * n + 2 * n

    def rand(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*shape, device=device, generator=g)

    return {
        "x": rand(B, T, n, d).to(dtype),
        "phi": rand(n * d, k, scale=1.0 / math.sqrt(n * d)),
        "alpha": rand(3, scale=0.2, shift=0.8),
        "b_pre": rand(n, scale=0.5),
        "b_post": rand(n, scale=0.5),
        "b_res": rand(n, n, scale=0.5) + 2.0 * torch.eye(n, device=device),
        "out": rand(B, T, d).to(dtype),
    }


def sublayer(backend, p):
    """One sublayer's mHC: read (coefficients + h), then write X' with the sublayer output p["out"]."""
    from kernels.mhc import mhc_post, mhc_pre

    h, h_pre, h_post, h_res = mhc_pre(p["x"], p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"],
                                      sinkhorn_iters=ITERS, backend=backend)
    return h, h_pre, h_post, h_res, mhc_post(p["x"], p["out"], h_post, h_res, backend=backend)


def post_pre(backend, p, h_post, h_res):
    """The model's steady-state op: sublayer l's write fused with sublayer l+1's read (same parameters)."""
    from kernels.mhc import mhc_post_pre

    return mhc_post_pre(p["x"], p["out"], h_post, h_res, p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"],
                        sinkhorn_iters=ITERS, backend=backend)


def reference_post_pre(p, h_post, h_res):
    from kernels.mhc import reference

    new = reference.mhc_post(p["x"], p["out"], h_post, h_res)
    return (new, *reference.mhc_pre(new, p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"],
                                    sinkhorn_iters=ITERS))


def reference_sublayer(p):
    from kernels.mhc import reference

    h, h_pre, h_post, h_res = reference.mhc_pre(p["x"], p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"],
                                                sinkhorn_iters=ITERS)
    return h, h_pre, h_post, h_res, reference.mhc_post(p["x"], p["out"], h_post, h_res)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


LEAVES = ("x", "phi", "alpha", "b_pre", "b_post", "b_res", "out")  # make_inputs' tensors, in its order
SUBLAYER_OUTS = ("h", "H_pre", "H_post", "H_res", "X'")  # sublayer's results
POST_PRE_OUTS = ("X'", "h", "H_pre", "H_post", "H_res")  # post_pre's results (the write's X', then the next read)


def parity_errors(B, T, n, d, seed, dtype, device="cuda", backend="triton") -> dict[str, float]:
    """Relative error (L2) of every output and gradient of the ops of ``backend`` (the fused ops; "torch": the
    reference itself) on ``dtype`` streams vs the fp32 reference on the same values, by name: the sublayer's read +
    write (``sublayer/h`` ..., ``sublayer/dx`` ...) and the write fused with the next read (``post_pre/...``, also the
    gradients of the coefficients it takes, ``dH_post_in``, ``dH_res_in``)."""
    inp = make_inputs(B, T, n, d, seed, dtype=dtype, device=device)
    bf = {k: v.clone().requires_grad_() for k, v in inp.items()}
    ref_in = {k: v.detach().float().requires_grad_() for k, v in inp.items()}
    errs = {}
    got, ref = sublayer(backend, bf), sublayer("torch", ref_in)
    errs |= {f"sublayer/{k}": rel_err(a, b) for k, a, b in zip(SUBLAYER_OUTS, got, ref)}
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ups = [torch.randn(o.shape, device=device, generator=g) for o in ref]
    ga = torch.autograd.grad(sum((o.float() * u).sum() for o, u in zip(got, ups)), list(bf.values()))
    gb = torch.autograd.grad(sum((o * u).sum() for o, u in zip(ref, ups)), list(ref_in.values()))
    errs |= {f"sublayer/d{k}": rel_err(a, b) for k, a, b in zip(LEAVES, ga, gb)}
    # the write fused with the next read (mhc_post_pre), on coefficients of the read above
    coeffs = [[t.detach().float().requires_grad_() for t in outs[2:4]] for outs in (got, ref)]
    got, ref = post_pre(backend, bf, *coeffs[0]), post_pre("torch", ref_in, *coeffs[1])
    errs |= {f"post_pre/{k}": rel_err(a, b) for k, a, b in zip(POST_PRE_OUTS, got, ref)}
    ups = [torch.randn(o.shape, device=device, generator=g) for o in ref]
    ga = torch.autograd.grad(sum((o.float() * u).sum() for o, u in zip(got, ups)), list(bf.values()) + coeffs[0])
    gb = torch.autograd.grad(sum((o * u).sum() for o, u in zip(ref, ups)), list(ref_in.values()) + coeffs[1])
    errs |= {f"post_pre/d{k}": rel_err(a, b) for k, a, b in zip((*LEAVES, "H_post_in", "H_res_in"), ga, gb)}
    return errs


def parity(B, T, n, d, seed, dtype, device="cuda") -> tuple[float, str, bool, float | None]:
    """(worst relative error of the fused ops, its name, whether they pass, the reference's own error there in
    ``dtype``). They pass where every error is below PARITY_TOL, or, in bf16, no more than twice the error of the
    reference run in bf16 itself (``parity_errors(backend="torch")``): a gradient that bf16 cannot hold to the
    tolerance, whoever computes it. α's is one: 3 values, each a sum over every token and channel with much
    cancellation; at d = 2048 on the CPU (seed 3) the fused ops' is 3.5e-2 off and the bf16 reference's 7.5e-2."""
    tol = PARITY_TOL["bf16" if dtype == torch.bfloat16 else "fp32"]
    errs = parity_errors(B, T, n, d, seed, dtype, device)
    worst = max(errs, key=errs.get)
    if errs[worst] < tol or dtype == torch.float32:
        return errs[worst], worst, errs[worst] < tol, None
    own = parity_errors(B, T, n, d, seed, dtype, device, backend="torch")
    return errs[worst], worst, all(e < tol or e <= 2 * own[k] for k, e in errs.items()), own[worst]


def counts(N, n, d, elt=2) -> dict[str, tuple[float, float]]:
    """(minimal bytes, CUDA-core FLOPs) of pre, post, the sublayer forward and forward+backward.

    Bytes: streams and the sublayer output/input in elt bytes, coefficients fp32, each op's
    inputs read once and outputs written once (pre also writes z and r for its backward).
    FLOPs per token: RMSNorm 3nd; projection 2·nd·K; gates 2K + 3n; Sinkhorn ITERS·2 half-steps of
    SINKHORN_HALF_STEP·n² each (+ n² exp); h = H^pre X 2nd; X' = H^res X + H^postᵀ f 2n²d + 2nd.
    Backward: the sublayer's forward FLOPs again for the recomputed Sinkhorn and the projections
    φ dz and Σ xᵀ dz (2·2·nd·K), dH^pre 2nd, dX from h 2nd, the RMS term 4nd, H^resᵀ dX' 2n²d,
    dH^res 2n²d, dH^post and df 4nd, the Sinkhorn backward ITERS·2·4n².
    """
    nd, K = n * d, n * n + 2 * n
    coeff = (n * n + 2 * n) * 4
    sink = ITERS * 2 * SINKHORN_HALF_STEP * n * n + n * n
    pre_b = N * (nd * elt + d * elt + coeff + K * 4 + 4)
    pre_f = N * (3 * nd + 2 * nd * K + 2 * K + 3 * n + sink + 2 * nd)
    post_b = N * (nd * elt + d * elt + (n * n + n) * 4 + nd * elt)
    post_f = N * (2 * n * n * d + 2 * nd)
    bwd_b = N * (3 * nd * elt + 2 * d * elt + 2 * (n * n + n) * 4  # post: dX', X, f in; dX, df, dcoeffs out
                 + 2 * nd * elt + d * elt + coeff + K * 4 + 4)  # pre: X, dh, dcoeffs, z, r in; dX out
    bwd_f = N * (sink + 2 * 2 * nd * K + 2 * nd + 2 * nd + 4 * nd + 4 * n * n * d + 4 * nd + ITERS * 2 * 4 * n * n)
    fused_b = pre_b + post_b - N * nd * elt  # write + next read: X read once
    return {"pre": (pre_b, pre_f), "post": (post_b, post_f), "fwd": (pre_b + post_b, pre_f + post_f),
            "fwd+bwd": (pre_b + post_b + bwd_b, pre_f + post_f + bwd_f),
            "post+pre": (fused_b, pre_f + post_f), "post+pre fwd+bwd": (fused_b + bwd_b, pre_f + post_f + bwd_f)}


def timings(fns: dict, p: dict, up: list) -> dict[str, float]:
    """Median ms of pre, post, the sublayer forward (no_grad) and its forward+backward."""
    pre, full = fns["pre"], fns["sublayer"]
    leaves = [p[k] for k in ("x", "phi", "alpha", "b_pre", "b_post", "b_res", "out")]
    with torch.no_grad():
        _, _, h_post, h_res, _ = full(p)
        out = {"pre": bench_ms(lambda: pre(p)),
               "post": bench_ms(lambda: fns["post"](p, h_post, h_res)),
               "fwd": bench_ms(lambda: full(p))}

    def fwd_bwd():
        outs = full(p)
        return torch.autograd.grad(outs, leaves, grad_outputs=up)

    out["fwd+bwd"] = bench_ms(fwd_bwd)
    # the op the model runs per sublayer (residuals/mhc.py): write l + read l+1, coefficients from a read
    coeffs = [t.detach().requires_grad_() for t in (h_post, h_res)]
    with torch.no_grad():
        outs = fns["post_pre"](p, *coeffs)
        out["post+pre"] = bench_ms(lambda: fns["post_pre"](p, *coeffs))
    g = torch.Generator(device=outs[0].device).manual_seed(7)
    up_pp = [torch.randn(o.shape, device=o.device, generator=g).to(o.dtype) for o in outs]
    leaves_pp = leaves + coeffs

    def fwd_bwd_pp():
        return torch.autograd.grad(fns["post_pre"](p, *coeffs), leaves_pp, grad_outputs=up_pp)

    out["post+pre fwd+bwd"] = bench_ms(fwd_bwd_pp)
    return out


# the fused variants timed side by side (`--variants`): kernels.mhc.fused.NAMED_VARIANTS, the same table the tests run;
# block sizes are swept by `--sweep-blocks` (BLOCK_CANDIDATES).
def fused_variants() -> dict:
    from kernels.mhc import fused

    return fused.NAMED_VARIANTS


def interleaved_rounds(entries: list, rounds: int, time_one) -> tuple[dict, dict]:
    """Time every entry once per round, the entries interleaved (round 1: a, b, c; round 2: a, b, c; ...), so that a
    drift of the GPU's clocks or of the host over the run lands on every entry alike instead of on whichever came
    first. ``time_one(entry)`` returns {op: ms} or raises; an entry that raises is not timed again.
    Returns ({entry: {op: median ms}}, {entry: exception}) in entry order."""
    import statistics

    samples: dict = {e: {} for e in entries}
    errors: dict = {}
    for _ in range(rounds):
        for e in entries:
            if e in errors:
                continue
            try:
                res = time_one(e)
            except Exception as exc:  # noqa: BLE001 - reported in the entry's row by the caller
                errors[e] = exc
                continue
            for op, ms in res.items():
                samples[e].setdefault(op, []).append(ms)
    medians = {e: {op: (statistics.median(v), min(v), max(v)) for op, v in ops.items()}
               for e, ops in samples.items() if e not in errors}
    return medians, errors


def backends(fused_only=False, variants=None):
    from kernels.mhc import mhc_post, mhc_pre, reference

    def pre_of(backend):
        return lambda p: mhc_pre(p["x"], p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"],
                                 sinkhorn_iters=ITERS, backend=backend)

    def ref_pre(p):
        return reference.mhc_pre(p["x"], p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"],
                                 sinkhorn_iters=ITERS)

    fused_fns = {
        "pre": pre_of("triton"), "post": lambda p, hp, hr: mhc_post(p["x"], p["out"], hp, hr, backend="triton"),
        "sublayer": lambda p: sublayer("triton", p), "post_pre": lambda p, hp, hr: post_pre("triton", p, hp, hr)}
    for name in variants if variants is not None else fused_variants():
        yield ("triton" if name == "default" else f"triton ({name})"), fused_variants()[name], fused_fns
    if fused_only:
        return
    compiled_pre = torch.compile(ref_pre)
    compiled_post = torch.compile(reference.mhc_post)
    compiled_full = torch.compile(reference_sublayer)
    compiled_post_pre = torch.compile(reference_post_pre)
    yield "torch reference", None, {
        "pre": ref_pre, "post": lambda p, hp, hr: reference.mhc_post(p["x"], p["out"], hp, hr),
        "sublayer": reference_sublayer, "post_pre": reference_post_pre}
    yield "torch.compile(reference)", None, {
        "pre": compiled_pre, "post": lambda p, hp, hr: compiled_post(p["x"], p["out"], hp, hr),
        "sublayer": compiled_full, "post_pre": compiled_post_pre}


# --sweep-blocks: candidate (BLOCK_T, BLOCK_D, num_warps, num_stages[, maxnreg]) per kernel of fused.GPU_BLOCKS (pre
# kernels: BLOCK_T, BLOCK_D >= 16 for tl.dot); each is timed with the other kernels at their defaults
BLOCK_CANDIDATES = {  # chosen from sm_90 register counts (tests/kernels/mhc_compile.py): none spills at n=4
    "pre_fwd": [(32, 16, 4, 1), (32, 16, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2), (16, 64, 4, 2), (64, 16, 8, 1),
                (32, 64, 2, 2)],  # the last: GPU_BLOCKS["pre_fwd_w2"] (134 registers, no spills)
    "pre_fwd_tc": [(16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 4, 2), (64, 32, 4, 2),  # bf16 streams
                   (32, 64, 4, 3), (32, 64, 4, 4), (16, 64, 4, 3),  # more loads in flight (2026-12-06)
                   # 64 tokens compile to wgmma (HGMMA) instead of mma.sync; at two stages they race on the GPU
                   # (2026-12-06, mhc_read_check_read64_h100.md), at one they are right: (64, 64, 4, 1) the default since
                   (64, 64, 4, 1), (64, 32, 4, 1),
                   # untimed: two warp groups a program (right at two stages on the H100, same check; 70 registers), 128
                   # channels (168 registers); sm_90a, n = 4, d = 1024, no spills
                   (64, 64, 8, 1), (64, 128, 4, 1)],
    "pre_bwd": [(32, 16, 8, 1), (16, 16, 8, 1), (16, 32, 4, 1), (32, 32, 4, 1), (32, 64, 8, 1), (64, 32, 8, 1)],
    "pre_dx": [(16, 32, 4, 1), (32, 32, 4, 2), (32, 32, 8, 1), (64, 32, 8, 1), (32, 16, 4, 1), (64, 16, 4, 1),
               (32, 32, 4, 3), (16, 32, 4, 2)],  # more loads in flight (2026-12-06)
    "post_fwd": [(8, 64, 4, 2), (16, 32, 4, 2), (16, 64, 8, 2), (16, 128, 8, 2), (32, 64, 8, 2), (8, 128, 4, 3)],
    "post_bwd": [(4, 64, 4, 2), (8, 32, 4, 2), (8, 64, 4, 2), (16, 32, 4, 2), (16, 32, 8, 2), (8, 32, 8, 3)],
    # the write's backward on tensor cores (POST_BWD_PROJ="bf16x3", bf16 streams); R = BLOCK_T·n stream rows
    "post_bwd_tc": [(16, 64, 4, 2), (16, 32, 4, 2), (16, 128, 4, 2), (16, 64, 8, 2), (16, 64, 4, 3), (32, 64, 8, 2),
                    (32, 32, 8, 2),
                    # one stage, as the read's forward gained from (2026-12-06 late); sm_90a at n = 4, d = 1024 with
                    # dX stored: 150 and 230 registers, no spills (32 tokens at 4 warps spill 712 bytes)
                    (16, 64, 4, 1), (32, 64, 8, 1)],
    # the read's dX on the stream rows (DX_LAYOUT="rows", the default; R = BLOCK_T·n rows); sm_90a at n = 4, d = 1024
    # with the write's dX': (16, 64, 4, 1) 154 registers, (32, 64, 8, 1) 196, (16, 32, 4, 1) 94, no spills (32 tokens at
    # 4 warps spill 40-232 bytes)
    "pre_dx_rows": [(16, 64, 4, 2), (16, 64, 4, 1), (32, 64, 8, 1), (16, 32, 4, 1), (16, 32, 4, 2), (16, 64, 8, 2)],
    # φ's gradient: (tokens a step, rows of n·d a program, warps, stages); fewer reloads of w with more rows, more
    # tokens a step; sm_90a at n = 4, d = 512 and 1024: 48-114 registers, no spills (2026-12-06, end); (64, 128, 8, 3)
    # won at `medium` and is the default since 2026-12-06 evening, (32, 64, 4, 3) the blocks before
    "phi_grad": [(32, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (32, 128, 4, 3), (64, 128, 8, 3), (32, 256, 8, 3),
                 (128, 64, 4, 3), (128, 128, 8, 3)],
}
SWEEP_OP = {"pre_fwd": "post+pre", "pre_fwd_tc": "post+pre", "post_fwd": "post", "pre_bwd": "post+pre fwd+bwd", "pre_dx": "post+pre fwd+bwd",
            "post_bwd": "post+pre fwd+bwd", "post_bwd_tc": "post+pre fwd+bwd", "pre_dx_rows": "post+pre fwd+bwd",
            "phi_grad": "post+pre fwd+bwd"}

# module settings a kernel's sweep holds: the blocks it varies belong to that layout, which the defaults may not pick
SWEEP_HOLDS = {"pre_fwd_tc": {"READ_LAYOUT": "fused"}, "phi_grad": {"PHI_GRAD_BLOCKS": "phi_grad"}}


# the results a sweep compares, in the order of ``results() + [post_out]`` below: the write + read's outputs, the
# gradients of its leaves, then the write alone
SWEEP_RESULTS = ("X'", "h", "H^pre", "H^post", "H^res", "dX", "dφ", "dα", "db_pre", "db_post", "db_res", "df",
                 "dH^post_in", "dH^res_in", "write alone")


# the largest relative L2 difference from the default blocks' results a candidate may have (a right candidate differs
# by the order of its fp32 sums: up to 2e-5 in the sweeps of 2026-12-06; 1e-2 let a racing one pass)
SWEEP_TOL = 1e-3


def sweep_blocks(shapes, n, seed, dtype, dtype_name, kernels=tuple(BLOCK_CANDIDATES), tag: str = "") -> None:
    """Time each candidate block configuration of each fused kernel on the op that runs it; check that
    its outputs and gradients match the default configuration's; print the fastest as a GPU_BLOCKS dict."""
    from kernels.mhc import fused, mhc_post

    table = Table(title="mHC fused kernels: block sizes (BLOCK_T, BLOCK_D, warps, stages)",
                  columns=["shape", "kernel", "blocks", "op timed", "ms", "vs default", "check"],
                  notes=[f"n={n}, {dtype_name} streams, projections {fused.DOT_PRECISION}; timer {roofline.TIMER} "
                         "(benchmarks.roofline.TIMER); other kernels at their "
                         "defaults; check: outputs and gradients vs the default blocks (rel L2 < "
                         f"{SWEEP_TOL:g}) and two launches the same bits, with the result furthest from them"])
    defaults = dict(fused.GPU_BLOCKS)
    fns = {"post": lambda p, hp, hr: mhc_post(p["x"], p["out"], hp, hr, backend="triton"),
           "post_pre": lambda p, hp, hr: post_pre("triton", p, hp, hr)}
    for name in shapes:
        B, T, d = SHAPES[name]
        p = {k: v.requires_grad_() for k, v in make_inputs(B, T, n, d, seed, dtype=dtype).items()}
        with torch.no_grad():
            h_post, h_res = sublayer("triton", p)[2:4]  # coefficients of a read, as the write gets them
        coeffs = [t.detach().requires_grad_() for t in (h_post, h_res)]
        leaves = [p[k] for k in ("x", "phi", "alpha", "b_pre", "b_post", "b_res", "out")] + coeffs
        outs = fns["post_pre"](p, *coeffs)
        g = torch.Generator(device="cuda").manual_seed(seed + 3)
        ups = [torch.randn(o.shape, device="cuda", generator=g).to(o.dtype) for o in outs]

        def results():
            outs = fns["post_pre"](p, *coeffs)
            return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grad_outputs=ups))

        def time_op(op):
            if op == "post":
                return bench_ms(lambda: fns["post"](p, *coeffs))
            if op == "post+pre":
                with torch.no_grad():
                    return bench_ms(lambda: fns["post_pre"](p, *coeffs))
            return bench_ms(lambda: torch.autograd.grad(fns["post_pre"](p, *coeffs), leaves, grad_outputs=ups))

        with torch.no_grad():
            post_out = fns["post"](p, *coeffs)
        expected = results() + [post_out]
        assert len(expected) == len(SWEEP_RESULTS), (len(expected), SWEEP_RESULTS)
        best = {}
        for kernel in kernels:
            candidates, op = BLOCK_CANDIDATES[kernel], SWEEP_OP[kernel]
            with held((fused, k, v) for k, v in SWEEP_HOLDS.get(kernel, {}).items()):
                base = time_op(op)
                for cand in dict.fromkeys([defaults[kernel], *candidates]):
                    fused.GPU_BLOCKS[kernel] = cand
                    try:
                        with torch.no_grad():
                            post_out = fns["post"](p, *coeffs)
                        got = results() + [post_out]
                        again = results()  # a race shows as two launches that differ
                        same = all(torch.equal(a, b) for a, b in zip(got, again))
                        errs = [rel_err(a, b) for a, b in zip(got, expected)]
                        err = max(errs)
                        worst = SWEEP_RESULTS[errs.index(err)]
                        ms = time_op(op)
                    except Exception as e:  # a configuration that does not compile or run is reported
                        table.add(name, kernel, str(cand), op, "", "", f"error: {type(e).__name__}")
                        continue
                    finally:
                        fused.GPU_BLOCKS[kernel] = defaults[kernel]
                    ok = err < SWEEP_TOL and same
                    table.add(name, kernel, str(cand), op, f"{ms:.3f}", f"{ms / base:.2f}",
                              f"{err:.1e} {'ok' if ok else 'FAIL'}" + (f" (worst: {worst})" if err > 0 else "")
                              + ("" if same else ", two launches differ"))
                    print(" | ".join(table.rows[-1]), flush=True)
                    if ok and (kernel not in best or ms < best[kernel][1]):
                        best[kernel] = (cand, ms)
        table.notes.append(f"{name}: fastest GPU_BLOCKS = " + repr({k: v[0] for k, v in best.items()}))
        del p, coeffs, leaves, outs, ups, expected
        torch.cuda.empty_cache()
    table.write(("ops_mhc_blocks" if dtype_name == "bf16" else f"ops_mhc_blocks_{dtype_name}") + tag)


def variant_row(name: str) -> str:
    """A fused variant's module settings as a benchmarks.throughput row suffix: py:kernels.mhc.fused.NAME=VALUE@..."""
    return "@".join(f"py:kernels.mhc.fused.{k}={v}" for k, v in fused_variants()[name].items())


def pick_variant(table: str, op: str, gain: float) -> str | None:
    """The fused variant of a results table (``main``'s markdown) whose median ``op`` time is at least ``gain`` (a
    fraction) below the default's ("triton") at the same shape, the one with the largest gain over the shapes; None
    when none is. Rows of variants that errored or failed their parity do not count."""
    times = {}
    for row in read_rows(table):
        # "2.9e-03 ok", or since 2026-12-07 "2.9e-03 ok (worst tensor...)"
        if row["op"] != op or row["parity (vs fp32 ref)"].split()[1:2] != ["ok"]:
            continue
        name = "default" if row["backend"] == "triton" else row["backend"].removeprefix("triton (").removesuffix(")")
        try:
            times[(row["shape"], name)] = float(row["ms"].split()[0])
        except ValueError:  # an error row
            continue
    best, best_gain = None, gain
    for (shape, name), ms in times.items():
        base = times.get((shape, "default"))
        if name == "default" or not base:
            continue
        if 1 - ms / base >= best_gain:
            best, best_gain = name, 1 - ms / base
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--n", type=int, default=4, help="streams (paper: 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                    help="streams and sublayer output (fp32: what bf16-autocast training keeps, as vanilla's stream)")
    ap.add_argument("--sweep-blocks", action="store_true",
                    help="instead: time the candidate block sizes of each fused kernel (BLOCK_CANDIDATES)")
    ap.add_argument("--fused-only", action="store_true", help="time only the fused variants (no reference)")
    ap.add_argument("--kernels", nargs="+", default=list(BLOCK_CANDIDATES), choices=list(BLOCK_CANDIDATES),
                    help="with --sweep-blocks: only these kernels")
    ap.add_argument("--variants", nargs="+", default=["default", "one_pass"], choices=list(fused_variants()),
                    help="fused variants to time (kernels.mhc.fused.NAMED_VARIANTS: its module settings)")
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    roofline.add_timer_option(ap)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every backend this many times, interleaved round by round; the table gives the median "
                         "and, with more than one round, the range")
    ap.add_argument("--pick", metavar="TABLE", help="instead: read a table this script wrote and print the fused "
                    "variant whose --op time is --gain or more below the default's at some shape (the largest gain), "
                    "or nothing; runs without a GPU")
    ap.add_argument("--op", default="post+pre fwd+bwd", help="with --pick: the op compared")
    ap.add_argument("--gain", type=float, default=0.03, help="with --pick: the least fraction of the default's time")
    ap.add_argument("--row", action="store_true", help="with --pick: print the variant's module settings as a "
                    "benchmarks.throughput row suffix (py:kernels.mhc.fused.NAME=VALUE@...)")
    ap.add_argument("--row-of", metavar="VARIANT", choices=list(fused_variants()),
                    help="instead: print that variant's row suffix for benchmarks.throughput; runs without a GPU")
    args = ap.parse_args(argv)
    if args.row_of:
        print(variant_row(args.row_of))
        return
    if args.pick:
        best = pick_variant(Path(args.pick).read_text(), args.op, args.gain)
        if best and args.row:  # as a row's code settings for benchmarks.throughput
            print(variant_row(best))
        elif best:
            print(best)
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.ops_mhc needs a CUDA GPU (the CPU interpreter cannot time kernels)")
    with held([(roofline, "TIMER", args.timer)]):
        return _timed(args)


def _timed(args) -> None:
    """main's timing (the op table, or the block sweep), under its --timer."""
    from kernels.mhc import fused

    dtype = DTYPES[args.dtype]
    if args.sweep_blocks:
        return sweep_blocks(args.shapes, args.n, args.seed, dtype, args.dtype, args.kernels, args.tag)
    ceil = Ceilings.measure()
    print(ceil.describe(), flush=True)
    table = Table(
        title="mHC read / write: fused Triton vs PyTorch reference",
        columns=["shape", "B×T", "d", "n", "parity (vs fp32 ref)", "backend", "op", "ms", "min MB", "GFLOP",
                 "roofline ms", "binds", "% of roofline"],
        notes=[ceil.describe(),
               f"n streams, {ITERS} Sinkhorn iterations, {args.dtype} streams and sublayer output, fp32 φ, α, b; "
               "fwd ops under no_grad; fwd+bwd = one sublayer's pre + post and the gradients of X, f, φ, α, b",
               "min MB: each op's inputs read once and outputs written once; GFLOP: CUDA-core FLOPs "
               "(see `counts` in benchmarks/ops_mhc.py); roofline = max(bytes / copy, FLOPs / fp32 rate)",
               f"parity: worst L2 relative error over outputs and gradients (which, in brackets); FAIL above "
               f"{PARITY_TOL[args.dtype]} unless, in bf16, within twice the reference's own error in bf16 there "
               "(given in brackets: a gradient bf16 cannot hold, e.g. α's)",
               f"ms: median of {max(1, args.rounds)} round(s), every backend once a round, interleaved"
               + (" (range in brackets)" if args.rounds > 1 else "")
               + ("; each a CUDA graph's replays (no launch gaps, no L2 flush)" if args.timer == "graphs" else
                  "; CUDA events around each call (launch gaps count)")])
    failed = []
    for name in args.shapes:
        B, T, d = SHAPES[name]
        n, N = args.n, B * T
        p = {k: v.requires_grad_() for k, v in make_inputs(B, T, n, d, args.seed, dtype=dtype).items()}
        g = torch.Generator(device="cuda").manual_seed(args.seed + 2)
        up = [torch.randn(s, device="cuda", generator=g).to(dt) for s, dt in
              (((B, T, d), dtype), ((B, T, n), torch.float32), ((B, T, n), torch.float32),
               ((B, T, n, n), torch.float32), ((B, T, n, d), dtype))]
        cnt = counts(N, n, d, elt=dtype.itemsize)
        entries, checks, fns_of = [], {}, {}
        for label, settings, fns in backends(args.fused_only, list(dict.fromkeys(args.variants))):  # --rounds repeats
            checks[label], fns_of[label] = "reference", (settings, fns)
            if settings is not None:  # a fused variant: its parity first (all of them before any timing)
                try:
                    with held((fused, k, v) for k, v in settings.items()):
                        err, worst, ok, own = parity(B, T, n, d, args.seed, dtype)
                except Exception as e:  # a variant that fails is reported in the table, not skipped silently
                    print(f"{name} {label}: {type(e).__name__}: {e}", flush=True)
                    failed.append(f"{name} {label}: {type(e).__name__}")
                    table.add(name, f"{B}×{T}", d, n, "error", label, "all", f"error: {type(e).__name__}",
                              "", "", "", "", "")
                    continue
                checks[label] = (f"{err:.1e} {'ok' if ok else 'FAIL'} ({worst}"
                                 + (f"; reference in {args.dtype}: {own:.1e})" if own is not None else ")"))
                print(f"{name} {label}: parity {checks[label]}", flush=True)
                if not ok:
                    failed.append(f"{name} {label}")
            entries.append(label)

        def time_one(label):
            settings, fns = fns_of[label]
            with held((fused, k, v) for k, v in (settings or {}).items()):
                return timings(fns, p, up)

        medians, errors = interleaved_rounds(entries, max(1, args.rounds), time_one)
        for label in entries:
            check = checks[label]
            if label in errors:  # the fused ops must run; a torch.compile failure is only reported
                e = errors[label]
                print(f"{name} {label}: {type(e).__name__}: {e}", flush=True)
                if fns_of[label][0] is not None:
                    failed.append(f"{name} {label}: {type(e).__name__}")
                table.add(name, f"{B}×{T}", d, n, check, label, "all", f"error: {type(e).__name__}",
                          "", "", "", "", "")
                continue
            for op, (ms, lo, hi) in medians[label].items():
                n_bytes, flops = cnt[op]
                floor = ceil.floor_ms(n_bytes, flops)
                shown = f"{ms:.3f}" + (f" ({lo:.3f}–{hi:.3f})" if args.rounds > 1 else "")
                table.add(name, f"{B}×{T}", d, n, check, label, op, shown, f"{n_bytes / 1e6:.0f}",
                          f"{flops / 1e9:.2f}", f"{floor:.3f}", ceil.binding(n_bytes, flops), f"{100 * floor / ms:.0f}%")
                print(" | ".join(table.rows[-1]), flush=True)
        del p, up
        torch.cuda.empty_cache()
        if name != args.shapes[-1]:  # what is timed so far survives a step killed by its time limit
            table.write(("ops_mhc" if args.dtype == "bf16" else f"ops_mhc_{args.dtype}") + args.tag)
    table.write(("ops_mhc" if args.dtype == "bf16" else f"ops_mhc_{args.dtype}") + args.tag)
    if failed:
        raise SystemExit(f"parity check failed or a fused variant errored: {failed}; see the table")


if __name__ == "__main__":
    main()
