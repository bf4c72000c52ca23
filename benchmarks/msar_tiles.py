"""Tile sizes of the fused MSAR kernels, timed on a CUDA GPU: which choice of ``fused._blocks`` is fastest.

    python -m benchmarks.msar_tiles [--shapes small medium] [--sources 5]

For one shape, every kernel of the op (forward, mixer backward, stats, source gradients) is timed
with the tile choice of ``kernels.msar_attn.fused._blocks`` (the default, first row of its group) and
with a few others around it (tokens per program, channels per tile, warps), one kernel's fields at
a time, the others at their defaults, all in ONE process (CUDA-event medians), so the ratios are
measured side by side. Every candidate's result is compared with the default's first (h, dR, the
gradients of φ, α and b, dx and the tap and query gradients; relative error < 1e-3): a tile choice that computes something else
is reported as WRONG and not timed. The table goes to benchmarks/results/msar_tiles_<gpu>.md with
the command, the GPU and the date. Changing the defaults is a separate, reviewed edit of ``_blocks``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import torch

from benchmarks.msar_attn import SHAPES, make_inputs, rel_err
from benchmarks.roofline import Table, bench_ms


def candidates(blk) -> dict[str, list[dict]]:
    """Per kernel, the field overrides to try (the default first), each giving tiles no earlier one gives."""
    def distinct(overrides: list[dict]) -> list[dict]:  # a repeat would time the same tiles twice, under two labels
        seen, kept = [], []
        for over in overrides:
            tiles = dataclasses.replace(blk, **over)
            if tiles not in seen:  # Blocks compare by their fields, as --only matches them
                seen.append(tiles)
                kept.append(over)
        return kept

    return {kernel: distinct(overrides) for kernel, overrides in _candidates(blk).items()}


def _candidates(blk) -> dict[str, list[dict]]:
    def around(bt):
        return sorted({max(1, bt // 2), bt, bt * 2})

    v3 = [dict(views_3d=not blk.views_3d)]  # the view builder's other layout
    # the source-gradient kernel: the ring kernel's tiles (and its view layout), or the serial kernel's chunk and
    # channel tiles; each mode's candidates include the other mode at its default tiles
    ring = ([dict(src_mode="ring")] if blk.src_mode != "ring" else v3 + [dict(src_mode="serial")]) + [
        dict(src_mode="ring", src_bd=bd, src_warps=w) for bd in (16, 32, 64) for w in (1, 2, 4, 8)
        if (bd, w) != (blk.src_bd, blk.src_warps)] + [
        dict(src_mode="ring", src_bt=bt, sub=sub) for bt, sub in ((32, 8), (32, 16), (16, 8), (16, 32))
        if (bt, sub) != (blk.src_bt, blk.sub)]
    before = [dict(src_mode="ring", stats_mode="tile")] if blk.stats_mode != "tile" else []  # both old kernels
    serial = [dict(src_mode="ring")] + before + [
        dict(serial_ch=ch) for ch in (32, 64, 128, 256, 512) if ch != blk.serial_ch] + [
        dict(serial_bd=bd, serial_warps=w) for bd, w in ((32, 1), (64, 2), (128, 4), (256, 4))
        if (bd, w) != (blk.serial_bd, blk.serial_warps)] + [dict(serial_prefetch=not blk.serial_prefetch),
                                                            dict(serial_fast=not blk.serial_fast)] + [
        # the backward's w, κ, μ token-major, a token's in one load (sm_90a at `small`: the token loop 510 -> 465
        # instructions, 255 -> 252 registers, no spills; the stats' glue kernel writes them 4·M_PAD floats apart), or
        # in planes once token-major is the default
        dict(coef_layout="token" if blk.coef_layout == "planes" else "planes"),
        # the source-gradient kernel with two tokens' loads in flight (sm_90a at `small`: 255 registers, 32 bytes
        # spilled, against 252 and none), or one once two is the default
        dict(serial_ahead2=not blk.serial_ahead2),
        # the partial query and tap gradients summed by one kernel a tensor (fused.sum_rows) instead of torch's sum
        dict(part_sums="torch" if blk.part_sums == "triton" else "triton")]
    # the split forward (two passes over channel tiles) against the tile forward, and its tiles
    other_fwd = "tile" if blk.fwd_mode == "split" else "split"
    other_glue = "torch" if blk.glue == "triton" else "triton"
    other_stats_glue = "torch" if blk.stats_glue == "triton" else "triton"
    split = [dict(fwd_mode=other_fwd)] + [
        dict(fwd_mode="split", split_bd=bd, split_warps=w) for bd, w in ((64, 1), (128, 1), (128, 2), (256, 2), (256, 4))
        if (bd, w) != (blk.split_bd, blk.split_warps)] + [
        dict(fwd_mode="split", split_logit_bd=bd) for bd in (32, 64, 128) if bd != blk.split_logit_bd] + [
        dict(fwd_mode="split", split_ch=ch) for ch in (32, 64, 128, 256) if ch != blk.split_ch] + [
        dict(fwd_mode="split", split_lean=not blk.split_lean)] + [  # pass 2 lean (or plain, once lean is the default)
        # the lean pass 2's tiles: fewer registers a lane (sm_90a at `small`: 102 at 64 channels on one warp, 107 at
        # 128 on two, against 190 at 128 on one) let more warps hide its load latency (pass 2 had 1.9 warps a
        # scheduler and waited on L1 for 41% of its cycles: kernel_counters_h200_split.md)
        dict(fwd_mode="split", split_lean=True, split_bd=bd, split_warps=w) for bd, w in ((64, 1), (128, 2), (256, 2))
        if not (blk.split_lean and (bd, w) == (blk.split_bd, blk.split_warps))] + [
        dict(fwd_mode="split", split_lean=True, split_bd=64, split_ch=ch) for ch in (32, 128)] + [
        # the steps between the kernels as one kernel each (or as PyTorch, once the kernels are the default)
        dict(fwd_mode="split", glue=other_glue), dict(fwd_mode="split", split_lean=True, split_bd=64, glue="triton"),
        dict(fwd_mode="split", split_lean=False, glue="torch"),  # the split forward as first timed (2026-12-02)
        dict(fwd_mode="split", stats_pairs=not blk.stats_pairs)] + [  # pass 1 two tokens a trip (or one)
        # the lean pass 2's tokens a trip other than the default's (a trip's rows are loaded once: sm_90a at `small`
        # two tokens 216 -> 172.5 instructions a (token, source) in the unmasked loop, 190 -> 241 registers;
        # docs/kernel_msar.md, "Two tokens a trip of pass 2"); four on 64 channels a program (on 128 they spill)
        *(dict(fwd_mode="split", split_trip=trip) for trip in (1, 2) if trip != blk.split_trip),
        dict(fwd_mode="split", split_trip=4, split_bd=64),
        # the unmasked loop's rows loaded one source ahead (Blocks.split_ahead; sm_90a at `small`: 243 registers as
        # the default's, 392 against 345 instructions a trip of two tokens), or not once it is the default
        dict(fwd_mode="split", split_ahead=not blk.split_ahead),
        # pass 1's sums token-major, a vector store a (token, statistic) (sm_90a at `small`: 762 -> 682 instructions
        # a trip of two tokens, 219 -> 235 registers; the glue kernel reads them 2·M_PAD floats apart), or in planes
        # once token-major is the default
        dict(fwd_mode="split", parts_layout="token" if blk.parts_layout == "planes" else "planes")]
    return {
        "forward": [{}] + split + v3
                   + [dict(views_3d=not blk.views_3d, bt=bt, warps=w) for bt, w in ((1, 1), (1, 2), (2, 2))]
                   + [dict(bt=bt, warps=w) for bt in around(blk.bt) for w in (2, 4, 8, 16)
                      if (bt, w) != (blk.bt, blk.warps)]
                   # the passes over channel tiles (the wide-d forward) with narrow tiles and more tokens
                   + [dict(bd=bd, single=False, bt=bt, warps=w) for bd, bt in ((64, 16), (64, 32), (128, 8),
                                                                               (128, 16), (256, 4), (256, 8))
                      for w in (4, 8) if bd < blk.bd or not blk.single],
        "mixer backward": [{}] + [dict(bwd_bt=bt, mix_warps=w) for bt in around(blk.bwd_bt) for w in (2, 4, 8)
                                  if (bt, w) != (blk.bwd_bt, blk.mix_warps)]
                          # dφ, Σ dz and Σ dz·y summed inside the kernel (a program walks mix_walk tokens, its partial
                          # dφ in registers), or the product once the walk is the default; then the walk's tiles
                          + [dict(mix_dphi="walk" if blk.mix_dphi != "walk" else "product")]
                          + [dict(mix_dphi="walk", mix_walk=w, mix_walk_bt=bt, mix_walk_warps=nw)
                             for w, bt, nw in ((0, 1, 8), (0, 4, 8), (0, 2, 16), (0, 4, 16), (64, 2, 8),
                                               (256, 2, 8), (0, 1, 4))
                             if (w, bt, nw) != (blk.mix_walk, blk.mix_walk_bt, blk.mix_walk_warps)]
                          # dφ, Σ dz and Σ dz·y by one reduction kernel after the mixer's (mix_dphi="reduce"), or the
                          # product once the reduction is the default; then the reduction's tiles
                          + [dict(mix_dphi="reduce" if blk.mix_dphi != "reduce" else "product")]
                          + [dict(mix_dphi="reduce", dphi_bt=bt, dphi_bd=bd, dphi_warps=nw, dphi_waves=wv)
                             for bt, bd, nw, wv in ((4, 128, 4, 4), (16, 128, 4, 4), (8, 64, 2, 4), (8, 256, 4, 4),
                                                    (8, 256, 8, 4), (8, 128, 4, 2), (8, 128, 4, 8))
                             if (bt, bd, nw, wv) != (blk.dphi_bt, blk.dphi_bd, blk.dphi_warps, blk.dphi_waves)]
                          # its products kept per token and summed once at the end (Blocks.dphi_late)
                          + [dict(mix_dphi="reduce", dphi_late=not blk.dphi_late, dphi_bt=bt, dphi_warps=nw)
                             for bt, nw in ((4, 4), (8, 4), (4, 8), (8, 8))],
        "stats": [{}] + v3 + [dict(stats_glue=other_stats_glue)]
                 # the stats kernel's sums token-major (sm_90a at `small`: 436 -> 413 instructions a trip, 157 -> 150
                 # registers), or in planes once token-major is the default
                 + [dict(parts_layout="token" if blk.parts_layout == "planes" else "planes")]
                 + [dict(stats_bt=bt, stats_bd=bd, stats_warps=w) for bt in around(blk.stats_tiles()[1])
                         for bd in sorted({blk.stats_tiles()[0], max(64, blk.stats_tiles()[0] // 2)}) for w in (2, 4, 8)
                         if (bt, bd, w) != (*reversed(blk.stats_tiles()), blk.stats_warps)]
                 # one warp a token row (the depth-attention kernels' lesson: reductions over d inside one warp);
                 # at (1, 128) ptxas keeps the stats kernel free of spills at `small` (336 bytes at the default)
                 + [dict(stats_bt=bt, stats_bd=bd, stats_warps=1) for bt, bd in ((1, 128), (1, 256), (2, 128))]
                 + [dict(views_3d=not blk.views_3d, stats_bt=1, stats_bd=128, stats_warps=1)]
                 + [dict(stats_bt=bt, stats_bd=min(512, blk.bd), stats_warps=4) for bt in (2, 4)]  # the tiles before
                 # the serial stats kernel's channel tiles and chunks, or the tile kernel
                 + [dict(stats_mode="tile" if blk.stats_mode == "serial" else "serial")]
                 + [dict(stats_mode="serial", stats_serial_bd=bd, stats_serial_ch=ch)
                    for bd, ch in ((32, 64), (32, 256), (64, 128), (16, 128))
                    if (bd, ch) != (blk.stats_serial_bd, blk.stats_serial_ch)]
                 # the serial stats kernel recomputing the forward's logits and ρ, and its loads a step ahead
                 + [dict(stats_mode="serial", stats_saved=not blk.stats_saved),
                    dict(stats_mode="serial", stats_prefetch=not blk.stats_prefetch),
                    dict(stats_mode="serial", stats_prefetch=not blk.stats_prefetch, stats_serial_bd=64)]
                 # two tokens a trip of the stats kernel (or one, once two are the default)
                 + [dict(stats_mode="serial", stats_pairs=not blk.stats_pairs)],
        "source gradients": [{}] + (serial if blk.src_mode == "serial" else ring),
    }


def run_shape(name: str, S: int, table: Table, kernels: list[str] | None = None,
              only: list[dict] | None = None) -> None:
    from kernels.msar_attn import fused

    B, T, d = SHAPES[name]
    x, taps, q, g, phi, alpha, bias, doc = make_inputs(S, B, T, d, seed=0)
    near = fused.doc_window(doc)
    m = 1 + len(taps)
    packed, ks, m_pad = fused.pack_taps(taps, d, x.device)
    qg = fused.folded_queries(q, g)
    mixer = fused._mixer_params(phi, alpha, bias)
    dh = torch.randn(B, T, d, device=x.device, dtype=x.dtype)
    kw = dict(key_norm=True, eps=1e-6)
    default_blocks = fused._blocks
    base = default_blocks(T, d, m_pad, max(ks))

    def pieces():
        h, lse, _, saved, stats = fused.forward(x, packed, ks, m, qg, near, mixer=mixer, save=True, save_stats=True,
                                                **kw)
        dr, *mix = fused.mixer_backward(dh, saved, mixer, eps=1e-6, sigmoid=True)  # mix: dφ, dα, db
        dx, dtaps, dqg = fused.streams_backward(dr, lse, x, taps, packed, ks, qg, near, stats=stats, **kw)
        return h, lse, saved, dr, (dx, *dtaps, dqg, *mix), stats

    ref_h, ref_lse, ref_saved, ref_dr, ref_grads, ref_stats = pieces()
    def streams():  # the stats and source-gradient kernels run together (streams backward)
        return fused.streams_backward(ref_dr, ref_lse, x, taps, packed, ks, qg, near, stats=ref_stats, **kw)

    timed = {  # as training runs them: the forward saves what the backward reads
        "forward": lambda: fused.forward(x, packed, ks, m, qg, near, mixer=mixer, save=True, save_stats=True, **kw),
        "mixer backward": lambda: fused.mixer_backward(dh, ref_saved, mixer, eps=1e-6, sigmoid=True),
        "stats": streams,
        "source gradients": streams,
    }
    wanted = None if only is None else [dataclasses.replace(base, **o) for o in only]
    matched = set()
    try:
        for kernel, overrides in candidates(base).items():
            if kernels and kernel not in kernels:
                continue
            if wanted is not None:  # the default and the candidates asked for (same tiles, however spelt)
                overrides = [{}] + [o for o in overrides[1:] if dataclasses.replace(base, **o) in wanted]
                matched |= {wanted.index(dataclasses.replace(base, **o)) for o in overrides[1:]}
            for i, over in enumerate([*overrides, {}]):  # the default again last: a first timing reads slow
                blk = dataclasses.replace(base, **over)
                fused._blocks = lambda *_a, _b=blk: _b
                label = ", ".join(f"{k}={v}" for k, v in over.items()) or ("default: " if i == 0 else
                                                                           "default, timed again last: ") + ", ".join(
                    f"{k}={getattr(base, k)}" for k in _fields(kernel))
                try:
                    h, _, _, dr, grads, _ = pieces()
                    err = max(rel_err(h, ref_h), rel_err(dr, ref_dr), *(rel_err(a, b) for a, b in zip(grads, ref_grads)))
                except Exception as exc:  # a tile that does not compile (shared memory, registers)
                    table.add(name, S, kernel, label, f"FAILED: {type(exc).__name__}", "", "")
                    print(f"[{name}] {kernel} {label}: {exc}", flush=True)
                    continue
                if err > 1e-3:
                    table.add(name, S, kernel, label, f"WRONG (rel err {err:.1e})", "", "")
                    continue
                ms = bench_ms(timed[kernel])
                table.add(name, S, kernel, label, "ok", f"{ms:.3f}", f"{err:.0e}")
                print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
    finally:
        fused._blocks = default_blocks
    for i in sorted(set(range(len(only or []))) - matched):
        print(f"[{name}] --only {only[i]} is not a candidate of the groups run: not timed", flush=True)


def parse_candidate(text: str) -> dict:
    """"src_bt=32,sub=8" -> {"src_bt": 32, "sub": 8}: fields of ``fused.Blocks``, values Python literals (a bare word
    is a string: "coef_layout=token")."""
    import ast
    from dataclasses import fields

    from kernels.msar_attn.fused import Blocks

    names = {f.name for f in fields(Blocks)}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in names or not value:
            raise SystemExit(f"error: --only {text!r}: {key!r} is not a field=value of Blocks; fields: {sorted(names)}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _fields(kernel: str) -> tuple[str, ...]:
    return {"forward": ("bt", "bd", "single", "warps"), "mixer backward": ("bwd_bt", "bwd_bd", "mix_warps", "mix_dphi", "mix_walk",
                                                                  "mix_walk_bt", "mix_walk_warps", "dphi_bt", "dphi_bd",
                                                                  "dphi_warps", "dphi_waves", "dphi_late"),
            "stats": ("stats_mode", "stats_serial_bd", "stats_serial_ch", "stats_bt", "stats_bd", "stats_warps",
                      "stats_pairs", "parts_layout"),
            "source gradients": ("src_mode", "serial_ch", "serial_bd", "serial_warps", "serial_prefetch",
                                 "coef_layout", "serial_ahead2", "part_sums", "src_bt", "src_bd", "src_warps",
                                 "sub")}[kernel]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["small"], choices=list(SHAPES))
    p.add_argument("--sources", type=int, default=5)
    p.add_argument("--kernels", nargs="+", default=None,
                   choices=["forward", "mixer backward", "stats", "source gradients"], help="only these groups")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--only", nargs="+", default=None, metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="time only the default and these candidates, e.g. src_bt=32,sub=8 or src_bd=16")
    args = p.parse_args(argv)
    only = None if args.only is None else [parse_candidate(c) for c in args.only]
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.msar_tiles needs a CUDA GPU")
    table = Table("Fused MSAR: tile sizes per kernel", ["shape", "S", "kernel", "tiles", "check", "ms",
                                                        "rel err vs default"])
    table.notes += ["kernels (4, 8, 12), bf16 sources, key RMSNorm, sigmoid fusion; medians of CUDA-event timings",
                    "stats and source gradients are timed together (the streams backward); within each group only "
                    "that kernel's tiles change"]
    for shape in args.shapes:
        run_shape(shape, args.sources, table, args.kernels, only)
    gpu = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")
    table.write(f"msar_tiles_{gpu}{args.tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
