"""Tile sweep of the depth-attention kernels (kernels/depth_attn/fused.py), in one process (CUDA).

    python -m benchmarks.depth_attn_tiles [--shapes small] [--dtypes fp32 bf16] [--ops block full] [--default-only]
    python -m benchmarks.depth_attn_tiles --ops block_n2 block_n3 block_n4 block_final --dtypes fp32 --default-only

The kernels take fixed tiles (``fused.tiles`` for phase 1, ``fused._row_tiles`` for the merges). This
times each kernel launched alone with other tiles: tokens per program, warps, sources per load (forward
and backward) and the backward's consumer loop. A hardware-counter
profile (``benchmarks/kernel_counters.py``) showed phase 1 and the merge's backward bound by the L1 and
shared-memory pipes (cross-warp reductions at one token per program), not by DRAM. Every candidate's
outputs are checked against the default tiles' (relative error in norm; FAIL above 1e-3 in fp32, 1e-2 in
bf16). Writes benchmarks/results/depth_attn_tiles_<gpu>_<shapes>.md with the command, GPU and date.

Shapes as ``benchmarks.ops_attnres``: ``block`` = n = 5 summaries, C = 4 consumers; ``full`` = 17 sources,
2 consumers; ``block_n2`` .. ``block_final`` are the other phase-1 calls of a Block AttnRes step (2, 3, 4 summaries
for 4 consumers, 5 for the final output). The backward adds into rows [0, n - 1) of a row-gradient buffer, as the residuals run it.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmarks.roofline import Ceilings, Table, bench_ms, held

SHAPES = {"small": (16, 1024, 512), "medium": (16, 2048, 1024), "tiny": (1, 9, 20)}  # tiny: the CPU smoke test
# (n sources, C consumers); block_n2 .. block_final: the phase-1 calls of Block AttnRes's step (16 sublayers, blocks of
# 4) after the first, whose one source takes one load (its backward never reads the outputs)
OPS = {"block": (5, 4), "full": (17, 2), "block_n2": (2, 4), "block_n3": (3, 4), "block_n4": (4, 4), "block_final": (5, 1),
       # the later calls of `medium`'s step (32 sublayers, blocks of 4: 8 summaries for 4 consumers, then 9 for the output)
       "block_n5": (5, 4), "block_n6": (6, 4), "block_n7": (7, 4), "block_n8": (8, 4), "block_final9": (9, 1)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# phase 1, per d: (tokens per program, warps, sources per load forward, sources per load backward[, backward's
# consumers unrolled]); None: the kernels' own tiles. (1, 4, 8, 8) at d = 512 and (1, 8, 8, 8) at d = 1024 are
# the tiles before the sweep. (1, 1, 8, 2, False): the backward's consumer loop; (1, 1, 8, 1): one source a
# backward load, the default at d <= 512 since 2026-12-01 evening (before: (1, 1, 8, 2)).
PHASE1 = {
    512: [None, (1, 4, 8, 8), (1, 1, 8, 8), (1, 1, 4, 4), (1, 1, 2, 2), (1, 1, 4, 2), (2, 1, 4, 2), (1, 2, 8, 4),
          (2, 2, 8, 4), (1, 2, 8, 2), (1, 1, 8, 2, False), (1, 1, 8, 1)],
    1024: [None, (1, 8, 8, 8), (1, 1, 4, 1), (1, 1, 2, 1), (1, 2, 4, 2), (1, 2, 2, 2), (1, 4, 8, 4), (1, 4, 8, 2),
           (1, 2, 8, 1), (1, 2, 8, 2, False)],
}
# merges, per d: (tokens per program, warps); None: the kernels' own tiles ((2, 4) and (1, 4) before the sweep)
MERGE = {512: [None, (2, 4), (1, 1), (2, 1), (4, 1), (1, 2), (4, 2), (4, 4), (8, 8)],
         1024: [None, (1, 4), (1, 1), (1, 2), (2, 2), (2, 4), (4, 8)]}


# code settings of fused held around a candidate, the tiles otherwise default: the phase-1 backward as two kernels (its
# scores reduced as ``fused.scores_once`` says, once, or a chunk at a time: ``fused.SCORES_ONCE``; taking the forward's
# logits or summing them again: ``fused.SCORES_FROM_LOGITS``; its gradients kernel under a register cap:
# ``fused.SPLIT_GRADS_MAXNREG``; its sources as separate rows or in one (S, T, D) load: ``fused.SPLIT_GRADS_ROWS``;
# loaded a trip ahead, with their scalars or not: ``fused.SPLIT_GRADS_PREFETCH``) or one, whatever the rule says
# (``fused.SPLIT_BWD``; the split ones take ``:TILES`` too);
# the forward at 4 warps a token
# (``fused.FWD_WARPS``), in two loads for 3 and 5 sources or not (``fused.FWD_TAIL``), or at 4 warps in two loads
SETTINGS = {"split": {"SPLIT_BWD": True}, "one-kernel": {"SPLIT_BWD": False},
            "split-once": {"SPLIT_BWD": True, "SCORES_ONCE": True},
            "split-chunks": {"SPLIT_BWD": True, "SCORES_ONCE": False},
            "split-logits": {"SPLIT_BWD": True, "SCORES_FROM_LOGITS": True},
            "split-recompute": {"SPLIT_BWD": True, "SCORES_FROM_LOGITS": False},
            "split-cap128": {"SPLIT_BWD": True, "SPLIT_GRADS_MAXNREG": 128},
            "split-cap96": {"SPLIT_BWD": True, "SPLIT_GRADS_MAXNREG": 96},
            "split-rows": {"SPLIT_BWD": True, "SPLIT_GRADS_ROWS": True},
            "split-blocks": {"SPLIT_BWD": True, "SPLIT_GRADS_ROWS": False},
            "split-prefetch": {"SPLIT_BWD": True, "SPLIT_GRADS_PREFETCH": True},
            "split-prefetch-all": {"SPLIT_BWD": True, "SPLIT_GRADS_PREFETCH": "all"},
            "fwd-tail": {"FWD_TAIL": True}, "fwd-padded": {"FWD_TAIL": False}, "fwd4": {"FWD_WARPS": 4},
            "fwd4-tail": {"FWD_WARPS": 4, "FWD_TAIL": True},
            # the forward's sources streamed (fused.FWD_STREAM) at every source count, 1 or 2 rows a load; or nowhere
            # (beyond one load of 8 the sources then go chunk by chunk, the later consumers reading them again)
            "fwd-chunks": {"FWD_STREAM": 0},
            **{f"fwd-stream{rows}{'-prefetch' if pre else ''}": {"FWD_STREAM": rows, "FWD_STREAM_PREFETCH": pre,
                                                                 "FWD_STREAM_FROM": 1}
               for rows in (1, 2) for pre in (False, True)}}
SPLIT = ("split", "one-kernel", "split-once", "split-chunks", "split-logits", "split-recompute", "split-cap128",
         "split-cap96", "split-rows", "split-blocks", "split-prefetch", "split-prefetch-all")


def parse_tiles(text: str):
    """``default`` -> None; a name of ``SETTINGS`` as is (``split`` / ``one-kernel``: the backward in two kernels or in
    one; ``fwd4``, ``fwd-tail``: the forward's), ``split:4,64,4,2,4`` too (split with those tiles, ``fused.SPLIT_TILES``);
    ``1,4,8,8`` ->
    (1, 4, 8, 8); a fifth field 0/1 is the backward's consumer unrolling, a sixth the backward's warps (the forward's
    by default), a seventh its cap on registers a thread (0: none)."""
    if text == "default":
        return None
    if text in SETTINGS:
        return text
    mode, colon, rest = text.partition(":")
    if colon and mode in SPLIT:  # with the split kernels' tiles of its own (fused.SPLIT_TILES)
        try:
            fields = tuple(int(f) for f in rest.split(","))
        except ValueError:
            fields = ()
        if len(fields) != 5 or not all(f > 0 for f in fields):
            raise SystemExit(f"--phase1 {text!r}: expected {mode}:TOKENS,CHUNK,WARPS,SOURCES,WARPS (the scores kernel's "
                             "tokens, channels a chunk and warps, the gradients kernel's sources a load and warps; "
                             "positive integers), e.g. split:4,64,4,2,4")
        return text
    try:
        fields = [int(f) for f in text.split(",")]
    except ValueError:
        fields = []
    if (len(fields) not in (4, 5, 6, 7) or not all(f > 0 for f in fields[:4])
            or (len(fields) > 4 and fields[4] not in (0, 1)) or (len(fields) > 5 and fields[5] <= 0)
            or (len(fields) > 6 and fields[6] < 0)):
        raise SystemExit(f"--phase1 {text!r}: expected 'default', one of {', '.join(SETTINGS)} or "
                         "TOKENS,WARPS,SOURCES_FWD,SOURCES_BWD[,UNROLL[,"
                         "BWD_WARPS[,BWD_MAXNREG]]] (positive integers, UNROLL 0 or 1, BWD_MAXNREG 0 for none), e.g. "
                         "1,4,8,8 or 1,2,8,8,0,8,128")
    return (*fields[:4], bool(fields[4]), *fields[5:]) if len(fields) > 4 else tuple(fields)


def best_wide(text: str) -> tuple | None:
    """From a result table of this script: the candidate whose phase-1 backward took the least time summed over the
    table's ops (each candidate timed on every op, every check ok), as ``fused.WIDE_BWD`` takes it (sources per load,
    warps, consumers unrolled, register cap), or None where the default was fastest or no candidate covers every op."""
    import ast

    totals, ops, bad = {}, {}, set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or cells[3] != "phase 1 bwd":
            continue
        label, op = cells[4], (cells[0], cells[1], cells[2])
        if not cells[4].startswith(("(", "default")):  # split / one-kernel: not tiles WIDE_BWD can take
            continue
        if not cells[8].endswith("ok") or not cells[5]:
            bad.add(label)
            continue
        totals[label] = totals.get(label, 0.0) + float(cells[5])
        ops.setdefault(label, set()).add(op)
    every = set().union(*ops.values()) if ops else set()
    ranked = sorted((t, label) for label, t in totals.items() if label not in bad and ops[label] == every)
    if not ranked or ranked[0][1] == "default":
        return None
    cand = ast.literal_eval(ranked[0][1])
    unroll = cand[4] if len(cand) > 4 else (cand[5] if len(cand) > 5 else cand[1]) < 16
    return (cand[3], cand[5] if len(cand) > 5 else cand[1], bool(unroll), cand[6] if len(cand) > 6 else 0)


def _bucket(d: int) -> int:
    """The candidate list for width d: 1024's above 512, else 512's."""
    return 1024 if d > 512 else 512


def _wall_ms(fn) -> float:
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def phase1_tiles(fused, cand, n, d):
    """fused.tiles returning ``cand`` (the default when None) for this (n, d)."""
    default = fused.tiles
    if cand is None:
        yield default(n, d)
        return
    if isinstance(cand, str):
        mode, _, fields = cand.partition(":")
        settings = dict(SETTINGS[mode], **({"SPLIT_TILES": tuple(int(f) for f in fields.split(","))} if fields else {}))
        with held((fused, name, value) for name, value in settings.items()):
            yield fused.tiles(n, d)
        return
    bt, warps, bs, bbs, *rest = cand
    block_d = fused._pow2(d)
    bs, bbs = min(bs, fused._pow2(n)), min(bbs, fused._pow2(n))
    bwd_warps = rest[1] if len(rest) > 1 else warps
    t = fused.Tiles(bt, block_d, bs, n <= bs, warps, bbs, n <= bbs, rest[0] if rest else bwd_warps < 16, bwd_warps,
                    rest[2] if len(rest) > 2 else 0)
    fused.tiles = lambda n_, d_, c_=None: t
    try:
        yield t
    finally:
        fused.tiles = default


@contextlib.contextmanager
def merge_tiles(fused, cand, d):
    default = fused._row_tiles
    if cand is None:
        yield default(d)
        return
    fused._row_tiles = lambda d_: (cand[0], fused._pow2(d), cand[1])
    try:
        yield fused._row_tiles(d)
    finally:
        fused._row_tiles = default


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["small"], choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--ops", nargs="+", default=["block", "full"], choices=list(OPS))
    p.add_argument("--default-only", action="store_true",
                   help="time the kernels' own tiles alone (and the phase-1 backward taking dO·o from the outputs)")
    p.add_argument("--phase1", nargs="+", metavar="TILES",
                   help="the phase-1 candidates to time instead of the list for the width: 'default' or "
                        "'TOKENS,WARPS,SOURCES_FWD,SOURCES_BWD[,UNROLL]', e.g. default 1,4,8,8 1,4,8,8,0")
    p.add_argument("--tag", default="", help="appended to the result file's name")
    p.add_argument("--best-wide", metavar="FILE", help="print the fastest backward candidate of a result table as "
                                                      "fused.WIDE_BWD takes it (None: the default), and stop")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (timings meaningless)")
    args = p.parse_args(argv)
    if args.best_wide:
        print(best_wide(open(args.best_wide).read()))
        return
    chosen = None if args.phase1 is None else [parse_tiles(t) for t in args.phase1]  # bad ones fail before GPU work
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.depth_attn_tiles needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)")
    from kernels.depth_attn import fused

    dev = args.device
    if dev == "cuda":
        ceilings, timer = Ceilings.measure(), bench_ms
        described = ceilings.describe()
    else:
        ceilings, timer, described = None, _wall_ms, "cpu smoke run: no ceilings, one call timed"
    print(described, flush=True)
    table = Table("Depth-attention kernels: tiles", ["shape", "dtype", "op", "kernel", "tiles", "ms", "vs default",
                                                       "GB/s (min bytes)", "check"],
                  notes=[described,
                         "tiles: phase 1 (tokens/program, warps, sources/load fwd, sources/load bwd), merges "
                         "(tokens/program, warps); 'default' is what the kernels take today",
                         "min bytes: phase 1 fwd reads n sources, writes C outputs; bwd reads n sources, C upstream "
                         "gradients, reads and writes n-1 gradient rows, writes 1; merge fwd reads o, p, writes h; "
                         "merge bwd reads o, p, dh, writes do, dp"])
    failed = []
    for shape in args.shapes:
        B, T, d = SHAPES[shape]
        N = B * T
        for dname in args.dtypes:
            dt = DTYPES[dname]
            e = torch.finfo(dt).bits // 8
            tol = 1e-3 if dt == torch.float32 else 1e-2
            for op in args.ops:
                n, C = OPS[op]
                g = torch.Generator(device=dev).manual_seed(0)
                src = (torch.randn(n, B, T, d, device=dev, generator=g) * 2
                       + torch.randn(n, 1, 1, d, device=dev, generator=g)).to(dt)
                qg = 0.5 * torch.randn(C, d, device=dev, generator=g)
                douts = tuple(torch.randn(B, T, d, device=dev, generator=g).to(dt) for _ in range(C))
                dlse = torch.randn(C, B, T, device=dev, generator=g)
                grads0 = torch.randn(n, B, T, d, device=dev, generator=g)
                kw = dict(key_norm=True, eps=1e-6)

                def row(kernel, tiles, ms, base, nbytes, err, tol=tol):
                    ok = err < tol
                    if not ok:
                        failed.append(f"{shape}/{dname}/{op}/{kernel}/{tiles}: {err:.1e}")
                    table.add(shape, dname, op, kernel, tiles, f"{ms:.4f}", f"{ms / base:.2f}" if base else "1.00",
                              f"{nbytes / (ms * 1e-3) / 1e9:.0f}", f"{err:.1e} {'ok' if ok else 'FAIL'}")
                    print(" | ".join(table.rows[-1]), flush=True)

                fwd_bytes = (n + C) * N * d * e
                bwd_bytes = (n + C) * N * d * e + (2 * (n - 1) + 1) * N * d * 4
                ref_out, ref_lse, _, _ = fused.summaries_fwd(src, n, qg, store_logits=False, **kw)
                dsrc = grads0.clone()
                fused.summaries_bwd(src, n, qg, ref_lse, douts, dlse, dsrc=dsrc, n_add=n - 1, **kw)
                ref_dsrc = dsrc.clone()
                _, ref_dqg = fused.summaries_bwd(src, n, qg, ref_lse, douts, dlse, dsrc=grads0.clone(), n_add=n - 1,
                                                 **kw)
                base_f = base_b = None
                for cand in [None] if args.default_only else chosen if chosen is not None else PHASE1[_bucket(d)]:
                    label = "default" if cand is None else str(cand)
                    try:
                        with phase1_tiles(fused, cand, n, d):
                            # as training runs it: the forward keeps the logits and r_s where its split backward
                            # takes them (``fused.scores_from_logits``), and its time counts their stores
                            keep = fused.scores_from_logits(n, d, C)
                            out, lse, logits, rstd = fused.summaries_fwd(src, n, qg, store_logits=keep,
                                                                         store_rstd=keep, **kw)
                            err = max(rel(out, ref_out), rel(lse, ref_lse))
                            ms = timer(lambda: fused.summaries_fwd(src, n, qg, store_logits=keep, store_rstd=keep,
                                                                   **kw))
                            base_f = base_f or ms
                            row("phase 1 fwd", label, ms, base_f, fwd_bytes, err)
                            sc = dict(logits=logits, rstd=rstd, **kw)
                            dsrc = grads0.clone()
                            _, dqg = fused.summaries_bwd(src, n, qg, ref_lse, douts, dlse, dsrc=dsrc, n_add=n - 1, **sc)
                            err = max(rel(dsrc, ref_dsrc), rel(dqg, ref_dqg))
                            ms = timer(lambda: fused.summaries_bwd(src, n, qg, ref_lse, douts, dlse, dsrc=dsrc,
                                                                   n_add=n - 1, **sc))
                            base_b = base_b or ms
                            row("phase 1 bwd", label, ms, base_b, bwd_bytes, err)
                            # dO·o from the outputs, as stored in the sources' dtype, and in bf16 as training keeps
                            # them (the upstream gradients stay in the sources' dtype here). The bf16 row's check is
                            # 3e-2: one rounding of o inside every delta_c = dO_c·o_c reached 0.8-1.2e-2 at `small`
                            # and `medium` on an H200, where training matched the fp32 outputs (docs/kernel_attnres.md)
                            outs = [] if cand is not None or fused.tiles(n, d, C).bwd_one_chunk else \
                                [("", ref_out, e, tol)] + ([(" (bf16)", ref_out.bfloat16(), 2, 3e-2)]
                                                           if dt != torch.bfloat16 else [])
                            for suffix, kept, oe, otol in outs:
                                dsrc = grads0.clone()
                                _, dqg = fused.summaries_bwd(src, n, qg, ref_lse, douts, dlse, dsrc=dsrc, n_add=n - 1,
                                                             out=kept, **kw)
                                err = max(rel(dsrc, ref_dsrc), rel(dqg, ref_dqg))
                                ms = timer(lambda: fused.summaries_bwd(src, n, qg, ref_lse, douts, dlse, dsrc=dsrc,
                                                                       n_add=n - 1, out=kept, **kw))
                                row(f"phase 1 bwd, dO·o from the outputs{suffix}", label, ms, base_b,
                                    bwd_bytes + C * N * d * oe, err, otol)
                    except Exception as exc:  # a candidate that does not compile (registers, shared memory)
                        table.add(shape, dname, op, "phase 1", label, "", "", "",
                                  f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                        print(" | ".join(table.rows[-1]), flush=True)
                if op != "block":
                    continue
                o, pp, q1 = ref_out[1].contiguous(), douts[0].clone(), qg[1].contiguous()
                lse1 = ref_lse[1].contiguous()
                ref_h, ref_w = fused.merge_fwd(o, lse1, pp, q1, **kw)
                dh = douts[2]
                ref_b = fused.merge_bwd(ref_h, pp, q1, ref_w, dh, o_dtype=o.dtype, **kw)
                base_f = base_b = None
                for cand in [None] if args.default_only else MERGE[_bucket(d)]:
                    label = "default" if cand is None else str(cand)
                    try:
                        with merge_tiles(fused, cand, d):
                            h, w = fused.merge_fwd(o, lse1, pp, q1, **kw)
                            err = max(rel(h, ref_h), rel(w, ref_w))
                            ms = timer(lambda: fused.merge_fwd(o, lse1, pp, q1, **kw))
                            base_f = base_f or ms
                            row("merge fwd", label, ms, base_f, 3 * N * d * e, err)
                            got = fused.merge_bwd(ref_h, pp, q1, ref_w, dh, o_dtype=o.dtype, **kw)
                            err = max(rel(a, b) for a, b in zip(got, ref_b))
                            ms = timer(lambda: fused.merge_bwd(ref_h, pp, q1, ref_w, dh, o_dtype=o.dtype, **kw))
                            base_b = base_b or ms
                            row("merge bwd", label, ms, base_b, 5 * N * d * e, err)
                    except Exception as exc:
                        table.add(shape, dname, op, "merge", label, "", "", "",
                                  f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                        print(" | ".join(table.rows[-1]), flush=True)
                del src, douts, grads0
                if dev == "cuda":
                    torch.cuda.empty_cache()
    gpu = "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name().lower()) if dev == "cuda" else "cpu"
    table.write(f"depth_attn_tiles_{gpu}_{'_'.join(args.shapes)}{'_default' if args.default_only else ''}{args.tag}")
    if failed:
        raise SystemExit(f"check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
