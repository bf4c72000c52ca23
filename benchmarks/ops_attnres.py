"""Block AttnRes and AttnRes depth attention: fused two-phase op vs reference vs public kernels (CUDA).

    python -m benchmarks.ops_attnres [--shapes small medium d2048] [--ops block full] [--impls ...]
    python -m benchmarks.ops_attnres --quick --shapes small medium   # no torch.compile: ~1 min
    python -m benchmarks.ops_attnres --timer graphs ...   # replays of a CUDA graph: no host launch gaps

Writes benchmarks/results/ops_attnres_<gpu>_<shapes>[_quick].md and prints each row as soon as it
is measured. The fused kernels have fixed tiles (no autotuning: the first call per shape only
compiles them, seconds); ``torch.compile(reference)`` takes about a minute per shape, so ``--quick``
(fused, reference, fast-attnres and fla) leaves it out.

One process measures everything (timings on a shared host swing 13-17% between invocations):

- parity first: the fused op in bf16 against the fp32 reference on the same bf16-rounded inputs
  (every output and every gradient: sources, partials, queries, key gains), relative error in norm;
  the run fails if any exceeds 1e-2;
- per shape and op, the median time (``triton.testing.do_bench``; with ``--timer graphs``
  ``do_bench_cudagraph``: replays of a CUDA graph of the calls, as a graphed training step runs them, without
  the gaps while the host launches a call's kernels, table named ``..._graphs.md``) of the forward (under no_grad) and
  of forward+backward (gradients of every input, random upstream gradients) of:
  ``fused`` (kernels/depth_attn, two-phase, the sources stored in its buffer as the residual stores them), ``reference`` (the residual's torch path: stack the
  sources at every read), ``torch.compile(reference)``, and as benchmark-only anchors, when
  importable, ``fast-attnres`` (``attnres.attnres``, one call per consumer over its source list,
  key RMSNorm without gain: the gain is folded into its bf16 query) and flash-linear-attention's
  ``fla.ops.attnres.fused_attnres`` (one call per consumer, key RMSNorm with gain);
- the minimal bytes and CUDA-core FLOPs of the op, its roofline time
  max(bytes / copy bandwidth, FLOPs / fp32 rate) with both ceilings measured in this run, and the
  fraction of it each implementation achieves;
- for ``block``, a breakdown of the fused op: each Triton kernel launched alone (phase-1 forward
  and backward, one merge forward and backward) and the sum of the kernels one block launches, so
  the gap between that sum and the op's time is the host side (autograd, launches, small torch ops).

The ops, per token, bf16 (e = 2 bytes), B·T tokens of width d:

- ``block``: one block of Block AttnRes, n = 5 completed summaries [b_0..b_4] and S = 4 consumers;
  consumer 0 attends the summaries, consumer i >= 1 also its partial b^{i-1} (3 partials).
- ``full``: one Transformer block of full AttnRes at depth 16: consumer 0 attends v_0..v_16
  (17 sources), consumer 1 also v_17.

Minimal bytes: forward reads every source and partial once and writes the C outputs; backward reads
the sources, the partials and the C upstream gradients and writes their gradients. FLOPs: the sum of
squares once per distinct tensor (2d), per (consumer, source) the logit (2d) and the weighted sum
(2d); backward counted as twice the forward.
"""

from __future__ import annotations

import argparse
import traceback

import torch

from benchmarks import roofline
from benchmarks.roofline import Ceilings, Table, bench_ms, held

# name -> (B, T, d)
SHAPES = {"small": (16, 1024, 512), "medium": (16, 2048, 1024), "d2048": (16, 2048, 2048)}
# name -> (n completed sources, consumers C); consumers 1..C-1 each merge one more source
OPS = {"block": (5, 4), "full": (17, 2)}
IMPLS = ("fused", "reference", "torch.compile(reference)", "fast-attnres", "fla fused_attnres")
QUICK_IMPLS = ("fused", "reference", "fast-attnres", "fla fused_attnres")


def make_inputs(n, C, B, T, d, *, dtype=torch.bfloat16, seed=0, device="cuda"):
    """Leaves: sources (n tensors (B, T, d)), partials (C-1), queries (C, d) and key gains (C, d) (fp32
    parameters)."""
    g = torch.Generator(device=device).manual_seed(seed)
    base = (torch.randn(n, B, T, d, device=device, generator=g) * 2
            + torch.randn(n, 1, 1, d, device=device, generator=g))
    sources = [base[s].to(dtype).requires_grad_() for s in range(n)]
    partials = [(1.5 * torch.randn(B, T, d, device=device, generator=g)).to(dtype).requires_grad_()
                for _ in range(C - 1)]
    queries = (0.5 * torch.randn(C, d, device=device, generator=g)).requires_grad_()
    gains = (1 + 0.3 * torch.randn(C, d, device=device, generator=g)).requires_grad_()
    return sources, partials, queries, gains


def leaves_of(sources, partials, queries, gains):
    return [*sources, *partials, queries, gains]


# --- the implementations: each returns the C outputs h_c (B, T, d) ------------------------------------
def run_fused(sources, partials, queries, gains):
    """As the residual runs it: each source stored once in a SourceBuffer (a copy, timed with the op; its
    gradient comes back through the buffer's row gradients), then phase 1 over the buffer and the merges."""
    from kernels.depth_attn import SourceBuffer, depth_attn_merge, depth_attn_summaries

    buffer = SourceBuffer(len(sources), sources[0])
    for s in sources:
        buffer.append(s)
    outs, lses = depth_attn_summaries(buffer, queries, gains, backend="triton")
    return [outs[0]] + [depth_attn_merge(outs[c], lses[c], p, queries[c], gains[c], backend="triton")[0]
                        for c, p in enumerate(partials, start=1)]


def reference_block(sources, partials, queries, gains):
    """The residual's torch path: every read stacks its sources and runs the reference."""
    from kernels.depth_attn import reference

    hs = []
    for c in range(queries.shape[0]):
        srcs = list(sources) + ([partials[c - 1]] if c else [])
        hs.append(reference.depth_attn(torch.stack(srcs), queries[c:c + 1], gains[c:c + 1])[0])
    return hs


def run_reference(sources, partials, queries, gains):
    return reference_block(sources, partials, queries, gains)


_COMPILED = {}


def run_compiled(sources, partials, queries, gains):
    fn = _COMPILED.setdefault("block", torch.compile(reference_block))
    return fn(sources, partials, queries, gains)


def run_fast_attnres(sources, partials, queries, gains):
    from attnres import attnres  # fast-attnres: key RMSNorm without gain, bf16 query

    qg = (queries * gains).to(torch.bfloat16)  # q·(g ⊙ n) = (q ⊙ g)·n
    return [attnres(list(sources) + ([partials[c - 1]] if c else []), qg[c]) for c in range(queries.shape[0])]


def run_fla(sources, partials, queries, gains):
    from fla.ops.attnres import fused_attnres

    return [fused_attnres(queries[c].to(torch.bfloat16), list(sources) + ([partials[c - 1]] if c else []),
                          gains[c].to(torch.bfloat16)) for c in range(queries.shape[0])]


RUNNERS = {"fused": run_fused, "reference": run_reference, "torch.compile(reference)": run_compiled,
           "fast-attnres": run_fast_attnres, "fla fused_attnres": run_fla}
IMPORTS = {"fast-attnres": "attnres", "fla fused_attnres": "fla.ops.attnres"}


def importable(impl: str) -> str | None:
    """None if the implementation can be imported, else why not."""
    if impl not in IMPORTS:
        return None
    try:
        __import__(IMPORTS[impl])
        return None
    except Exception as exc:  # a benchmark-only wheel: report, never fall back
        return f"not installed ({type(exc).__name__}: {exc})"[:120]


# --- accounting ------------------------------------------------------------------------------------------
def minimal_bytes(n, C, tokens, d, e=2) -> tuple[float, float]:
    """(forward, forward+backward) bytes if every tensor crossed HBM once."""
    p = C - 1
    fwd = (n + p + C) * tokens * d * e
    bwd = (n + p + C + n + p) * tokens * d * e
    return fwd, fwd + bwd


def flops(n, C, tokens, d) -> tuple[float, float]:
    p = C - 1
    pairs = C * n + p  # (consumer, source) pairs
    fwd = tokens * (2 * d * (n + p) + 4 * d * pairs)
    return fwd, 3 * fwd


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def parity(n, C, B, T, d, seed=0, *, dtype=torch.bfloat16, device="cuda") -> float:
    """Worst relative error of the fused op (bf16 by default; outputs and every gradient) vs the fp32 reference."""
    sources, partials, queries, gains = make_inputs(n, C, B, T, d, seed=seed, dtype=dtype, device=device)
    leaves = leaves_of(sources, partials, queries, gains)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_src, ref_p, ref_q, ref_g = ref_leaves[:n], ref_leaves[n:n + C - 1], ref_leaves[-2], ref_leaves[-1]
    out = run_fused(sources, partials, queries, gains)
    ref = reference_block(ref_src, ref_p, ref_q, ref_g)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ups = [torch.randn(h.shape, device=device, generator=g) for h in ref]
    errs = [rel_err(a, b) for a, b in zip(out, ref)]
    grads = torch.autograd.grad(sum((h.float() * u).sum() for h, u in zip(out, ups)), leaves)
    ref_grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(ref, ups)), ref_leaves)
    errs += [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    return max(errs)


def measure(impl, n, C, B, T, d) -> tuple[float, float]:
    sources, partials, queries, gains = make_inputs(n, C, B, T, d)
    leaves = leaves_of(sources, partials, queries, gains)
    run = RUNNERS[impl]
    ups = [torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16) for _ in range(C)]

    def fwd():
        with torch.no_grad():
            return run(sources, partials, queries, gains)

    def fwd_bwd():
        hs = run(sources, partials, queries, gains)
        return torch.autograd.grad(hs, leaves, grad_outputs=[u.to(h.dtype) for h, u in zip(hs, ups)],
                                   allow_unused=True)

    return bench_ms(fwd), bench_ms(fwd_bwd)


def kernel_breakdown(n, C, B, T, d) -> list[tuple[str, float]]:
    """Milliseconds of each fused kernel launched alone (no autograd), and the sum one block launches:
    phase 1 forward and backward once, merge forward and backward C-1 times."""
    from kernels.depth_attn import fused

    sources, partials, queries, gains = make_inputs(n, C, B, T, d)
    src, qg = torch.stack(sources).detach(), (queries * gains).detach().float().contiguous()
    # as training runs it: the forward keeps its logits and r_s where the split backward takes them
    keep = fused.scores_from_logits(n, d, C)
    out, lse, logits, rstd = fused.summaries_fwd(src, n, qg, key_norm=True, eps=1e-6, store_logits=keep,
                                                 store_rstd=keep)
    douts = tuple(torch.randn_like(out[c]) for c in range(C))
    dlse = torch.randn_like(lse)
    p, o, lse1, q1 = partials[0].detach(), out[1], lse[1].contiguous(), qg[1].contiguous()
    h, w = fused.merge_fwd(o, lse1, p, q1, key_norm=True, eps=1e-6)
    dh = torch.randn_like(h)
    grads = torch.randn(src.shape, device=src.device)  # a buffer's RowGradients (fp32), every row reached before
    times = [
        ("phase 1 forward", bench_ms(lambda: fused.summaries_fwd(src, n, qg, key_norm=True, eps=1e-6,
                                                                 store_logits=keep, store_rstd=keep))),
        ("phase 1 backward", bench_ms(lambda: fused.summaries_bwd(src, n, qg, lse, douts, dlse, key_norm=True,
                                                                  eps=1e-6, logits=logits, rstd=rstd))),
        # as the residuals run it: every call but the last reads back what the later calls' backward left
        ("phase 1 backward, adding into the rows' gradients", bench_ms(lambda: fused.summaries_bwd(
            src, n, qg, lse, douts, dlse, key_norm=True, eps=1e-6, dsrc=grads, n_add=n, logits=logits, rstd=rstd))),
        ("merge forward (one consumer)", bench_ms(lambda: fused.merge_fwd(o, lse1, p, q1, key_norm=True, eps=1e-6))),
        ("merge backward (one consumer)", bench_ms(lambda: fused.merge_bwd(h, p, q1, w, dh, o_dtype=o.dtype,
                                                                           key_norm=True, eps=1e-6))),
    ]
    t = dict(times)
    times.append(("kernels of one block, fwd", t["phase 1 forward"] + (C - 1) * t["merge forward (one consumer)"]))
    times.append(("kernels of one block, fwd+bwd", times[-1][1] + t["phase 1 backward"]
                  + (C - 1) * t["merge backward (one consumer)"]))
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--impls", nargs="+", default=None, choices=list(IMPLS),
                   help="default: all (with --quick: fused, reference, fast-attnres, fla)")
    p.add_argument("--quick", action="store_true",
                   help="fused + reference + fast-attnres + fla at the given shapes (no torch.compile)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel times of the fused op")
    roofline.add_timer_option(p)
    args = p.parse_args(argv)
    if args.impls is None:
        args.impls = list(QUICK_IMPLS if args.quick else IMPLS)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.ops_attnres needs a CUDA GPU (the CPU interpreter cannot time kernels)")
    with held([(roofline, "TIMER", args.timer)]):
        _timed(args)


def _timed(args) -> None:
    """main's table, timed under its --timer."""
    ceilings = Ceilings.measure()
    print(ceilings.describe(), flush=True)
    table = Table(
        "Block AttnRes / AttnRes depth attention: fused two-phase op vs reference and public kernels",
        ["shape", "op", "B×T, d", "parity (bf16 vs fp32 ref)", "impl", "fwd ms", "fwd+bwd ms",
         "floor fwd / fwd+bwd ms (binding)", "% of floor fwd", "% of floor fwd+bwd",
         "fused speedup fwd / fwd+bwd"],
        notes=[ceilings.describe(),
               "ops: block = n=5 summaries, S=4 consumers (3 merge a partial); full = 17 sources, 2 consumers "
               "(the second merges 1 more); bf16 sources and partials, fp32 queries and key gains",
               "minimal bytes: fwd reads sources + partials, writes C outputs; bwd reads sources, partials, "
               "C upstream gradients, writes their gradients. FLOPs: 2d per tensor (sum of squares), 4d per "
               "(consumer, source) pair; fwd+bwd = 3× fwd",
               "fast-attnres: one call per consumer over its source list, gain folded into its bf16 query, "
               "eps 2^-23; fla: fla.ops.attnres.fused_attnres, one call per consumer",
               "timer: " + ("replays of a CUDA graph of the calls (no launch gaps, no L2 flush; --timer graphs)"
                            if args.timer == "graphs" else "CUDA events around each call (launch gaps count)")])
    failed = []
    gpu = "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name().lower())
    name = (f"ops_attnres_{gpu}_{'_'.join(args.shapes)}{'_quick' if args.quick else ''}"
            f"{'_graphs' if args.timer == 'graphs' else ''}")

    def row_done():  # printed, and saved as a partial table: a run stopped by its time limit keeps its rows
        print(" | ".join(table.rows[-1]), flush=True)
        table.write(name, partial=f"{len(table.rows)} rows")

    for shape in args.shapes:
        B, T, d = SHAPES[shape]
        for op in args.ops:
            n, C = OPS[op]
            err = parity(n, C, B, T, d)
            print(f"{shape}/{op}: parity {err:.1e}", flush=True)
            ok = err < 1e-2
            if not ok:
                failed.append(f"{shape}/{op}: {err:.2e}")
            fb, fbb = minimal_bytes(n, C, B * T, d)
            ff, ffb = flops(n, C, B * T, d)
            floor_f, floor_fb = ceilings.floor_ms(fb, ff), ceilings.floor_ms(fbb, ffb)
            binding = f"{ceilings.binding(fb, ff)} / {ceilings.binding(fbb, ffb)}"
            times = {}
            for impl in args.impls:
                why = importable(impl)
                if why is None:
                    try:
                        times[impl] = measure(impl, n, C, B, T, d)
                    except Exception as exc:  # reported in the table, never replaced by another impl
                        traceback.print_exc()
                        why = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                if why is not None:
                    table.add(shape, op, f"{B}×{T}, {d}", f"{err:.1e} {'ok' if ok else 'FAIL'}", impl, why,
                              "", "", "", "", "")
                    row_done()
                    continue
                tf, tfb = times[impl]
                speed = ""
                if impl != "fused" and "fused" in times:
                    speed = f"{tf / times['fused'][0]:.2f}× / {tfb / times['fused'][1]:.2f}×"
                table.add(shape, op, f"{B}×{T}, {d}", f"{err:.1e} {'ok' if ok else 'FAIL'}", impl,
                          f"{tf:.3f}", f"{tfb:.3f}", f"{floor_f:.3f} / {floor_fb:.3f} ({binding})",
                          f"{100 * floor_f / tf:.0f}%", f"{100 * floor_fb / tfb:.0f}%", speed)
                row_done()
                torch.cuda.empty_cache()
            if op == "block" and "fused" in args.impls and not args.no_breakdown:
                for kernel, ms in kernel_breakdown(n, C, B, T, d):
                    table.add(shape, op, f"{B}×{T}, {d}", "", f"fused: {kernel}", f"{ms:.3f}", "", "", "", "", "")
                    row_done()
                torch.cuda.empty_cache()
    table.notes.append("fused speedup: the other implementation's time over the fused op's (> 1: fused faster)")
    table.write(name)
    if failed:
        raise SystemExit(f"parity check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
