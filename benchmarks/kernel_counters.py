"""A few launches of the residuals' fused kernels at `small`, for a hardware-counter profiler (CUDA).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        -k regex:'^_pre_' -c 4 python -m benchmarks.kernel_counters --ops mhc

Runs ITERS forward+backward passes of each op in ``--ops`` and exits: no timing loop, so a profiler that
replays every launch it captures finishes in seconds. ``mhc``: one sublayer's fused read and write
(``kernels.mhc``: mhc_pre, mhc_post) on bf16 streams, n = 4. ``msar``: the fused MSAR read
(``kernels.msar_attn.msar``) over S = 5 bf16 sources with kernels (4, 8, 12) and the mixer. ``attnres``: one
block of Block AttnRes (phase 1 over 5 summaries, 3 merges). Shapes as in ``benchmarks.ops_mhc``,
``benchmarks.msar_attn`` and ``benchmarks.ops_attnres`` (B = 16, T = 1024, d = 512), inputs from their
``make_inputs``; every gradient is taken with a random upstream gradient.
"""

from __future__ import annotations

import argparse

import torch

OPS = ("mhc", "msar", "attnres")
B, T, D = 16, 1024, 512


def run_mhc(iters: int) -> None:
    from benchmarks import ops_mhc

    p = ops_mhc.make_inputs(B, T, 4, D, seed=0)
    leaves = [p["x"], p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"], p["out"]]
    for t in leaves:
        t.requires_grad_()
    for _ in range(iters):
        h, *_, new = ops_mhc.sublayer("triton", p)
        torch.autograd.grad((h.float() * torch.randn_like(h, dtype=torch.float32)).sum()
                            + (new.float() * torch.randn_like(new, dtype=torch.float32)).sum(), leaves)


def run_msar(iters: int) -> None:
    from benchmarks import msar_attn
    from kernels.msar_attn import msar

    x, taps, q, g, phi, alpha, bias, doc = msar_attn.make_inputs(5, B, T, D, seed=0)
    leaves = [x, *taps, q, g, phi, alpha, bias]
    for t in leaves:
        t.requires_grad_()
    for _ in range(iters):
        h = msar(x, taps, q, g, doc, phi, alpha, bias, backend="triton")
        torch.autograd.grad(h, leaves, grad_outputs=torch.randn_like(h))


def run_attnres(iters: int) -> None:
    from benchmarks import ops_attnres

    sources, partials, queries, gains = ops_attnres.make_inputs(5, 4, B, T, D)
    leaves = ops_attnres.leaves_of(sources, partials, queries, gains)
    for _ in range(iters):
        hs = ops_attnres.run_fused(sources, partials, queries, gains)
        torch.autograd.grad(hs, leaves, grad_outputs=[torch.randn_like(h) for h in hs])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_counters needs a CUDA GPU")
    for op in args.ops:
        {"mhc": run_mhc, "msar": run_msar, "attnres": run_attnres}[op](args.iters)
        torch.cuda.synchronize()
        print(f"{op}: {args.iters} forward+backward passes", flush=True)


if __name__ == "__main__":
    main()
