"""FlexAttention's kernel tiles at the backbone's shapes, timed on a CUDA GPU (one process).

    python -m benchmarks.flex_tiles [--shapes small medium] [--budget 240] [--quick] [--tag _x]

The attention of `small` and `medium` (bf16, head dim 64, GQA, causal and same-document block mask
built as `platform.model.build_attention_mask` builds it, from the batches `benchmarks.throughput`
times: about 2 documents per 1024 tokens) runs with PyTorch's default tiles and with the candidates
below, passed as FlexAttention's ``kernel_options`` (``fwd_*`` / ``bwd_*`` for one direction). The
forward candidates are timed forward only, the backward ones forward+backward with a random upstream
gradient, then pairs of forward and backward tiles forward+backward, and one row compiles with
``mode="max-autotune-no-cudagraphs"`` (PyTorch's own search over its tile list). ``--quick``: a few
candidates around the best at `small`, and the pairs. Every candidate's output and gradients are compared with the default's first
(relative L2 < 1e-2): one that computes something else is reported WRONG and not timed.

TFLOP/s counts the blocks the mask does not skip (``1 - BlockMask.sparsity()``): 4·B·H·T²·hd·(kept)
forward, 2.5× that backward (five products instead of two); "% bf16" is against a bf16 matmul timed
in the same process. The table goes to benchmarks/results/flex_tiles_<gpu>.md. Changing the backbone's
tiles is a separate edit of ``model.flex_fwd`` / ``model.flex_bwd`` (conf/model/*.yaml).
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from benchmarks.roofline import Table, bench_ms, matmul_rate

SHAPES = {"small": (16, 1024, 8, 4, 64), "medium": (16, 2048, 16, 4, 64)}  # B, T, heads, KV heads, hd

FWD = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 4, 2),
    (64, 64, 4, 2),
]
BWD = [  # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)
    (64, 64, 64, 64, 4, 3), (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 4, 3), (32, 64, 64, 32, 4, 3),
    (64, 64, 64, 64, 8, 2), (32, 128, 128, 32, 8, 3), (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 1),
]
FLAGS = [{"USE_TMA": True}]  # ROWS_GUARANTEED_SAFE gave NaN gradients with the document mask (2026-12-01)
PAIRS = [((64, 64, 4, 2), (32, 64, 64, 32, 4, 3)), ((128, 64, 4, 3), (32, 64, 64, 32, 4, 3)),
         ((64, 128, 4, 3), (32, 128, 128, 32, 8, 3))]  # forward and backward tiles together, fwd+bwd
QUICK_FWD = [(64, 64, 4, 2), (128, 64, 4, 3), (64, 128, 4, 3)]
QUICK_BWD = [(32, 64, 64, 32, 4, 3), (32, 128, 128, 32, 8, 3)]


def fwd_options(t) -> dict:
    """The kernel_options `model.flex_fwd=t` gives the backbone."""
    from platform.model import flex_kernel_options

    return flex_kernel_options(list(t), None)


def bwd_options(t) -> dict:
    """The kernel_options `model.flex_bwd=t` gives the backbone."""
    from platform.model import flex_kernel_options

    return flex_kernel_options(None, list(t))


def inputs(shape: str, seed: int = 0):
    from benchmarks.throughput import packed_batch
    from platform.model import build_attention_mask

    B, T, H, KV, hd = SHAPES[shape]
    _, docs = packed_batch(B, T, 8192, "cuda", seed=seed)
    mask = build_attention_mask(docs[:, :-1], "flex")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, hd, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (H, KV, KV))
    up = torch.randn(B, H, T, hd, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, up, mask.block


def attention(options: dict | None, mode: str | None = None):
    from torch.nn.attention.flex_attention import flex_attention

    def fn(q, k, v, block):
        return flex_attention(q, k, v, block_mask=block, enable_gqa=True, kernel_options=options)

    return torch.compile(fn, dynamic=False, mode=mode)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def run_shape(shape: str, table: Table, bf16: float, deadline: float, quick: bool = False) -> None:
    q, k, v, up, block = inputs(shape)
    B, T, H, _, hd = SHAPES[shape]
    kept = 1 - block.sparsity() / 100
    fwd_flops = 4 * B * H * T * T * hd * kept

    def outputs(fn):
        out = fn(q, k, v, block)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), up)
        return out.detach(), dq, dk, dv

    ref = outputs(attention(None))
    rows = [("default", "fwd", None, None), ("default", "fwd+bwd", None, None)]
    rows += [(f"fwd {t}", "fwd", fwd_options(t), None) for t in (QUICK_FWD if quick else FWD)]
    rows += [(f"bwd {t}", "fwd+bwd", bwd_options(t), None) for t in (QUICK_BWD if quick else BWD)]
    rows += [(f"fwd {f} + bwd {b}", "fwd+bwd", {**fwd_options(f), **bwd_options(b)}, None) for f, b in PAIRS]
    if not quick:
        rows += [(f"{next(iter(f))}", "fwd+bwd", f, None) for f in FLAGS]
        rows += [("max-autotune", "fwd+bwd", None, "max-autotune-no-cudagraphs")]
    for label, op, options, mode in rows:
        if time.time() > deadline:
            table.add(shape, label, op, "-", "-", "-", "-", "skipped: out of time budget")
            continue
        torch._dynamo.reset()
        try:
            fn = attention(options, mode)
            got = outputs(fn)
        except Exception as e:  # a tile choice the template refuses (shared memory, divisibility)
            table.add(shape, label, op, "-", "-", "-", "-", f"refused: {type(e).__name__}: {str(e)[:80]}")
            continue
        err = max(rel(a, b) for a, b in zip(got, ref))
        if err > 1e-2:
            table.add(shape, label, op, "-", "-", "-", f"{err:.1e}", "WRONG")
            continue
        if op == "fwd":
            with torch.no_grad():
                ms = bench_ms(lambda: fn(q, k, v, block))
            flops = fwd_flops
        else:
            ms = bench_ms(lambda: torch.autograd.grad(fn(q, k, v, block), (q, k, v), up))
            flops = 3.5 * fwd_flops
        tflops = flops / (ms * 1e-3) / 1e12
        table.add(shape, label, op, f"{ms:.3f}", f"{tflops:.0f}", f"{100 * tflops * 1e12 / bf16:.0f}%", f"{err:.1e}",
                  f"{100 * kept:.0f}% of blocks kept")
        print(table.rows[-1], flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["small", "medium"], choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="a few candidates around the best at small, and the pairs")
    p.add_argument("--budget", type=float, default=240, help="seconds for all shapes; candidates left after a shape's share are listed as skipped")
    p.add_argument("--tag", default="", help="appended to the result file's name")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.flex_tiles needs a CUDA GPU (FlexAttention's fused kernels)")
    torch._dynamo.config.cache_size_limit = 64
    bf16 = matmul_rate(torch.bfloat16)
    table = Table("FlexAttention tiles at the backbone's shapes (bf16, hd 64, GQA, causal + document mask)",
                  ["shape", "kernel options", "op", "ms", "TFLOP/s", "% bf16", "err vs default", "note"],
                  notes=[f"bf16 matmul measured here: {bf16 / 1e12:.0f} TFLOP/s",
                         "tuples: fwd (BLOCK_M, BLOCK_N, warps, stages); bwd (BLOCK_M1, BLOCK_N1, BLOCK_M2, "
                         "BLOCK_N2, warps, stages); FLOPs over the blocks the mask keeps, backward 2.5x forward"])
    for shape in a.shapes:  # each shape gets its share of the budget
        run_shape(shape, table, bf16, time.time() + a.budget / len(a.shapes), quick=a.quick)
    gpu = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")
    table.write(f"flex_tiles_{gpu}{a.tag}")


if __name__ == "__main__":
    main()
