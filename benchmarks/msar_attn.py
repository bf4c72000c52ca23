"""Fused MSAR retrieval (conv views + depth attention) vs the PyTorch reference, on a CUDA GPU.

    python -m benchmarks.msar_attn [--shapes small medium] [--out benchmarks/results]

For every shape: a parity check in bf16 (forward streams and every input gradient of
``backend="triton"`` against the fp32 reference, fresh random inputs and upstream gradient), then
the median time (``triton.testing.do_bench``) of forward and forward+backward for both backends
in bf16, the minimal bytes moved (forward: read x once, write the streams and the lse; backward:
read x, the streams, their gradient and the lse, write dx), the achieved bandwidth against a
device-to-device copy measured in the same process, and the peak memory of one forward+backward
above the inputs. Writes the table as markdown to benchmarks/results/msar_attn_<gpu>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# (name, S, B, T, d, kernels): model=small is d=512 with B·T = 16×1024, model=medium d=1024, 8×2048
SHAPES = {
    "small": [(f"small S={S}", S, 16, 1024, 512, (4, 8, 12)) for S in (2, 3, 5)],
    "medium": [(f"medium S={S}", S, 8, 2048, 1024, (4, 8, 12)) for S in (3, 5, 9)],
}


def make_inputs(S, B, T, d, kernels, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, device="cuda", generator=g)).to(dtype)

    m = 1 + len(kernels)
    x = rand(S, B, T, d)
    taps = [rand(k, d, scale=0.5 / k ** 0.5, shift=1.0 / k) for k in kernels]
    queries = rand(m, d)
    gains = rand(m, d, scale=0.1, shift=1.0)
    starts = torch.rand(B, T, device="cuda", generator=g) < 1 / 512  # ~2 documents per 1024 tokens
    doc_ids = torch.cumsum(starts.long(), dim=1)
    return x, taps, queries, gains, doc_ids


def leaves(x, taps, queries, gains):
    return [x, queries, gains, *taps]


def run(backend, x, taps, queries, gains, doc_ids):
    from kernels.msar_attn import msar_attn

    return msar_attn(x, taps, queries, gains, doc_ids, backend=backend)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def parity(S, B, T, d, kernels, seed) -> float:
    """Worst relative error of the bf16 fused op (output and every gradient) vs the fp32 reference
    on the same (bf16-valued) inputs."""
    x, taps, q, g, doc = make_inputs(S, B, T, d, kernels, torch.bfloat16, seed)
    bf_in = [t.requires_grad_() for t in leaves(x, taps, q, g)]
    # the reference runs in fp32 on the same bf16 inputs: the error measured is the kernel's alone
    ref_in = [t.detach().float().requires_grad_() for t in bf_in]
    ref = run("torch", ref_in[0], ref_in[3:], ref_in[1], ref_in[2], doc)
    out = run("triton", bf_in[0], bf_in[3:], bf_in[1], bf_in[2], doc)
    up = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1))
    errs = [rel_err(out, ref)]
    grads = torch.autograd.grad((out.float() * up).sum(), bf_in)
    ref_grads = torch.autograd.grad((ref * up).sum(), ref_in)
    errs += [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    return max(errs)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write), the roofline for this op."""
    import triton

    src = torch.empty(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def measure(backend, S, B, T, d, kernels, seed) -> dict:
    import triton

    x, taps, q, g, doc = make_inputs(S, B, T, d, kernels, torch.bfloat16, seed)
    inputs = [t.requires_grad_() for t in leaves(x, taps, q, g)]
    x, q, g, taps = inputs[0], inputs[1], inputs[2], inputs[3:]
    m = 1 + len(kernels)
    up = torch.randn(m, B, T, d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            return run(backend, x, taps, q, g, doc)

    def fwd_bwd():
        out = run(backend, x, taps, q, g, doc)
        return torch.autograd.grad(out, inputs, grad_outputs=up)

    t_fwd = triton.testing.do_bench(fwd, return_mode="median")
    t_fb = triton.testing.do_bench(fwd_bwd, return_mode="median")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"fwd_ms": t_fwd, "fb_ms": t_fb, "peak_gib": peak / 2**30}


def minimal_bytes(S, B, T, d, m, elt=2) -> tuple[int, int]:
    """(forward, forward+backward) bytes if every tensor crossed HBM exactly once."""
    x, streams, lse = S * B * T * d * elt, m * B * T * d * elt, m * B * T * 4
    fwd = x + streams + lse
    bwd = x + 2 * streams + lse + x  # read x, out, dOut, lse; write dx
    return fwd, fwd + bwd


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.msar_attn needs a CUDA GPU (the CPU interpreter cannot time kernels)")

    gpu = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"{gpu}: device-to-device copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    header = ("| shape | S | B×T | d | m | parity (max rel err, bf16 vs fp32 ref) | backend | fwd ms | fwd+bwd ms "
              "| fwd GB/s (% of copy) | fwd+bwd GB/s (% of copy) | peak fwd+bwd GiB | speedup fwd / fwd+bwd |")
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    failed = False
    for name, S, B, T, d, kernels in [s for key in args.shapes for s in SHAPES[key]]:
        m = 1 + len(kernels)
        err = parity(S, B, T, d, kernels, args.seed)
        ok = err < 2e-2
        failed |= not ok
        fwd_bytes, fb_bytes = minimal_bytes(S, B, T, d, m)
        res = {b: measure(b, S, B, T, d, kernels, args.seed) for b in ("triton", "torch")}
        for backend in ("triton", "torch"):
            r = res[backend]
            bw_f, bw_fb = fwd_bytes / (r["fwd_ms"] * 1e-3), fb_bytes / (r["fb_ms"] * 1e-3)
            speed = (f"{res['torch']['fwd_ms'] / r['fwd_ms']:.2f}× / {res['torch']['fb_ms'] / r['fb_ms']:.2f}×"
                     if backend == "triton" else "1×")
            rows.append(f"| {name} | {S} | {B}×{T} | {d} | {m} | {err:.1e} {'ok' if ok else 'FAIL'} | {backend} "
                        f"| {r['fwd_ms']:.3f} | {r['fb_ms']:.3f} | {bw_f / 1e9:.0f} ({100 * bw_f / copy_bw:.0f}%) "
                        f"| {bw_fb / 1e9:.0f} ({100 * bw_fb / copy_bw:.0f}%) | {r['peak_gib']:.2f} | {speed} |")
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()

    cmd = "python -m benchmarks.msar_attn " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        f"# MSAR retrieval: fused Triton vs PyTorch reference ({gpu})",
        "",
        f"- command: `{cmd.strip()}`",
        f"- GPU: {gpu}; torch {torch.__version__}; date {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- device-to-device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write of 1 GiB)",
        "- bf16 inputs, kernels (4, 8, 12) so m = 4 views, key RMSNorm with gains, ~2 documents per 1024 "
        "tokens; times are medians of `triton.testing.do_bench`; fwd runs under `no_grad`.",
        "- minimal bytes: forward reads x once and writes the streams and the lse; backward reads x, "
        "the streams, their gradient and the lse, and writes dx. Peak memory is above the inputs.",
        "",
        *rows,
        "",
    ])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"msar_attn_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}.md"
    path.write_text(text)
    print(f"wrote {path}")
    if failed:
        raise SystemExit("parity check failed: see the table")
    return text


if __name__ == "__main__":
    main()
