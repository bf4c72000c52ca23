"""Compile every fused MSAR kernel for an H100/H200 (sm_90a) without a GPU; print registers and spills.

    python -m benchmarks.msar_attn_ptxas [--shapes small medium wide d3000] [--kernels 4 8 12] [--against REV] [--sass]

Uses Triton's own NVIDIA backend and the ``ptxas`` shipped in the triton wheel, so it runs on a
CPU-only machine: a kernel that does not compile for the GPU, or a tile choice in
``kernels/msar_attn/fused._blocks`` that spills registers, shows up here before a GPU run. Prints
one line per kernel: compile seconds, shared memory, layout conversions (TTGIR), registers per thread
and spill bytes. Exits non-zero if a kernel fails to compile. (Not a timing: the GPU benchmark is ``benchmarks.msar_attn``.)
``--against REV`` compiles the kernels of git revision REV the same way, after this tree's: the check to run before
timing a kernel change (a change that spilled under the launch's specialisation cost 1.2 ms a backward on an H200).
``--sass`` also prints each kernel's loops from its SASS, innermost first, with their instructions by class
(fp32 arithmetic, loads, stores, conversions, integer/predicate work): the static count of an inner loop's body
is what an instruction-bound kernel pays per trip (``benchmarks.ptxas.sass_loops``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import triton
from triton.compiler import ASTSource

from benchmarks.ptxas import compile_sm90, launch_attrs, layout_conversions, loop_summary, ptxas_report

SHAPES = {"small": (1024, 512), "medium": (2048, 1024), "wide": (1024, 2048), "d3000": (1024, 3000)}
F32, I32 = "*fp32", "*i32"


# integer arguments that are multiples of 16 in a training step at every shape here (batch 16, T and d multiples
# of 16, offsets between CUDA allocations): Triton specialises them so at launch, and so does this compile
DIV16 = {"B", "T", "D", "p_off", "q_off", "plane", "scr_stride", "tap_stride"}


def compile_launch(fn, types: dict, constexprs: dict, num_warps: int):
    """``fn`` compiled for sm_90a as a launch specialises it: every pointer 16-byte aligned and the integers of
    ``DIV16`` multiples of 16 (without those hints the compiler sees other address arithmetic: the source-gradient
    kernel's spills read 64 instead of 376 bytes while a change was being made that cost 1.2 ms a backward on the
    H200)."""
    constexprs = {n: v for n, v in constexprs.items() if n in fn.arg_names}  # (--against: older kernels lack some)
    # a constexpr not given takes its default, as a launch that omits it does (not an i32 argument, which would compile
    # both sides of every branch on it)
    constexprs.update({p.name: p.default for p in fn.params
                       if p.is_constexpr and p.has_default and p.name not in constexprs})
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    attrs = launch_attrs(fn.arg_names, sig, DIV16)
    return compile_sm90(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), {"num_warps": num_warps})


def compile_kernel(fn, types: dict, constexprs: dict, num_warps: int, loops: bool = False) -> str:
    """``compile_launch``, then ptxas's register/spill summary (with ``loops``, and the SASS loops' instruction
    counts on the lines after it)."""
    kernel = compile_launch(fn, types, constexprs, num_warps)
    report = ptxas_report(kernel)
    info = [line.split(":", 1)[-1].strip() for line in report.splitlines() if "registers" in line or "spill" in line]
    out = f"shared {kernel.metadata.shared} B, {layout_conversions(kernel)} layout conversions | " + "; ".join(info)
    if loops:
        out += "\n" + "\n".join("    " + line for line in loop_summary(kernel).splitlines())
    return out


def _other_layout(token: bool) -> str:
    """The label of the layout a Blocks layout switch (coef_layout, parts_layout) does not default to: the
    kernel compiled that way is listed beside the default as a candidate."""
    return "in planes" if token else "token-major"


def kernels_for(T: int, d: int, kernel_sizes: tuple[int, ...], x_type: str = "*bf16", views_3d: bool | None = None):
    """(name, fn, argument types, constexprs, num_warps) of every kernel a bf16 training step launches;
    ``views_3d``: the view builder's layout (None: what ``_blocks`` picks)."""
    import dataclasses

    from kernels.msar_attn import fused

    m = 1 + len(kernel_sizes)
    k_max, m_pad = max(1, *kernel_sizes), triton.next_power_of_2(m)
    blk = fused._blocks(T, d, m_pad, k_max)
    if views_3d is not None:
        blk = dataclasses.replace(blk, views_3d=views_3d)
    common = dict(M_PAD=m_pad, KS=(1, *kernel_sizes))
    # where each view's (view, tap) pairs start (fused.pair_offsets; computed here, since --against compiles
    # revisions that predate it)
    koff = tuple(sum(common["KS"][:j]) for j in range(m))

    def n_dt(bd: int) -> dict:  # a launch specialises an integer argument equal to 1 as a constant
        return {"n_dt": 1} if triton.cdiv(d, bd) == 1 else {}

    v3 = dict(V3=blk.views_3d)
    mixer = dict(phi_ptr=F32, alpha_ptr=F32, bias_ptr=F32)
    views = dict(x_ptr=x_type, taps_ptr=F32, qg_ptr=F32, near_ptr=I32, eps="fp32", p_off="i64")
    yield ("document window bits", fused._doc_window_kernel, dict(doc_ptr="*i64", near_ptr=I32),
           dict(BT=fused.doc_window_block(T)), 4)
    # a training step's forward saves R and (since 2026-12-02) the logits and ρ for the backward's stats
    saving = dict(STORE_LOGITS="rho_ptr" in fused._fwd_kernel.arg_names, STORE_RHO=True)
    yield ("forward (h, saving R)", fused._fwd_kernel,
           dict(**views, **mixer, out_ptr=x_type, lse_ptr=F32, logits_ptr=F32, rho_ptr=F32, save_r_ptr=x_type,
                save_z_ptr=F32, save_rr_ptr=F32),
           dict(KEY_NORM=True, SIGMOID=True, WRITE_R=False, **saving, SAVE=True, SINGLE=blk.single,
                BT=blk.bt, BD=blk.bd, **common, **v3, **n_dt(blk.bd)), blk.warps)
    if blk.forward_warps(1) != blk.warps:
        yield ("forward, one source", fused._fwd_kernel,
               dict(**views, **mixer, out_ptr=x_type, lse_ptr=F32, logits_ptr=F32, rho_ptr=F32, save_r_ptr=x_type,
                    save_z_ptr=F32, save_rr_ptr=F32),
               dict(KEY_NORM=True, SIGMOID=True, WRITE_R=False, **saving, SAVE=True, SINGLE=blk.single,
                    BT=blk.bt, BD=blk.bd, **common, V3=blk.forward_views_3d(1), **n_dt(blk.bd)), blk.forward_warps(1))
    if hasattr(fused, "_streams_split_kernel"):  # the split forward (Blocks.fwd_mode="split"), since 2026-12-02
        split = getattr(blk, "fwd_mode", "tile") == "split"
        ptok = getattr(blk, "parts_layout", "planes") == "token"
        pass1 = dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=blk.split_logit_bd, FAST=blk.serial_fast, QS=True,
                     DR=False, PREFETCH=blk.stats_prefetch, PAIRS=getattr(blk, "stats_pairs", False))
        yield (f"split forward, pass 1{'' if split else ' (candidate)'}", fused._stats_serial_kernel,
               dict(**views, dr_ptr=F32, part_ptr=F32), dict(**pass1, PM=m_pad if ptok else 0), 1)
        if "PM" in fused._stats_serial_kernel.arg_names:  # Blocks.parts_layout (2026-12-04): a token's sums, one store
            yield (f"split forward, pass 1, sums {_other_layout(ptok)} (candidate)",
                   fused._stats_serial_kernel, dict(**views, dr_ptr=F32, part_ptr=F32),
                   dict(**pass1, PM=0 if ptok else m_pad), 1)
        split_types = dict(x_ptr=x_type, taps_ptr=F32, near_ptr=I32, w_ptr=F32, phi_ptr=F32, r_ptr=x_type,
                           mpart_ptr=F32, p_off="i64")  # pass 2's arguments, every way it compiles
        yield (f"split forward, pass 2{'' if split else ' (candidate)'}", fused._streams_split_kernel,
               split_types,
               dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=blk.split_bd, MIXER=True, LEAN=False, DK=0, TRIP=1),
               blk.split_warps)
        # the lean pass 2 a launch compiles (named without "(candidate)"): its tokens a trip, its rows ahead or not
        lean = getattr(blk, "split_lean", False)
        trip = fused.split_trip(blk) if lean and "TRIP" in fused._streams_split_kernel.arg_names else 1
        ahead = bool(lean and getattr(blk, "split_ahead", False))
        if "LEAN" in fused._streams_split_kernel.arg_names:  # Blocks.split_lean (2026-12-02)
            yield (f"split forward, pass 2 lean{'' if lean and trip == 1 and not ahead else ' (candidate)'}",
                   fused._streams_split_kernel,
                   split_types,
                   dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=blk.split_bd, MIXER=True, LEAN=True, DK=d,
                        TRIP=1), blk.split_warps)
        if "TRIP" in fused._streams_split_kernel.arg_names:  # Blocks.split_trip: the lean pass 2, tokens a trip
            yield (f"split forward, pass 2 lean pairs{'' if trip == 2 and not ahead else ' (candidate)'}",
                   fused._streams_split_kernel,
                   split_types,
                   dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=blk.split_bd, MIXER=True, LEAN=True, DK=d, TRIP=2),
                   blk.split_warps)
            # Blocks.split_ahead (built 2026-12-05 night, the default since late that day)
            if "AHEAD" in fused._streams_split_kernel.arg_names:
                for tr in (1, 2):
                    yield (f"split forward, pass 2 lean, {tr} token(s) a trip, rows a source ahead"
                           f"{'' if (ahead and trip == tr) else ' (candidate)'}",
                           fused._streams_split_kernel, split_types,
                           dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=blk.split_bd, MIXER=True, LEAN=True, DK=d,
                                TRIP=tr, AHEAD=True), blk.split_warps)
            # four tokens a trip (a candidate) on 64 channels a program: on 128 it takes 255 registers and spills
            # 204 bytes at `small` (sm_90a, 2026-12-04)
            yield (f"split forward, pass 2 lean, four tokens a trip on 64 channels"
                   f"{'' if (trip, blk.split_bd) == (4, 64) else ' (candidate)'}", fused._streams_split_kernel,
                   split_types,
                   dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=64, MIXER=True, LEAN=True, DK=d, TRIP=4),
                   blk.split_warps)
        if hasattr(fused, "_softmax_parts_kernel"):  # Blocks.glue="triton" (2026-12-02): the steps between kernels
            tag = "" if getattr(blk, "glue", "torch") == "triton" else " (candidate)"
            softmax = dict(parts_ptr=F32, logits_ptr=F32, rho_ptr=F32, lse_ptr=F32, w_ptr=F32, eps="fp32")
            yield (f"glue: softmax over the sources{tag}", fused._softmax_parts_kernel, softmax,
                   dict(M=m, KEY_NORM=True, LEAN=blk.split_lean, BN=fused.GLUE_BN,
                        PM=m_pad if getattr(blk, "parts_layout", "planes") == "token" else 0), 4)
            if "PM" in fused._softmax_parts_kernel.arg_names:  # Blocks.parts_layout (2026-12-04)
                ptok = getattr(blk, "parts_layout", "planes") == "token"
                yield (f"glue: softmax over the sources, sums {_other_layout(ptok)} (candidate)",
                       fused._softmax_parts_kernel, softmax,
                       dict(M=m, KEY_NORM=True, LEAN=blk.split_lean, BN=fused.GLUE_BN, PM=0 if ptok else m_pad), 4)
            yield (f"glue: gate{tag}", fused._gate_kernel,
                   dict(mparts_ptr=F32, alpha_ptr=F32, bias_ptr=F32, g_ptr=F32, z_ptr=F32, rr_ptr=F32, eps="fp32"),
                   dict(M=m, M_PAD=m_pad, SIGMOID=True, BN=fused.GLUE_BN), 4)
            stats_tag = "" if getattr(blk, "stats_glue", "torch") == "triton" else " (candidate)"
            token = getattr(blk, "coef_layout", "planes") == "token"
            finish = dict(parts_ptr=F32, lse_ptr=F32, logits_ptr=F32, rho_ptr=F32, coef_ptr=F32, eps="fp32")
            yield (f"glue: w, κ, μ{stats_tag}", fused._stats_finish_kernel, finish,
                   dict(M=m, M_PAD=m_pad, KEY_NORM=True, SAVED=True, BN=fused.GLUE_BN, TOKEN=token,
                        PM=getattr(blk, "parts_layout", "planes") == "token"), 4)
            if "TOKEN" in fused._stats_finish_kernel.arg_names:  # Blocks.coef_layout (2026-12-04): w, κ, μ by token
                yield (f"glue: w, κ, μ {_other_layout(token)} (candidate)", fused._stats_finish_kernel,
                       finish, dict(M=m, M_PAD=m_pad, KEY_NORM=True, SAVED=True, BN=fused.GLUE_BN, TOKEN=not token,
                                    PM=getattr(blk, "parts_layout", "planes") == "token"), 4)
            if "PM" in fused._stats_finish_kernel.arg_names:  # Blocks.parts_layout (2026-12-04): the sums by token
                ptok = getattr(blk, "parts_layout", "planes") == "token"
                yield (f"glue: w, κ, μ from sums {_other_layout(ptok)} (candidate)",
                       fused._stats_finish_kernel, finish,
                       dict(M=m, M_PAD=m_pad, KEY_NORM=True, SAVED=True, BN=fused.GLUE_BN, TOKEN=token, PM=not ptok), 4)
        # Blocks.combine_from (2026-12-06 night): "kept" reads the bf16 streams pass 2 wrote and copies nothing
        kept = getattr(blk, "combine_from", "float32") == "kept"
        yield ("split forward, h", fused._combine_kernel,
               dict(r_ptr=x_type if kept else F32, g_ptr=F32, h_ptr=x_type, rs_ptr=x_type),
               dict(M=m, BN=16, BD=min(256, triton.next_power_of_2(d)), COPY=not kept), 4)
    # Blocks.grad_streams (2026-12-06 night, a candidate): dR in the kept streams' dtype, written by the mixer's
    # backward and read by the stats and source-gradient kernels
    dr_kept = getattr(blk, "grad_streams", "float32") == "kept"
    dr_type, dr_other = (x_type, F32) if dr_kept else (F32, x_type)
    dr_label = f"dR in {'fp32' if dr_kept else 'bf16'} (candidate)"  # named first: tests pick kernels by prefix
    mix_types = dict(**mixer, r_ptr=x_type, z_ptr=F32, rr_ptr=F32, dh_ptr=x_type, dz_ptr=F32, coef_ptr=F32,
                     dzy_ptr=F32, eps="fp32")
    mix = dict(SIGMOID=True, BT=blk.bwd_bt, BD=blk.bwd_bd, M_PAD=m_pad, **n_dt(blk.bwd_bd))
    yield "mixer backward", fused._mix_bwd_kernel, dict(**mix_types, dr_ptr=dr_type), mix, blk.mix_warps
    if hasattr(blk, "grad_streams"):
        yield f"{dr_label}: mixer backward", fused._mix_bwd_kernel, dict(**mix_types, dr_ptr=dr_other), mix, \
            blk.mix_warps
    if "SUMS" in fused._mix_bwd_kernel.arg_names:  # Blocks.mix_sums (2026-12-07): Σ dz, Σ dz·y a row a program
        kernel = getattr(blk, "mix_sums", "torch") == "kernel"
        yield (f"mixer backward, Σ dz {'per token' if kernel else 'a row a program'} (candidate)", fused._mix_bwd_kernel,
               dict(**mix_types, dr_ptr=dr_type, sums_ptr=F32),
               dict(mix, SUMS=not kernel, **({"dz_ptr": None, "dzy_ptr": None} if not kernel else {})), blk.mix_warps)
    if hasattr(blk, "mix_dphi") and d <= blk.bwd_bd:  # Blocks.mix_dphi (2026-12-06): dφ summed inside, one tile
        tag = "" if blk.mix_dphi == "walk" else " (candidate)"
        yield (f"mixer backward, dφ inside{tag}", fused._mix_bwd_walk_kernel,
               dict(**mixer, r_ptr=x_type, z_ptr=F32, rr_ptr=F32, dh_ptr=x_type, dr_ptr=dr_type, part_ptr=F32,
                    eps="fp32"),
               dict(SIGMOID=True, BT=blk.mix_walk_bt, BD=blk.bwd_bd, M_PAD=m_pad), blk.mix_walk_warps)
    if hasattr(blk, "dphi_bt"):  # Blocks.mix_dphi="reduce" (2026-12-07): dφ, Σ dz, Σ dz·y in one kernel after it
        # as set, and its other form of the sum (Blocks.dphi_late: summed late at 4 tokens a step, every step at 8)
        for late in (blk.dphi_late, not blk.dphi_late):
            tag = "" if blk.mix_dphi == "reduce" and late == blk.dphi_late else " (candidate)"
            yield (f"mixer backward, dφ reduction{' summed late' if late else ''}{tag}", fused._dphi_kernel,
                   dict(r_ptr=x_type, coef_ptr=F32, dz_ptr=F32, dzy_ptr=F32, part_ptr=F32),
                   dict(M_PAD=m_pad, BT=blk.dphi_bt if late == blk.dphi_late else 4 if late else 8, BD=blk.dphi_bd,
                        INTERP=False, LATE=late), blk.dphi_warps)
    if getattr(blk, "stats_mode", "tile") == "serial":
        ptok = getattr(blk, "parts_layout", "planes") == "token"
        stats = dict(KS=common["KS"], KOFF=koff, KW=k_max, BD=blk.stats_serial_bd,
                     FAST=getattr(blk, "serial_fast", False), QS=not getattr(blk, "stats_saved", False), DR=True,
                     PREFETCH=getattr(blk, "stats_prefetch", False), PAIRS=getattr(blk, "stats_pairs", False))
        yield ("stats", fused._stats_serial_kernel, dict(**views, dr_ptr=dr_type, part_ptr=F32),
               dict(**stats, PM=m_pad if ptok else 0), 1)
        if "PM" in fused._stats_serial_kernel.arg_names:  # Blocks.parts_layout (2026-12-04): a token's sums, one store
            yield (f"stats, sums {_other_layout(ptok)} (candidate)", fused._stats_serial_kernel,
                   dict(**views, dr_ptr=dr_type, part_ptr=F32), dict(**stats, PM=0 if ptok else m_pad), 1)
        if hasattr(blk, "grad_streams"):
            yield (f"{dr_label}: stats", fused._stats_serial_kernel, dict(**views, dr_ptr=dr_other, part_ptr=F32),
                   dict(**stats, PM=m_pad if ptok else 0), 1)
    else:
        yield ("stats", fused._stats_kernel,
               dict(**views, dr_ptr=F32, lse_ptr=F32, coef_ptr=F32),
               dict(KEY_NORM=True, BT=blk.stats_tiles()[1], BD=blk.stats_tiles()[0], **common, **v3,
                    **n_dt(blk.stats_tiles()[0])), blk.stats_warps)
    if getattr(blk, "src_mode", "ring") == "serial":  # (a revision before 2026-12-01 has the ring kernel only)
        src_types = dict(**views, dr_ptr=dr_type, coef_ptr=F32, dx_ptr=x_type, dqg_ptr=F32, dtap_ptr=F32, q_off="i64")
        src = dict(SOFTMAX=True, KS=common["KS"], KOFF=koff, KW=k_max, NPAIR=sum(common["KS"]), BD=blk.serial_bd,
                   PREFETCH=blk.serial_prefetch, FAST=getattr(blk, "serial_fast", False))
        token = getattr(blk, "coef_layout", "planes") == "token"
        yield ("source gradients", fused._src_serial_kernel, src_types, dict(**src, CM=m_pad if token else 0),
               blk.serial_warps)
        if "CM" in fused._src_serial_kernel.arg_names:  # Blocks.coef_layout (2026-12-04): a token's w, κ, μ, one load
            yield (f"source gradients, w κ μ {_other_layout(token)} (candidate)", fused._src_serial_kernel,
                   src_types, dict(**src, CM=0 if token else m_pad), blk.serial_warps)
        if "AHEAD2" in fused._src_serial_kernel.arg_names:  # Blocks.serial_ahead2 (2026-12-05, last session)
            ahead2 = bool(getattr(blk, "serial_ahead2", False) and blk.serial_prefetch)
            yield (f"source gradients, {'one token' if ahead2 else 'two tokens'} ahead (candidate)",
                   fused._src_serial_kernel, src_types, dict(**src, CM=m_pad if token else 0, AHEAD2=not ahead2),
                   blk.serial_warps)
        if hasattr(blk, "grad_streams"):
            yield (f"{dr_label}: source gradients", fused._src_serial_kernel, {**src_types, "dr_ptr": dr_other},
                   dict(**src, CM=m_pad if token else 0), blk.serial_warps)
        if hasattr(fused, "_sum_rows_kernel"):  # Blocks.part_sums (2026-12-06 night): the partials summed by a kernel
            tag = "" if getattr(blk, "part_sums", "torch") == "triton" else " (candidate)"
            yield (f"partial sums of the source gradients{tag}", fused._sum_rows_kernel, dict(src_ptr=F32, dst_ptr=F32),
                   dict(BN=32, BX=32, INTERP=False), 4)
        return
    yield ("source gradients", fused._src_kernel,
           dict(**views, dr_ptr=F32, coef_ptr=F32, dx_ptr=x_type, dqg_ptr=F32, dtap_ptr=F32, scratch_ptr=F32,
                tap_scratch_ptr=F32, q_off="i64"),
           dict(SOFTMAX=True, K_PAD=triton.next_power_of_2(k_max), BT=blk.src_bt, BD=blk.src_bd,
                KOFF=koff, NPAIR=sum(common["KS"]), **common, **v3),
           blk.src_warps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--kernels", nargs="+", type=int, default=[4, 8, 12])
    p.add_argument("--views-3d", choices=["default", "on", "off"], default="default",
                   help="the view builder's layout (fused.Blocks.views_3d); default: what _blocks picks")
    p.add_argument("--against", metavar="REV", default=None,
                   help="also compile the kernels of git revision REV (its kernels/, this compile), after this tree's")
    p.add_argument("--sass", action="store_true", help="also print each kernel's SASS loops by instruction class")
    args = p.parse_args(argv)
    views_3d = {"default": None, "on": True, "off": False}[args.views_3d]
    os.environ.pop("TRITON_INTERPRET", None)  # the GPU tile choices, not the interpreter's
    failed = 0
    for shape in args.shapes:
        T, d = SHAPES[shape]
        print(f"== {shape}: T={T} d={d} kernels={args.kernels}", flush=True)
        for name, fn, types, consts, warps in kernels_for(T, d, tuple(args.kernels), views_3d=views_3d):
            start = time.time()
            try:
                info = compile_kernel(fn, types, consts, warps, loops=args.sass)
            except Exception:
                failed += 1
                print(f"{name}: COMPILE FAILED\n{traceback.format_exc()}", flush=True)
                continue
            tiles = {k: v for k, v in consts.items() if k in ("BT", "BD", "SINGLE", "V3")}
            print(f"{name} {tiles} warps={warps}: {time.time() - start:.0f} s | {info}", flush=True)
    if args.against:
        failed += against(args.against, [a for a in (argv if argv is not None else sys.argv[1:])])
    return 1 if failed else 0


def against(rev: str, argv: list[str]) -> int:
    """Compile REV's fused MSAR kernels with this file's compile (its launch hints): REV's kernels/ from git, this
    file and benchmarks/ptxas.py beside them in a temporary tree; prints its lines under a header. 1 on failure."""
    root = Path(__file__).resolve().parents[1]
    rest, skip = [], False
    for a in argv:  # the same shapes and options, without --against
        if skip or a == "--against" or a.startswith("--against="):
            skip = a == "--against"
            continue
        rest.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        files = subprocess.run(["git", "-C", str(root), "archive", rev, "kernels"], capture_output=True)
        if files.returncode:
            print(f"--against {rev}: not a revision of this repository ({files.stderr.decode().strip()})", flush=True)
            return 1
        subprocess.run(["tar", "-x", "-C", tmp], input=files.stdout, check=True)
        (Path(tmp) / "benchmarks").mkdir()
        for name in ("__init__.py", "ptxas.py", "msar_attn_ptxas.py"):
            shutil.copy(root / "benchmarks" / name, Path(tmp) / "benchmarks" / name)
        print(f"==== the kernels of {rev}", flush=True)
        return int(subprocess.run([sys.executable, "-m", "benchmarks.msar_attn_ptxas", *rest], cwd=tmp).returncode != 0)


if __name__ == "__main__":
    sys.exit(main())
