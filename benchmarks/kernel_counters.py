"""A few launches of the residuals' fused kernels at `small`, for a hardware-counter profiler (CUDA).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        -k regex:'^_pre_' -c 4 python -m benchmarks.kernel_counters --ops mhc

    python -m benchmarks.kernel_counters --summarize ncu_mhc.txt ncu_msar.txt --tag _h200

Runs ITERS forward+backward passes of each op in ``--ops`` and exits: no timing loop, so a profiler that
replays every launch it captures finishes in seconds. ``mhc``: one sublayer's fused read and write
(``kernels.mhc``: mhc_pre, mhc_post) on bf16 streams, n = 4. ``msar``: the fused MSAR read
(``kernels.msar_attn.msar``) over S = 5 bf16 sources with kernels (4, 8, 12) and the mixer. ``attnres``: one
block of Block AttnRes (phase 1 over 5 summaries, 3 merges). ``attnres_medium``: the same at `medium`'s width over 8
summaries (B = 16, T = 2048, d = 1024: the split phase-1 backward, ``fused.split_backward``). Shapes as in ``benchmarks.ops_mhc``,
``benchmarks.msar_attn`` and ``benchmarks.ops_attnres`` (B = 16, T = 1024, d = 512), inputs from their
``make_inputs``; every gradient is taken with a random upstream gradient.

``--summarize`` (no GPU needed) reads the profiler's text reports and writes one table, a row per kernel
launch: duration, DRAM and L1/shared throughput (% of peak), registers, achieved occupancy and the
issue rate, to benchmarks/results/kernel_counters<tag>.md.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

OPS = ("mhc", "msar", "attnres", "attnres_medium")
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


def run_attnres(iters: int, n: int = 5, b: int = B, t: int = T, d: int = D) -> None:
    from benchmarks import ops_attnres

    sources, partials, queries, gains = ops_attnres.make_inputs(n, 4, b, t, d)
    leaves = ops_attnres.leaves_of(sources, partials, queries, gains)
    for _ in range(iters):
        hs = ops_attnres.run_fused(sources, partials, queries, gains)
        torch.autograd.grad(hs, leaves, grad_outputs=[torch.randn_like(h) for h in hs])


METRICS = {"Duration": "duration", "DRAM Throughput": "DRAM %", "L1/TEX Cache Throughput": "L1/shared %",
           "Registers Per Thread": "registers", "Achieved Occupancy": "occupancy %",
           "Active Warps Per Scheduler": "warps a scheduler", "Eligible Warps Per Scheduler": "eligible",
           "Issued Warp Per Scheduler": "issued / cycle"}
STALL = "top stall (share of the cycles between issues)"
# the profiler's Warp State Statistics advice names the largest stall reason and its share, wrapped over lines
_STALL = re.compile(r"being stalled (.+?)\. .*?This stall type represents about ([\d.]+)% of the total", re.S)


def parse_report(text: str) -> list[dict[str, str]]:
    """One dict per profiled launch of a text report: its kernel, grid x block, METRICS (with units) and, where the
    profiler's advice names it, its top stall reason with its share (``STALL``)."""
    launches: list[dict[str, str]] = []
    bodies: list[list[str]] = []
    for line in text.splitlines():
        head = re.match(r"^  (\w+) \(([\d, ]+)\)x\(([\d, ]+)\), Context", line)
        if head:
            grid = "×".join(x.strip() for x in head.group(2).split(",") if x.strip() != "1") or "1"
            launches.append({"kernel": head.group(1), "grid × block": f"{grid} × {head.group(3).split(',')[0]}"})
            bodies.append([])
            continue
        cells = line.split()
        if launches and cells:
            bodies[-1].append(line.strip())
            for name, key in METRICS.items():
                if line.strip().startswith(name + " ") and key not in launches[-1]:
                    value, unit = cells[-1], cells[-2] if len(cells) >= 2 + len(name.split()) else ""
                    launches[-1][key] = f"{value} {unit}" if key == "duration" else value
    for launch, body in zip(launches, bodies):
        stall = _STALL.search(" ".join(body))
        if stall:  # "waiting for a scoreboard dependency on a L1TEX (local, ...) operation" without the parentheses
            reason = re.sub(r"\s*\([^)]*\)", "", re.sub(r"\s+", " ", stall.group(1)))
            launch[STALL] = f"{stall.group(2)}%: {reason}"
    return launches


def summarize(paths: list[str], tag: str) -> Path:
    from benchmarks.roofline import Table

    table = Table("Hardware counters of the residuals' fused kernels (Nsight Compute)",
                  ["report", "kernel", "grid × block", *METRICS.values(), STALL],
                  notes=["reports: " + ", ".join(Path(p).name for p in paths) + " (the GPU line above is the machine "
                         "that tabulated them; each report's own device and command follow)",
                         "DRAM / L1-shared: throughput in % of the unit's peak; a kernel whose L1/shared column is "
                         "high and DRAM low is bound by on-chip traffic (shared-memory reductions, layout "
                         "conversions), not by HBM"])
    for path in paths:
        text = Path(path).read_text()
        first = text.splitlines()[0] if text else ""
        cc = re.search(r"Device \d+, CC ([\d.]+)", text)
        table.notes.append(f"{Path(path).stem}: profiled on a GPU of compute capability {cc.group(1) if cc else '?'}"
                           + (f", {first.lstrip('# ')}" if first.startswith("# `") else ""))
        for launch in parse_report(text):
            table.add(Path(path).stem, launch["kernel"], launch["grid × block"],
                      *(launch.get(k, "") for k in (*METRICS.values(), STALL)))
    return table.write(f"kernel_counters{tag}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--summarize", nargs="+", metavar="REPORT", help="profiler text reports to tabulate (no GPU)")
    p.add_argument("--tag", default="", help="suffix of the summary's file name")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.tag).read_text())
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_counters needs a CUDA GPU")
    for op in args.ops:
        {"mhc": run_mhc, "msar": run_msar, "attnres": run_attnres,
         "attnres_medium": lambda iters: run_attnres(iters, n=8, b=16, t=2048, d=1024)}[op](args.iters)
        torch.cuda.synchronize()
        print(f"{op}: {args.iters} forward+backward passes", flush=True)


if __name__ == "__main__":
    main()
