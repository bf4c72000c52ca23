"""The PyTorch operations around MSAR's fused kernels, per read: what each costs a launch on the GPU.

    python -m benchmarks.msar_glue_ops [--sources 5] [--tag _dec2]
    python -m benchmarks.msar_glue_ops --step vanilla msar_block msar_block@py:residuals.msar.Msar.pack_step=True

With ``--step`` it counts a whole training step instead: one forward and backward of a 2-block `tiny` backbone (bf16
autocast, fused reads under the interpreter) for each row, a residual with optional ``@py:MODULE.NAME.ATTR=VALUE``
code settings held for that row (as ``benchmarks.throughput`` takes them), every ATen operation that does work
counted, copies included, except those the interpreter makes inside a kernel launch. Writes
``msar_glue_ops_step{tag}.md``.

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


def _counting(skip: set[str], *, outside_interpreter: bool = False):
    """A dispatch mode that counts the ATen operations it sees by name (``.ops``), those in ``skip`` left out and, with
    ``outside_interpreter``, those Triton's interpreter makes inside a kernel launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in skip and not (outside_interpreter and _in_interpreter()):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    return Counting()


def count(glue: str, S: int = 5, seed: int = 0) -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) counts of the ATen operations that do work in one fused read with ``Blocks.glue``."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    import torch

    from benchmarks.msar_attn import flat, make_inputs
    from kernels.msar_attn import fused, msar

    inner = fused._blocks
    fused._blocks = lambda *a: dataclasses.replace(inner(*a), fwd_mode="split", glue=glue, stats_glue=glue)
    try:
        *inputs, doc = make_inputs(S, 1, 16, 32, seed, x_dtype=torch.float32, device="cpu")
        x, taps, q, gains, phi, alpha, bias = inputs
        leaves = [t.requires_grad_() for t in flat(inputs)]
        up = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(seed))
        for _ in range(2):  # the first read warms the caches; the second is counted
            with _counting(NOT_WORK) as fwd:
                h = msar(x, taps, q, gains, doc, phi, alpha, bias, backend="triton")
            with _counting(NOT_WORK) as bwd:
                torch.autograd.grad((h * up).sum(), leaves)
        return fwd.ops, bwd.ops
    finally:
        fused._blocks = inner


def _in_interpreter() -> bool:
    """Whether the ATen call being dispatched comes from inside Triton's interpreter (a kernel launch's own copies)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/triton/runtime/interpreter" in name:
            return True
        frame = frame.f_back
    return False


def step_count(row: str, T: int = 16, seed: int = 0) -> collections.Counter:
    """ATen operations that do work in one forward and backward of a 2-block `tiny` backbone with ``row`` (a
    residual, optionally with ``@`` overrides and ``@py:`` code settings, as ``benchmarks.throughput`` takes rows),
    bf16 autocast, its fused ops (``residual.backend=triton``, where its config has a backend) under the interpreter;
    the second of two steps is counted (the first warms the caches)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    import torch

    from benchmarks.roofline import held
    from benchmarks.throughput import build, code_settings

    vocab, base = 37, ["model.n_blocks=2"]
    _, plain = build("tiny", row, vocab, base, "meta")
    fused = ["residual.backend=triton"] if "backend" in plain.residual else []  # where the residual has fused ops
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, T), generator=g)
    docs = (torch.arange(T) >= T // 3).long()[None] + (torch.arange(T) >= 2 * T // 3).long()[None]
    up = torch.randn(1, T, vocab, generator=g)
    with held(code_settings(row)):  # the row's py: settings, for its build and its steps alone
        torch.manual_seed(seed)
        model, _ = build("tiny", row, vocab, base + fused, "cpu")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            # a copy outside a kernel launch is work here
            with _counting(NOT_WORK - {"copy_"}, outside_interpreter=True) as counted:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(tokens, docs)
                out.float().backward(up)
    return counted.ops


def _listing(c) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def step_table(rows: list[str], argv: list[str]) -> str:
    lines = ["| row | ATen ops a step | more than the first row | operations |", "|---|---:|---:|---|"]
    first = None
    for row in rows:
        ops = step_count(row)
        total = sum(ops.values())
        first = total if first is None else first
        lines.append(f"| `{row}` | {total} | {total - first:+d} | {_listing(ops)} |")
    return "\n".join([
        "# PyTorch operations of a training step around the fused residual ops", "",
        f"- command: `python -m benchmarks.msar_glue_ops {' '.join(argv)}`",
        f"- date {datetime.date.today()}; counted on the CPU under Triton's interpreter (no GPU): one forward and "
        "backward of a 2-block `tiny` backbone (1 × 16 tokens, 3 documents, bf16 autocast, fused reads), the second "
        "of two; ATen operations that do work (views and empty allocations left out; copies counted, but not the "
        "interpreter's inside a kernel launch). On a GPU each is at least one kernel beside the ops' Triton kernels",
        "", *lines, ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=5)
    p.add_argument("--step", nargs="+", metavar="ROW", help="count whole steps of these rows instead of one read")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.step:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported, the settings' included
        from benchmarks.throughput import code_settings

        for row in args.step:
            code_settings(row)  # a bad setting fails before any step runs
        text = step_table(args.step, argv if argv is not None else sys.argv[1:])
        print(text)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"msar_glue_ops_step{args.tag}.md").write_text(text)
        return 0
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
