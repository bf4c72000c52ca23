"""How fast a residual could be at best: its fused ops at their roofline over a training step, against vanilla's.

    python -m benchmarks.residual_floor [--models small medium] [--residuals attnres_block mhc msar_block msar]
        [--vanilla-ms small=15.5 medium=154.0] [--fp32-tflops 51.2] [--copy-tbs 4.25] [--ceilings-from TEXT]
        [--plot [--measured small:mhc=0.682 ...] [--card "an H100"]] [--tag _dec2]

Every fused call of one training step (16 rows, as ``benchmarks.throughput`` times it), forward and backward, with
the minimal bytes and the CUDA-core FLOPs its own benchmark counts: MSAR's read per consumer over its S sources
(``benchmarks.msar_attn.op_bytes`` / ``op_flops`` with the residual's kernels), Block AttnRes's phase 1 and merges
per block of consumers (``benchmarks.ops_attnres``), mHC's fused write and read per sublayer
(``benchmarks.ops_mhc.counts``). The sources per consumer come from the residual itself (``n_sources``, on a
meta-device model: sizes only, no memory). A call's floor is the larger of bytes / copy bandwidth and FLOPs / fp32
rate; the step's floor is their sum: the residual's extra time if every kernel ran at its roofline and nothing else
changed. Against vanilla's measured step that gives the best tokens/s ratio these ops can reach,
``vanilla / (vanilla + floor)``, and for each speed target of the fused-ops issue the share of the roofline the
target needs in aggregate, ``floor / (vanilla / target − vanilla)``: above 100% no tile of these kernels reaches it
(fewer bytes or fewer FLOPs would: another formulation, narrower streams, fusion into the sublayer's own kernels).

Defaults: the ceilings measured on an H200 host (``msar_attn_nvidia_h200.md``: copy 4.25 TB/s, fp32 CUDA cores
51.2 TFLOP/s) and vanilla's steps there on 2026-12-02 (``throughput_small_split.md``: 15.5 ms,
``throughput_medium_split_medium.md``: 154.0 ms). Runs on a CPU. Writes ``benchmarks/results/residual_floor{tag}.md``.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 16  # rows a step, as benchmarks.throughput times it
# the speed targets of the fused-ops issue, as fractions of vanilla's tokens/s
TARGETS = {
    ("small", "attnres_block"): 0.93, ("small", "msar_block"): 0.80, ("small", "mhc"): 0.85,
    ("medium", "attnres_block"): 0.97, ("medium", "msar_block"): 0.92, ("medium", "mhc"): 0.93,
    ("medium", "msar"): 0.85,
}
VANILLA_MS = {"small": 15.5, "medium": 154.0}  # H200, 2026-12-02, beside msar_block in one process
# the latest measured tokens/s ratios to vanilla on the H200 (same process), for the plot: (ratio, results file); a row's
# key is its name with its overrides, as passed to --residuals
MEASURED = {
    # the latest H200 ratio of each row; the closing tables of 2026-12-05 (last session) where they have it
    ("small", "attnres_block"): (0.945, "throughput_small_closing_h200.md"),
    ("small", "mhc"): (0.579, "throughput_small_closing_h200.md"),
    # mHC's streams are bf16 under autocast by default since 2026-12-05 ("mhc"), fp32 before
    ("small", "mhc@residual.stream_dtype=fp32@residual.recompute_every=0"): (0.545, "throughput_small_mhc3.md"),
    ("small", "mhc@residual.recompute_every=0"): (0.588, "throughput_small_mhc3.md"),
    ("small", "msar_block"): (0.424, "throughput_small_closing_h200.md"),
    # msar's sources are bf16 under autocast by default since 2026-12-05 (night); these ratios are fp32 sources'
    ("small", "msar@residual.source_dtype=stream"): (0.213, "throughput_small_lean3.md"),
    ("medium", "attnres_block"): (0.970, "throughput_medium_closing_h200.md"),
    ("medium", "mhc@residual.stream_dtype=fp32"): (0.617, "throughput_medium_mhc_recompute.md"),
    ("medium", "mhc@residual.stream_dtype=fp32@residual.recompute_every=0"): (
        0.639, "throughput_medium_mhc_recompute.md"),
    ("medium", "mhc"): (0.691, "throughput_medium_closing_h200.md"),
    ("medium", "mhc@residual.recompute_every=0"): (0.690, "throughput_medium_mhc2.md"),
    ("medium", "msar_block"): (0.449, "throughput_medium_closing_h200.md"),
    ("medium", "msar@residual.source_dtype=stream"): (0.168, "throughput_medium_medium_all.md"),
}


def row_parts(residual: str) -> tuple[str, tuple[str, ...]]:
    """A row of --residuals as (registered residual, its own overrides): ``mhc@residual.stream_dtype=bf16`` ->
    ("mhc", ("residual.stream_dtype=bf16",)), the convention of ``benchmarks.throughput``'s rows."""
    name, *own = residual.split("@")
    return name, tuple(own)


def stored_bytes(res) -> int:
    """Bytes an element of what the residual's fused ops stream (mHC's streams, MSAR's sources), as `trainer=gpu`
    trains (bf16 autocast, an fp32 stream), resolved as the residuals resolve them (``residuals.base.stored_dtype``
    over mHC's ``STREAM_DTYPES``, the depth-attention residuals' ``SOURCE_DTYPES``) under bf16 autocast."""
    import torch

    from residuals.attnres import SOURCE_DTYPES
    from residuals.base import stored_dtype
    from residuals.mhc import MHC, STREAM_DTYPES

    setting = res.cfg.stream_dtype if isinstance(res, MHC) else getattr(res.cfg, "source_dtype", "stream")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as trainer=gpu trains
        dtype = stored_dtype(setting, STREAM_DTYPES if isinstance(res, MHC) else SOURCE_DTYPES, "cpu")
    return (dtype or torch.float32).itemsize


def step_calls(res, tokens: int, d: int) -> list[tuple[str, float, float]]:
    """(call, minimal bytes, CUDA-core FLOPs) of every fused call of one step, forward + backward, with the streams'
    or sources' element width of the residual's config (``stored_bytes``)."""
    from residuals.attnres_block import AttnResBlock
    from residuals.mhc import MHC
    from residuals.msar import Msar

    elt = stored_bytes(res)
    if isinstance(res, Msar):  # msar, msar_block: one fused read (views, softmax, mixer) per consumer
        from benchmarks.msar_attn import op_bytes, op_flops

        m, kernels = res.n_views, tuple(res.cfg.kernels)
        return [(f"read {c} (S={res.n_sources(c)})", op_bytes(res.n_sources(c), 1, tokens, d, m, elt)[1],
                 op_flops(res.n_sources(c), 1, tokens, d, m, kernels)[1]) for c in range(res.n_consumers)]
    if isinstance(res, AttnResBlock):  # one phase 1 + merges per block of consumers, over the completed summaries
        from benchmarks.ops_attnres import flops, minimal_bytes

        size, out = res.cfg.block_size, []
        for first in range(0, res.n_consumers, size):
            consumers = min(size, res.n_consumers - first)
            n = res.n_sources(first)  # b_0 and the completed summaries (the partial is merged, not attended)
            out.append((f"block {first // size} (n={n}, C={consumers})", minimal_bytes(n, consumers, tokens, d)[1],
                        flops(n, consumers, tokens, d)[1]))
        return out
    if isinstance(res, MHC):  # the write fused with the next read, per sublayer
        from benchmarks.ops_mhc import counts

        import torch

        table = counts(tokens, res.cfg.n, d, elt)
        nbytes, nflops = table["post+pre fwd+bwd"]
        # with the streams kept every L_r sublayers (as trained on a GPU), backward rebuilds the others: one write each
        every = res.stream_recompute_every(torch.device("cuda"))
        rebuilt = 0 if not every else sum(i % every != 0 for i in range(res.n_sublayers))
        calls = [(f"sublayer {i}", nbytes, nflops) for i in range(res.n_sublayers)]
        return calls + ([(f"{rebuilt} streams rebuilt (L_r = {every})", rebuilt * table["post"][0],
                          rebuilt * table["post"][1])] if rebuilt else [])
    raise SystemExit(f"error: residual {res.cfg.name!r} has no fused-op cost model here; supported: msar, "
                     "msar_block, attnres_block, mhc")


def floor(model: str, residual: str, fp32_tflops: float, copy_tbs: float) -> dict:
    """The step's fused calls at their roofline (see the module docstring)."""
    from platform.accounting import meta_model

    name, own = row_parts(residual)  # a row's own overrides: mhc@residual.stream_dtype=bf16
    net, cfg = meta_model(model, name, extra_overrides=own)
    tokens = BATCH * cfg.model.seq_len
    calls = step_calls(net.residual, tokens, cfg.model.d_model)
    byte_ms = [b / (copy_tbs * 1e12) * 1e3 for _, b, _ in calls]
    flop_ms = [f / (fp32_tflops * 1e12) * 1e3 for _, _, f in calls]
    arith_bound = sum(f >= b for b, f in zip(byte_ms, flop_ms))
    return {"sublayers": 2 * cfg.model.n_blocks, "calls": len(calls), "gb": sum(b for _, b, _ in calls) / 1e9,
            "gflop": sum(f for _, _, f in calls) / 1e9, "bytes_ms": sum(byte_ms), "flops_ms": sum(flop_ms),
            "floor_ms": sum(max(b, f) for b, f in zip(byte_ms, flop_ms)),
            "binds": f"arithmetic {arith_bound} / bytes {len(calls) - arith_bound}"}


def packed_bf16_view_error(k: int, d: int = 512, T: int = 4096, seed: int = 0) -> dict[str, float]:
    """Relative error (against fp64) of one MSAR view E = Σ_τ c_τ ⊙ x[t-τ] over bf16 sources when every
    multiply-add is a packed bf16 one (taps in bf16, each step rounded to bf16: what would double the CUDA cores'
    rate), against fp32 accumulation and against one bf16 rounding of the exact view."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T + k, d, generator=g).bfloat16().double()
    c = torch.randn(k, d, generator=g).double() * 0.5
    exact = sum(c[t] * x[k - t: k - t + T] for t in range(k))
    fp32 = torch.zeros(T, d)
    packed = torch.zeros(T, d)
    cb = c.float().bfloat16().float()
    for t in range(k):
        fp32 = fp32 + c[t].float() * x[k - t: k - t + T].float()
        packed = torch.addcmul(packed, cb[t].expand(T, d), x[k - t: k - t + T].float()).bfloat16().float()

    def rel(a):
        return ((a.double() - exact).norm() / exact.norm()).item()

    return {"fp32": rel(fp32), "packed bf16": rel(packed), "one bf16 rounding": rel(exact.float().bfloat16())}


SHORT = {"residual.stream_dtype": "streams", "residual.recompute_every": "L_r", "residual.source_dtype": "sources"}


def bar_label(residual: str, model: str) -> str:
    """A bar's label: the residual, each of the row's overrides on a line of its own (short names from ``SHORT``,
    else without the ``residual.`` prefix), and the model (``mhc@residual.stream_dtype=bf16`` at small:
    ``mhc / streams=bf16 / small``)."""
    name, own = row_parts(residual)
    lines = []
    for item in own:
        key, _, value = item.partition("=")
        lines.append(f"{SHORT.get(key, key.removeprefix('residual.'))}={value}")
    return "\n".join([name, *lines, model])


def plot(points: list[dict], path: Path, card: str = "an H200") -> None:
    """Bars per (model, residual): the latest measured ratio to vanilla, the best ratio at the floor, and the
    target as a tick: where a target sits above the floor's bar, no tile reaches it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(10.0, 0.9 * len(points)), 4.6))
    width = 0.38
    for i, p in enumerate(points):
        if p["measured"] is not None:
            ax.bar(i - width / 2, p["measured"], width, color="#4c72b0", label="measured" if i == 0 else None)
        ax.bar(i + width / 2, p["best"], width, color="#bbbbbb", label="at the roofline (floor)" if i == 0 else None)
        if p["target"] is not None:
            ax.hlines(p["target"], i - 0.45, i + 0.45, colors="#c44e52", linewidth=2.5,
                      label="target" if not any(q["target"] for q in points[:i]) else None)
    ax.set_xticks(range(len(points)), [bar_label(p["residual"], p["model"]) for p in points], fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_ylabel("tokens/s vs vanilla")
    ax.set_title(f"Residuals on {card}: measured, best possible with these ops, and the targets")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_measured(items: list[str]) -> dict[tuple[str, str], tuple[float, str]]:
    """--measured MODEL:RESIDUAL=RATIO ... as MEASURED's (model, residual) -> (ratio, source) entries."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        model, _, residual = key.partition(":")
        try:
            ratio = float(value)
        except ValueError:
            ratio = None
        if not model or not residual or ratio is None or not 0 < ratio <= 2:
            raise SystemExit(f"error: --measured {item!r}: expected MODEL:RESIDUAL=RATIO with a ratio in (0, 2], "
                             "e.g. small:mhc=0.682")
        out[(model, residual)] = (ratio, "--measured")
    return out


def parse_ms(items: list[str]) -> dict[str, float]:
    out = dict(VANILLA_MS)
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"error: --vanilla-ms {item!r}: expected MODEL=MS, e.g. small=15.5") from None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["small", "medium"])
    p.add_argument("--residuals", nargs="+", default=["attnres_block", "mhc", "msar_block", "msar"])
    p.add_argument("--vanilla-ms", nargs="*", default=[], metavar="MODEL=MS",
                   help="vanilla's measured step per model (defaults: "
                        + ", ".join(f"{k}={v}" for k, v in VANILLA_MS.items()) + ")")
    p.add_argument("--fp32-tflops", type=float, default=51.2)
    p.add_argument("--copy-tbs", type=float, default=4.25)
    p.add_argument("--bf16-views", action="store_true",
                   help="also the error of MSAR's views with packed bf16 multiply-adds (twice the fp32 rate) and the "
                        "floors at that rate")
    p.add_argument("--plot", action="store_true", help="also draw residual_floor{tag}.png: measured (the latest "
                   "H200 ratios, MEASURED), at the floor, and the targets")
    p.add_argument("--measured", nargs="*", default=[], metavar="MODEL:RESIDUAL=RATIO",
                   help="the plot's measured ratios, for ceilings other than the H200's (e.g. small:mhc=0.682); "
                        "default: MEASURED, the H200's")
    p.add_argument("--card", default="an H200", help="the card named in the plot's title (default: %(default)s)")
    p.add_argument("--ceilings-from", default="an H200 host (msar_attn_nvidia_h200.md)",
                   help="where the ceilings and vanilla's steps were measured, for the table's header (the defaults': "
                        "%(default)s)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    measured = parse_measured(args.measured) if args.measured else MEASURED
    h200 = (p.get_default("copy_tbs"), p.get_default("fp32_tflops"))  # MEASURED's card's ceilings
    if args.plot and not args.measured and (args.copy_tbs, args.fp32_tflops) != h200:
        raise SystemExit("error: --plot draws the H200's measured ratios (MEASURED) beside the floors; with other "
                         f"ceilings (--copy-tbs {args.copy_tbs}, --fp32-tflops {args.fp32_tflops}) pass that card's "
                         "ratios with --measured MODEL:RESIDUAL=RATIO ..., or leave --plot off")
    import residuals

    unknown = [r for r in args.residuals if row_parts(r)[0] not in residuals.names()]
    if unknown:
        raise SystemExit(f"error: unknown residual(s) {unknown}; registered: {', '.join(residuals.names())}")
    vanilla = parse_ms(args.vanilla_ms)
    missing = [m for m in args.models if m not in vanilla]
    if missing:
        raise SystemExit(f"error: no vanilla step for model(s) {missing}: pass --vanilla-ms MODEL=MS")

    rows = ["| model | residual | fused calls | GB | GFLOP | at copy bandwidth ms | at fp32 rate ms | calls bound by | "
            "floor ms | vanilla ms | best ratio | target | share of the roofline the target needs |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    points = []
    for model in args.models:
        for residual in args.residuals:
            f = floor(model, residual, args.fp32_tflops, args.copy_tbs)
            v = vanilla[model]
            target = TARGETS.get((model, row_parts(residual)[0]))  # a row's overrides keep its residual's target
            points.append({"model": model, "residual": residual, "best": v / (v + f["floor_ms"]), "target": target,
                           "measured": measured.get((model, residual), (None,))[0]})
            need = "" if target is None else f"**{100 * f['floor_ms'] / (v / target - v):.0f}%**"
            rows.append(f"| {model} (L={f['sublayers']}) | {residual} | {f['calls']} | {f['gb']:.2f} | "
                        f"{f['gflop']:.1f} | {f['bytes_ms']:.2f} | {f['flops_ms']:.2f} | {f['binds']} | "
                        f"{f['floor_ms']:.2f} | {v:g} | {v / (v + f['floor_ms']):.3f} | "
                        f"{'' if target is None else f'{target:.2f}'} | {need} |")
    if args.bf16_views:
        rows += ["", "Views with packed bf16 multiply-adds (relative error against fp64 of one view over bf16 sources, "
                 "d = 512, 4096 tokens), and the MSAR floors at twice the fp32 rate:", "",
                 "| kernel size k | fp32 accumulation | packed bf16 | one bf16 rounding of the exact view |",
                 "|---:|---:|---:|---:|"]
        for k in (4, 8, 12):
            e = packed_bf16_view_error(k)
            rows.append(f"| {k} | {e['fp32']:.1e} | {e['packed bf16']:.1e} | {e['one bf16 rounding']:.1e} |")
        rows += ["", "| model | residual | floor ms at twice the rate | best ratio | target | share needed |",
                 "|---|---|---:|---:|---:|---:|"]
        for model in args.models:
            for residual in (r for r in args.residuals if r.startswith("msar")):
                f = floor(model, residual, 2 * args.fp32_tflops, args.copy_tbs)
                v, target = vanilla[model], TARGETS.get((model, row_parts(residual)[0]))
                need = "" if target is None else f"{100 * f['floor_ms'] / (v / target - v):.0f}%"
                rows.append(f"| {model} | {residual} | {f['floor_ms']:.2f} | {v / (v + f['floor_ms']):.3f} | "
                            f"{'' if target is None else f'{target:.2f}'} | {need} |")
    shown = shlex.join(argv if argv is not None else sys.argv[1:])  # quoted where an argument has spaces
    text = "\n".join([
        "# The residuals' fused ops at their roofline, over a training step",
        "",
        f"- command: `python -m benchmarks.residual_floor {shown}`".replace(" `", " `"),
        f"- date {datetime.date.today()}; counted, not timed (no GPU): every fused call of a step of {BATCH} rows, "
        "forward + backward, with the minimal bytes and CUDA-core FLOPs of its op benchmark; ceilings "
        f"{args.copy_tbs} TB/s copy and {args.fp32_tflops} TFLOP/s fp32, measured on {args.ceilings_from}; "
        "vanilla's step measured there",
        "- floor = Σ over calls of max(bytes / copy bandwidth, FLOPs / fp32 rate); best ratio = vanilla / (vanilla + "
        "floor); share needed = floor / (vanilla / target − vanilla): above 100% no tile of these kernels reaches the "
        "target",
        "", *rows, ""])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"residual_floor{args.tag}.md"
    out.write_text(text)
    print(f"written: {out}")
    if args.plot:
        png = RESULTS / f"residual_floor{args.tag}.png"
        plot(points, png, args.card)
        print(f"written: {png} (measured: " + "; ".join(f"{m} {r} {v} {src}" for (m, r), (v, src) in measured.items())
              + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
