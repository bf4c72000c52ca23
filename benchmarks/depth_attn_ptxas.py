"""Compile the fused depth-attention kernels for an H100/H200 (sm_90a) without a GPU; print resources.

    python -m benchmarks.depth_attn_ptxas [--shapes block-small block-medium ...] [--sass]

Uses Triton's NVIDIA backend and the ``ptxas`` shipped in the triton wheel, with the tiles that
``kernels/depth_attn/fused.tiles`` picks and the argument specialisation of a real launch (pointers
and d, N divisible by 16), so it runs on a CPU-only machine. One line per kernel: shared memory,
layout conversions (TTGIR), registers per thread, spill bytes, and the programs per SM those allow (the persistent backward
grids are sized from the same numbers at run time). Not a timing: the GPU benchmark is
``benchmarks.ops_attnres``. ``--sass`` also prints each kernel's loops from its SASS, innermost first, with their
instructions by class (``benchmarks.ptxas.loop_summary``).
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.ptxas import compile_sm90, launch_attrs, layout_conversions, loop_summary, ptxas_report, registers

# name -> (consumers C, sources n, d): the ops of benchmarks.ops_attnres at its widths, and the limits
SHAPES = {
    "block-small": (4, 5, 512), "block-medium": (4, 5, 1024), "block-d2048": (4, 5, 2048),
    "block3-medium": (4, 3, 1024), "block8-medium": (4, 8, 1024),
    "full-small": (2, 17, 512), "full-medium": (2, 17, 1024), "full-d2048": (2, 17, 2048),
    "block8-d4096": (8, 9, 4096), "one-d8192": (1, 9, 8192),
}
# the merge alone (AttnRes) and the merge that sums Block AttnRes's partial (forward) and takes its gradient (backward)
MERGES = (("", False), (" + partial sum", True))


def compile_report(fn, types: dict, constexprs: dict, num_warps: int, loops: bool = False) -> tuple[str, int]:
    """Compile ``fn`` for sm_90a -> (ptxas's register/spill summary, registers per thread); with ``loops`` the
    summary ends with one line per SASS loop. A ``maxnreg`` among ``constexprs`` is the launch's register cap, not an
    argument."""
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    cap = constexprs.pop("maxnreg", 0)
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    attrs = launch_attrs(fn.arg_names, sig, ("D", "N"))  # d and N are multiples of 16 at every shape here
    kernel = compile_sm90(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          dict(num_warps=num_warps, **({"maxnreg": cap} if cap else {})))
    report = ptxas_report(kernel)
    info = [ln.split(":", 1)[-1].strip() for ln in report.splitlines() if "registers" in ln or "spill" in ln]
    regs = registers(report)
    out = f"shared {kernel.metadata.shared} B, {layout_conversions(kernel)} layout conversions | " + "; ".join(info)
    if loops:
        out += "\n" + "\n".join("    " + line for line in loop_summary(kernel).splitlines())
    return out, regs


def per_sm(regs: int, warps: int, smem: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    return max(1, min(65536 // (per_warp * warps), 2048 // (32 * warps), (227 * 1024) // smem if smem else 64))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sass", action="store_true", help="also print each kernel's SASS loops by instruction class")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the GPU tiles, not the interpreter's
    from kernels.depth_attn import fused

    bf16, f32 = "*bf16", "*fp32"
    failed = 0
    for shape in args.shapes:
        C, n, d = SHAPES[shape]
        t = fused.tiles(n, d, C)
        keep = fused.scores_from_logits(n, d, C)  # the forward keeps its logits for the split backward's scores
        bt, bd, mw = fused._row_tiles(d)
        grads_types = dict(src_ptr=bf16, qg_ptr=f32, douts=(bf16,) * C, w_ptr=f32, dlr_ptr=f32, coef_ptr=f32,
                           dsrc_ptr=bf16, dqg_ptr=f32)  # the split gradients kernel's arguments, for each of its ways
        fwd_types = dict(src_ptr=bf16, qg_ptr=f32, out0_ptr=bf16, out_ptr=bf16, lse_ptr=f32, logits_ptr=f32, rstd_ptr=f32,
                         eps="fp32")  # both forward kernels' arguments
        stream = fused.fwd_stream(n)  # the forward the rule runs: streamed past one load (fused.FWD_STREAM)
        runs = [
            ("phase 1 forward", fused._summaries_fwd_kernel,
             fwd_types,
             dict(C=C, KEY_NORM=True, STORE_LOGITS=keep, STORE_RSTD=keep, ONE_CHUNK=t.one_chunk, BLOCK_S=t.block_s,
                  TAIL_S=t.tail_s, BLOCK_T=t.block_t, BLOCK_D=t.block_d), t.num_warps) if not stream else
            ("phase 1 forward (streamed)", fused._summaries_fwd_stream_kernel,
             fwd_types,
             dict(C=C, KEY_NORM=True, STORE_LOGITS=keep, STORE_RSTD=keep, BLOCK_S=stream, BLOCK_T=t.block_t,
                  BLOCK_D=t.block_d, PREFETCH=fused.FWD_STREAM_PREFETCH), t.num_warps),
            # the forward with its sources streamed (fused.FWD_STREAM, for more than one warp a token): 1 or 2 rows a
            # load, with the next in flight or not
            *((f"phase 1 forward, streamed {rows} a load{', prefetched' if prefetch else ''}",
               fused._summaries_fwd_stream_kernel,
               fwd_types,
               dict(C=C, KEY_NORM=True, STORE_LOGITS=keep, STORE_RSTD=keep, BLOCK_S=rows, BLOCK_T=t.block_t,
                    BLOCK_D=t.block_d, PREFETCH=prefetch), t.num_warps)
              for rows in (1, 2) if d > 512 and rows < fused._pow2(n) for prefetch in (False, True)),
            *((f"phase 1 backward{label}", fused._summaries_bwd_kernel,
               dict(src_ptr=bf16, qg_ptr=f32, lse_ptr=f32, douts=(bf16,) * C, dlse_ptr=f32, dsrc_ptr=bf16,
                    dqg_ptr=f32, out_ptr=bf16, eps="fp32"),
               dict(C=C, BLOCK_C=fused._pow2(C), KEY_NORM=True, ONE_CHUNK=t.bwd_one_chunk, UNROLL_C=t.bwd_unroll_c,
                    BLOCK_S=t.bwd_block_s, BLOCK_T=t.block_t, BLOCK_D=t.block_d, DELTA_FROM_OUT=from_out), t.num_warps)
              for label, from_out in (("", False), (", delta from the outputs", True))
              if not (from_out and t.bwd_one_chunk)),
            # the split backward where the rule takes it (fused.split_backward): its two kernels with their tiles
            *((f"phase 1 backward, split: {label}", fn, types,
               dict(consts, C=C, KEY_NORM=True, **({"BLOCK_C": fused._pow2(C)} if "BLOCK_C" in fn.arg_names else {})),
               warps)
              for _, (bt_b, block_d, per_load), warps_b in
              ([fused.split_tiles(n, d, C)] if t.bwd_split else [])
              for label, fn, types, consts, warps in (
                  *((f"scores{'' if from_logits else ', logits summed again'}", fused._split_scores_kernel,
                     dict(src_ptr=bf16, qg_ptr=f32, lse_ptr=f32, douts=(bf16,) * C, dlse_ptr=f32, w_ptr=f32,
                          dlr_ptr=f32, coef_ptr=f32, logit_in_ptr=f32, rstd_in_ptr=f32, eps="fp32"),
                     dict(BLOCK_S=fused._pow2(n), BLOCK_T=tiles_a[0], BLOCK_D=tiles_a[1], ONCE=fused.scores_once(C),
                          FROM_LOGITS=from_logits), tiles_a[2])
                    for from_logits in dict.fromkeys((keep, False))
                    for tiles_a in [fused.split_tiles(n, d, C, from_logits)[0]]),
                  # the gradients kernel as the setting says, then the other way (fused.SPLIT_GRADS_ROWS)
                  *((f"gradients{'' if rows == fused.split_grads_rows() else ', sources ' + way}",
                     fused._split_grads_kernel, grads_types,
                     dict(BLOCK_S=per_load, BLOCK_T=bt_b, BLOCK_D=block_d, ROWS=rows, PREFETCH=0), warps_b)
                    for rows, way in ((fused.split_grads_rows(), ""), (not fused.split_grads_rows(),
                                      "as rows" if not fused.split_grads_rows() else "in one load"))),
                  # its loads a trip ahead (fused.SPLIT_GRADS_PREFETCH: True the sources, "all" their scalars too), under
                  # the cap the launch sets
                  *((f"gradients, prefetched{label}", fused._split_grads_kernel, grads_types,
                     dict(BLOCK_S=per_load, BLOCK_T=bt_b, BLOCK_D=block_d, ROWS=False, PREFETCH=level,
                          maxnreg=fused.PREFETCH_MAXNREG), warps_b)
                    for level, label in ((1, ""), (2, " with its scalars"))))),
            *((f"merge forward{label}", fused._merge_fwd_kernel,
               dict(o_ptr=bf16, lse_ptr=f32, p_ptr=bf16, qg_ptr=f32, h_ptr=bf16, w_ptr=f32, new_ptr=bf16, psum_ptr=bf16,
                    eps="fp32"),
               dict(KEY_NORM=True, SUM=chained, BLOCK_T=bt, BLOCK_D=bd), mw) for label, chained in MERGES),
            *((f"merge backward{label}", fused._merge_bwd_kernel,
               dict(h_ptr=bf16, p_ptr=bf16, qg_ptr=f32, w_ptr=f32, dh_ptr=bf16, do_ptr=bf16, dp_ptr=bf16,
                    dlse_ptr=f32, dqg_ptr=f32, dpin_ptr=bf16, eps="fp32"),
               dict(KEY_NORM=True, DP_IN=chained, BLOCK_T=bt, BLOCK_D=bd), mw) for label, chained in MERGES),
        ]
        print(f"== {shape}: C={C} n={n} d={d} tiles {t}", flush=True)
        for name, fn, types, consts, warps in runs:
            try:
                info, regs = compile_report(fn, types, consts, warps, loops=args.sass)
            except Exception as exc:
                failed += 1
                print(f"{name}: COMPILE FAILED: {type(exc).__name__}: {exc}", flush=True)
                continue
            smem = int(info.split("shared ", 1)[1].split(" ", 1)[0])
            tiles = {k: v for k, v in consts.items() if k.startswith("BLOCK_") or k in ("ONE_CHUNK", "UNROLL_C", "ROWS", "PREFETCH", "maxnreg", "ROWS_A_TRIP", "TAIL")}
            head, _, loops = info.partition("\n")
            print(f"{name} {tiles} warps={warps}: {head} | {per_sm(regs, warps, smem)} programs/SM", flush=True)
            if loops:
                print(loops, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
