"""MSAR's fused read over buffered sources against the same read over a list of sources, on a CUDA GPU.

    python -m benchmarks.msar_buffered [--shapes small medium] [--sources 5 9] [--readers 2]

What Block MSAR does around one block, in ONE process (so the two are timed side by side): S - 1 completed
sources and the open block's partial, read by ``readers`` consumers (each its own queries, taps and mixer),
forward and backward, from leaf tensors in bf16. Two ways:

- ``list``: the sources as a list of tensors; the op stacks them into one (S, B, T, d) tensor per read, in the
  forward and again in the backward, and autograd sums each source's gradient over the readers;
- ``buffered``: the completed sources written once into a ``SourceBuffer`` (its appends are timed too) and
  read in place with the partial (``BufferedSources``); the source-gradient kernel adds every row's gradient
  into the buffer's ``RowGradients``, and each row's store hands the finished sum on.

Before timing, the gradients of every leaf of the two are compared (they must agree to bf16 rounding).
Minimal bytes of one read (forward + backward, as ``benchmarks.msar_attn`` counts them) give the achieved
bandwidth against the measured copy bandwidth. The table goes to benchmarks/results/msar_buffered_<gpu>.md
with the command, the GPU and the date.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from benchmarks.msar_attn import KERNELS, SHAPES, make_inputs, op_bytes
from benchmarks.roofline import Table, bench_ms, copy_bandwidth


def make_case(S: int, B: int, T: int, d: int, readers: int, seed: int = 0, device: str = "cuda"):
    """Leaves: S sources (B, T, d) bf16, and per reader (taps, queries, gains, φ, α, b) fp32, each reader's from
    ``benchmarks.msar_attn.make_inputs`` with its own seed; doc ids; the upstream gradient of every reader's h."""
    def leaf(t):
        return t.detach().requires_grad_()

    x, *_, doc_ids = make_inputs(S, B, T, d, seed, device=device)
    sources = [leaf(v) for v in x.unbind(0)]
    params = []
    for r in range(readers):
        _, taps, *rest, _ = make_inputs(1, 1, 1, d, seed + 1 + r, device=device)
        params.append(([leaf(c) for c in taps], *map(leaf, rest)))
    g = torch.Generator(device=device).manual_seed(seed)
    dh = [torch.randn(B, T, d, device=device, generator=g).to(torch.bfloat16) for _ in range(readers)]
    return sources, params, doc_ids, dh


def step(mode: str, sources, params, doc_ids, dh):
    """Forward and backward of every reader over the sources; returns nothing (gradients in the leaves)."""
    from kernels.depth_attn import SourceBuffer
    from kernels.msar_attn import BufferedSources, msar

    *done, partial = sources
    if mode == "buffered":
        buf = SourceBuffer(len(done), done[0])
        for v in done:
            buf.append(v)
        xs = BufferedSources(buf, buf.rows, partial)
    else:
        xs = [*done, partial]
    outs = [msar(xs, taps, q, g, doc_ids, phi, alpha, bias, backend="triton")
            for taps, q, g, phi, alpha, bias in params]
    torch.autograd.backward(outs, dh)


def leaves(sources, params):
    return [*sources, *(t for taps, *rest in params for t in (*taps, *rest))]


def grads(mode, case) -> list[torch.Tensor]:
    sources, params, doc_ids, dh = case
    for t in leaves(sources, params):
        t.grad = None
    step(mode, *case)
    return [t.grad.float().clone() for t in leaves(sources, params)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["small"], choices=list(SHAPES))
    p.add_argument("--sources", nargs="+", type=int, default=[5, 9])
    p.add_argument("--readers", type=int, default=2, help="consumers reading the same sources (a block's sublayers)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.msar_buffered times CUDA kernels; no CUDA device here")
    bw = copy_bandwidth()
    table = Table(f"MSAR's fused read: buffered sources against a list ({a.readers} readers a set of sources)",
                  ["shape", "S", "sources", "max rel grad diff", "ms (fwd+bwd, all readers)", "vs list",
                   "GB/s over minimal bytes", "of copy bandwidth"],
                  notes=[f"copy bandwidth measured here: {bw / 1e9:.0f} GB/s",
                         "minimal bytes: readers x one read's forward+backward (benchmarks.msar_attn.op_bytes)",
                         "timed list, buffered, list, buffered (medians of CUDA-event timings); each row the mean of its two"])
    failed = 0
    for shape in a.shapes:
        B, T, d = SHAPES[shape]
        for S in a.sources:
            case = make_case(S, B, T, d, a.readers)
            ref, got = grads("list", case), grads("buffered", case)
            diff = max(((x - y).norm() / y.norm().clamp_min(1e-12)).item() for x, y in zip(got, ref))
            failed += diff > 2e-2
            sources, params, _, _ = case
            for t in leaves(sources, params):
                t.grad = None
            ms = {"list": [], "buffered": []}
            for mode in ("list", "buffered", "list", "buffered"):
                ms[mode].append(bench_ms(lambda: step(mode, *case)))
            m = 1 + len(KERNELS)
            nbytes = a.readers * op_bytes(S, B, T, d, m)[1]
            for mode in ("list", "buffered"):
                t = sum(ms[mode]) / 2
                ratio = (sum(ms["list"]) / 2) / t
                table.add(shape, S, mode, f"{diff:.1e}" if mode == "buffered" else "-", f"{t:.3f}", f"{ratio:.3f}",
                          f"{nbytes / (t * 1e-3) / 1e9:.0f}", f"{nbytes / (t * 1e-3) / bw:.1%}")
            del case, ref, got
            torch.cuda.empty_cache()
    gpu = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")
    table.write(f"msar_buffered_{gpu}{a.tag}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
