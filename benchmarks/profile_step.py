"""Where a training step's time goes, per residual: the top operators of one step by GPU time.

    python -m benchmarks.profile_step --model small --residuals vanilla attnres_block msar_block mhc
    python -m benchmarks.profile_step --model small --residuals vanilla --ablations attnres_conv wo_conv
    python -m benchmarks.profile_step --model small --residuals vanilla msar_block mhc --graphs on
    python -m benchmarks.profile_step --residuals attnres_block \
        attnres_block@py:residuals.attnres_block.AttnResBlock.phase1_dtype=stream --graphs on

The same step as `benchmarks.throughput` (bf16 autocast, compiled sublayers by default, fused AdamW,
routing-bias update), profiled with `torch.profiler` after warm-up: per residual, the step's GPU
time and host time, the number of kernel launches, and the operators with the most self GPU time
(CUDA kernels and the Python-side ops that launch them). The difference to vanilla's table is the
residual's cost; a step whose GPU time is much smaller than its wall time is bound by the host
(launches, Python, synchronisations), not by its kernels. ``--graphs on`` profiles the step as
`trainer.cuda_graphs` runs it (forward and backward replayed; the kernels inside the graphs are
listed as usual). A residual may carry its own overrides after ``@``, config or ``py:`` code settings, as in
`benchmarks.throughput`. Writes benchmarks/results/profile_step_<model>[_graphs].md via `roofline.Table`, and
beside it ``..._kinds.md``: every kernel of the step sorted into kinds (the residual kernels of `kernels/`, GEMMs,
attention, Inductor's generated kernels, copies and casts, the optimizer, other ATen kernels), the GPU ms of each kind
per residual and its difference to the first residual's: where a residual's extra step time goes.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.roofline import Table, held
from benchmarks.throughput import build, code_settings, run_names, training_step

KINDS = ["residual kernels (kernels/)", "GEMMs", "attention", "Inductor (compiled glue)", "copies and casts (ATen)",
         "optimizer and gradient norm", "other ATen kernels"]


def residual_kernel_names() -> set[str]:
    """The names of the Triton kernels of `kernels/` (a profiled kernel carries its function's name)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface  # a JIT function, its interpreted twin, an autotuner

    import kernels

    names = set()
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        if info.name.endswith(".fused"):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if isinstance(obj, KernelInterface) and name.endswith("_kernel"):
                    names.add(name)
    return names


def kind_of(kernel: str, ours: set[str]) -> str:
    """The kind of one CUDA kernel, by its name (as `torch.profiler` reports it)."""
    low = kernel.lower()
    if kernel in ours:
        return KINDS[0]
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "cublas", "splitkreduce", "xmma")):
        return KINDS[1]
    if "flash" in low or "attention" in low:
        return KINDS[2]
    if low.startswith("triton_"):
        return KINDS[3]
    if "adam" in low or "multi_tensor_apply" in low or "foreach" in low:
        return KINDS[5]
    if "copy" in low or "cast" in low:
        return KINDS[4]
    return KINDS[6]


def by_kind(kernels: list[tuple[str, int, float]], ours: set[str]) -> dict[str, tuple[int, float]]:
    """(launches, GPU ms) per kind, from (kernel name, launches, GPU ms) rows."""
    out = {k: (0, 0.0) for k in KINDS}
    for name, calls, ms in kernels:
        kind = kind_of(name, ours)
        n, t = out[kind]
        out[kind] = (n + calls, t + ms)
    return out


def profile(model_name: str, residual: str, batch: int, vocab: int, compile_mode: str, top: int,
            graphs: bool = False, overrides: list[str] = ()) -> tuple[dict, list]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.manual_seed(0)
    model, cfg = build(model_name, residual, vocab, list(overrides), "cuda")
    if compile_mode != "off":  # on: trainer.compile_scope=sublayers; model: the whole forward
        model.compile_as("model" if compile_mode == "model" else "sublayers", dict(cfg.trainer.compile_options))
    step = training_step(model, batch, cfg.model.seq_len, vocab, "cuda", graphs=graphs)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.device_type.name == "CUDA")
    rows = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    summary = {"wall_ms": start.elapsed_time(end), "gpu_ms": device_us / 1e3, "launches": launches,
               "kernels": [(e.key, e.count, e.self_device_time_total / 1e3) for e in events
                           if e.device_type.name == "CUDA"]}
    return summary, [(e.key[:90], e.count, e.self_device_time_total / 1e3) for e in rows]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--residuals", nargs="+", default=["vanilla", "attnres_block", "msar_block", "mhc"])
    p.add_argument("--ablations", nargs="*", default=[], help="registered ablations, profiled after the residuals")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--compile", choices=["on", "off", "model"], default="on",
                   help="on: the sublayers and the loss (trainer.compile); model: the whole forward below the mask")
    p.add_argument("--graphs", choices=["on", "off"], default="off", help="on: as trainer.cuda_graphs runs the step")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. +trainer.compile_options.combo_kernels=true")
    p.add_argument("--tag", default="", help="appended to the result file's name")
    args = p.parse_args(argv)
    runs = run_names(args.residuals, args.ablations)  # unknown names fail here, before any GPU work
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.profile_step needs a CUDA GPU")
    table = Table(f"Where a training step's time goes ({args.model}, batch {args.batch}, compile {args.compile}, "
                  f"CUDA graphs {args.graphs})",
                  ["residual", "step wall ms", "step GPU ms (sum of kernels)", "kernel launches", "op", "calls",
                   "self GPU ms"],
                  notes=["one profiled step after 3 warm-up steps; the op rows are the top operators by self GPU "
                         "time (kernels and the ops that launch them)"]
                  + ([f"overrides: {' '.join(args.set)}"] if args.set else []))
    ours, kinds = residual_kernel_names(), {}
    for residual in runs:
        with held(code_settings(residual)):  # a row's py: settings (as benchmarks.throughput), for that row alone
            summary, rows = profile(args.model, residual, args.batch, args.vocab, args.compile, args.top,
                                    graphs=args.graphs == "on", overrides=args.set)
        print(f"{residual}: {summary}", flush=True)
        for i, (name, calls, ms) in enumerate(rows):
            head = ([residual, f"{summary['wall_ms']:.1f}", f"{summary['gpu_ms']:.1f}", str(summary["launches"])]
                    if i == 0 else ["", "", "", ""])
            table.add(*head, f"`{name}`", str(calls), f"{ms:.2f}")
        kinds[residual] = by_kind(summary.get("kernels", []), ours)
        torch.cuda.empty_cache()
    name = f"profile_step_{args.model}" + ("_graphs" if args.graphs == "on" else "") + args.tag
    table.write(name)
    kinds_table(kinds, table.title, table.notes).write(name + "_kinds")


def kinds_table(kinds: dict[str, dict[str, tuple[int, float]]], title: str, notes: list[str]) -> Table:
    """GPU ms (launches) of each kind of kernel per residual, and each residual's difference to the first's."""
    runs = list(kinds)
    first = runs[0]
    table = Table(title + ": the step's kernels by kind",
                  ["kind", *[f"{r} ms (launches)" for r in runs], *[f"{r} − {first} ms" for r in runs[1:]]],
                  notes=[*notes, "kinds by kernel name (benchmarks.profile_step.kind_of); the GPU ms of a kind is the "
                                 "sum of its kernels' self GPU time in the profiled step"])
    for kind in [*KINDS, "all"]:
        cell = {r: (sum(n for n, _ in kinds[r].values()), sum(t for _, t in kinds[r].values())) if kind == "all"
                else kinds[r][kind] for r in runs}
        table.add(kind if kind != "all" else "**all**", *[f"{cell[r][1]:.2f} ({cell[r][0]})" for r in runs],
                  *[f"{cell[r][1] - cell[first][1]:+.2f}" for r in runs[1:]])
    return table


if __name__ == "__main__":
    main()
