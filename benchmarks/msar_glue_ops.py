"""The PyTorch operations around MSAR's fused kernels, per read: what each costs a launch on the GPU.

    python -m benchmarks.msar_glue_ops [--sources 5] [--tag _dec2]

Runs one fused read (``kernels.msar_attn.msar``, Triton backend, the split forward) forward and backward under
Triton's interpreter on the CPU, with a dispatch mode that counts the ATen operations that do work (views, empty
allocations and the interpreter's own copies left out), for ``Blocks.glue`` and ``stats_glue`` "torch" and "triton" (the steps between
the kernels as one kernel each). On the GPU each counted operation is at least one kernel of a few microseconds
beside the op's own Triton kernels (graphed or not), and a `small` msar_block step makes 17 reads. Writes
``benchmarks/results/msar_glue_ops{tag}.md``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# ATen operations that launch no GPU work, and the interpreter's copies of kernel arguments (not made on a GPU)
NOT_WORK = {"empty", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "as_strided",
            "detach", "alias", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice",
            "split", "unbind", "reshape", "_reshape_alias", "set_", "copy_", "lift_fresh", "lift_fresh_copy"}


def count(glue: str, S: int = 5, seed: int = 0) -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) counts of the ATen operations that do work in one fused read with ``Blocks.glue``."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.msar_attn import flat, make_inputs
    from kernels.msar_attn import fused, msar

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NOT_WORK:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    inner = fused._blocks
    fused._blocks = lambda *a: dataclasses.replace(inner(*a), fwd_mode="split", glue=glue, stats_glue=glue)
    try:
        *inputs, doc = make_inputs(S, 1, 16, 32, seed, x_dtype=torch.float32, device="cpu")
        x, taps, q, gains, phi, alpha, bias = inputs
        leaves = [t.requires_grad_() for t in flat(inputs)]
        up = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(seed))
        for _ in range(2):  # the first read warms the caches; the second is counted
            with Counting() as fwd:
                h = msar(x, taps, q, gains, doc, phi, alpha, bias, backend="triton")
            with Counting() as bwd:
                torch.autograd.grad((h * up).sum(), leaves)
        return fwd.ops, bwd.ops
    finally:
        fused._blocks = inner


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=5)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.sources < 1:
        raise SystemExit(f"error: --sources {args.sources}: a read has at least 1 source")
    rows = ["| Blocks.glue | forward ops | backward ops | forward | backward |", "|---|---:|---:|---|---|"]
    for glue in ("torch", "triton"):
        fwd, bwd = count(glue, args.sources)

        def listing(c):
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))

        rows.append(f"| {glue} | {sum(fwd.values())} | {sum(bwd.values())} | {listing(fwd)} | {listing(bwd)} |")
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        "# PyTorch operations around MSAR's fused kernels, one read", "",
        f"- command: `python -m benchmarks.msar_glue_ops {shown}`".rstrip("` ") + "`",
        f"- date {datetime.date.today()}; counted on the CPU under Triton's interpreter (no GPU): one read of "
        f"{args.sources} sources, split forward, forward and backward; ATen operations that do work (views, empty "
        "allocations and the interpreter's argument copies left out), beside the op's Triton kernels", "", *rows, ""])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"msar_glue_ops{args.tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
