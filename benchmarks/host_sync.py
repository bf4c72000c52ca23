"""Is a training step bound by the host, and does anything in it wait for the GPU?

    python -m benchmarks.host_sync --model small --residuals vanilla attnres_block mhc

The same step as `benchmarks.profile_step` (bf16 autocast, compiled sublayers, fused AdamW,
routing-bias update), without the profiler (whose per-op bookkeeping inflates host time). Per
residual, after warm-up:

- host ms: time for Python to enqueue one step (no synchronisation inside the timed region unless
  the step itself synchronises); wall ms: the same steps until the GPU is done. host ≈ wall means
  the GPU waits for the host.
- syncs: calls that made the host wait for the GPU during one step, caught by
  ``torch.cuda.set_sync_debug_mode("warn")`` (``.item()``, ``.tolist()``, ``.cpu()``, a
  ``nonzero``, a copy to pageable memory, ...), with the Python line that made each one.

Writes benchmarks/results/host_sync_<model>.md.
"""

from __future__ import annotations

import argparse
import time
import traceback
import warnings
from collections import Counter

import torch

from benchmarks.roofline import Table
from benchmarks.throughput import build, training_step

REPO_FRAMES = ("/residuals/", "/kernels/", "/platform/", "/benchmarks/")


def _caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of this repository (where the synchronising call was made)."""
    for frame in reversed(stack):
        if any(p in frame.filename for p in REPO_FRAMES) and not frame.filename.endswith("host_sync.py"):
            return f"{frame.filename.split('/')[-2]}/{frame.filename.split('/')[-1]}:{frame.lineno}"
    return f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "?"


def measure(model_name: str, residual: str, batch: int, vocab: int, steps: int) -> dict:
    torch.manual_seed(0)
    model, cfg = build(model_name, residual, vocab, [], "cuda")
    model.compile_sublayers()
    step = training_step(model, batch, cfg.model.seq_len, vocab, "cuda")

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps

    syncs: Counter = Counter()

    def keep(message, category, filename, lineno, file=None, line=None):
        syncs[(_caller(traceback.extract_stack()[:-1]), str(message).split("\n")[0][:60])] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = keep
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"host_ms": host * 1e3, "wall_ms": wall * 1e3, "syncs": syncs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--residuals", nargs="+", default=["vanilla", "attnres_block", "mhc"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.host_sync needs a CUDA GPU")
    table = Table(f"Host time and synchronisations of a training step ({args.model}, batch {args.batch})",
                  ["residual", "host ms/step", "wall ms/step", "syncs in one step", "where (repo line)", "what"],
                  notes=[f"mean of {args.steps} steps after 3 warm-up steps, no profiler; syncs: "
                         "torch.cuda.set_sync_debug_mode('warn') over one more step"])
    for residual in args.residuals:
        r = measure(args.model, residual, args.batch, args.vocab, args.steps)
        print(f"{residual}: host {r['host_ms']:.1f} ms, wall {r['wall_ms']:.1f} ms, "
              f"{sum(r['syncs'].values())} syncs", flush=True)
        rows = r["syncs"].most_common() or [(("-", "-"), 0)]
        for i, ((where, what), count) in enumerate(rows):
            head = ([residual, f"{r['host_ms']:.1f}", f"{r['wall_ms']:.1f}", str(sum(r["syncs"].values()))]
                    if i == 0 else ["", "", "", ""])
            table.add(*head, f"`{where}` ×{count}", f"`{what}`")
        torch.cuda.empty_cache()
    table.write(f"host_sync_{args.model}")


if __name__ == "__main__":
    main()
