"""The fused MSAR op (views + depth attention + H^pre mixer) against its reference, on a CUDA GPU.

    python -m benchmarks.msar_attn [--shapes small medium wide] [--sources 2 5 9] [--no-compile] [--timer graphs]

Everything in ONE process, so the ratios are measured side by side. First, once per shape and
source count, a parity check: the fused op on bf16 sources (parameters fp32, as under autocast in
training) against the fp32 reference on the same bf16-rounded values, h and the gradient of every
input (sources, queries, key gains, taps, φ, α, b) for a random upstream gradient, on 2 rows of
the shape's length (``PARITY_TOL``). Then the median time (CUDA events) of forward (no grad) and
forward+backward of: the fused op (``backend="triton"``), the reference (``backend="torch"``) and
``torch.compile`` of the reference. ``--timer graphs`` times replays of a CUDA graph of the calls instead, as a
graphed training step runs them (no gaps while the host launches a call's kernels, no L2 flush between calls;
``benchmarks.roofline.TIMER``); its table is written beside the default one, named ``..._graphs.md``. The roofline of each is

    floor = max(minimal bytes / copy bandwidth, CUDA-core FLOPs / fp32 rate)

with both ceilings measured in this run (``benchmarks/roofline.py``). Minimal bytes: forward reads
the sources once and writes h and the per-view lse; forward+backward adds reading the sources
again, dh and the lse, and writing dx. FLOPs: the arithmetic of the op counted once (convs Σ_j 2
k_j d per source, key RMS and logit 4 m d, weighted sum 2 m d, mixer 4 m d + 2 m² d); backward
counted as twice the forward, so forward+backward = 3× forward (the backward's recomputation of the
streams is not counted: it is the op's choice, not its cost). The fused op's pieces are timed too
(forward saving nothing, as under no_grad; forward saving what the backward reads; mixer backward;
stats + source-gradient kernels). The table is written to
benchmarks/results/msar_attn_<gpu>.md with the command, the GPU and the date. Targets (issue 7):
fused ≥ 50% of its roofline forward and ≥ 30% forward+backward; the last lines say which are met.
The process exits non-zero if a parity check fails (after writing the table).
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback

import torch

from benchmarks import roofline
from benchmarks.roofline import Ceilings, Table, bench_ms, held

KERNELS = (4, 8, 12)
# (name, B, T, d): model=small is d=512 with 16×1024 tokens, model=medium d=1024 with 16×2048
SHAPES = {"small": (16, 1024, 512), "medium": (16, 2048, 1024), "wide": (16, 1024, 2048)}
PARITY_TOL = 2e-2  # bf16 sources, fp32 math in the kernel: h and dx rounded to bf16 once
TARGET_FWD, TARGET_FB = 0.50, 0.30


def make_inputs(S, B, T, d, seed, x_dtype=torch.bfloat16, device="cuda"):
    """Sources in x_dtype; taps, queries, gains, φ, α, b in fp32 (parameters); ~2 documents per 1024
    tokens. Taps near Dirac + noise (the default init), queries and φ non-zero (a trained state)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(shape, device=device, generator=g)

    m = 1 + len(KERNELS)
    x = rand(S, B, T, d).to(x_dtype)
    taps = []
    for k in KERNELS:
        c = rand(k, d, scale=0.1)
        c[0] += 1.0
        taps.append(c)
    queries = rand(m, d, scale=1 / d ** 0.5)
    gains = rand(m, d, scale=0.1, shift=1.0)
    phi = rand(m * d, m, scale=1 / (m * d) ** 0.5)
    alpha = rand(scale=0.0, shift=0.5)
    bias = rand(m, scale=0.1, shift=-1.0)
    starts = torch.rand(B, T, device=device, generator=g) < 1 / 512
    doc_ids = torch.cumsum(starts.long(), dim=1)
    return x, taps, queries, gains, phi, alpha, bias, doc_ids


def call(fn, inputs, doc_ids, **kwargs):
    """fn(x, taps, queries, gains, doc_ids, φ, α, b, **kwargs) for inputs [x, taps, q, g, φ, α, b]."""
    x, taps, q, g, phi, alpha, bias = inputs
    return fn(x, taps, q, g, doc_ids, phi, alpha, bias, **kwargs)


def flat(inputs):
    x, taps, *rest = inputs
    return [x, *taps, *rest]


def rel_err(a, b):
    """‖a - b‖ / ‖b‖; ‖a - b‖ itself where the reference is exactly zero."""
    diff, ref = (a.float() - b.float()).norm().item(), b.float().norm().item()
    return diff / ref if ref > 0 else diff


def parity(S, T, d, seed, x_dtype=torch.bfloat16, device="cuda") -> dict[str, float]:
    """Relative error of h and every gradient: the fused op on x_dtype sources (bf16 on the GPU; fp32 under the CPU
    interpreter, where the tests run it) vs the fp32 reference on the same values, on 2 rows."""
    from kernels.msar_attn import msar

    x, taps, q, g, phi, alpha, bias, doc = make_inputs(S, 2, T, d, seed, x_dtype=x_dtype, device=device)
    fused_in = [x.requires_grad_(), [c.requires_grad_() for c in taps], q.requires_grad_(), g.requires_grad_(),
                phi.requires_grad_(), alpha.requires_grad_(), bias.requires_grad_()]
    ref_in = [x.detach().float().requires_grad_(), [c.detach().clone().requires_grad_() for c in taps],
              *(t.detach().clone().requires_grad_() for t in fused_in[2:])]
    h = call(msar, fused_in, doc, backend="triton")
    ref = call(msar, ref_in, doc, backend="torch")
    up = torch.randn(h.shape, device=device, generator=torch.Generator(device).manual_seed(seed + 1))
    errs = {"h": rel_err(h, ref)}
    names = ["x", *(f"taps{k}" for k in KERNELS), "queries", "gains", "phi", "alpha", "bias"]
    grads = torch.autograd.grad((h.float() * up).sum(), flat(fused_in))
    ref_grads = torch.autograd.grad((ref * up).sum(), flat(ref_in))
    errs |= {f"d{n}": rel_err(a, b) for n, a, b in zip(names, grads, ref_grads)}
    return errs


def op_bytes(S, B, T, d, m, elt=2) -> tuple[float, float]:
    """(forward, forward+backward) bytes if every tensor crossed HBM exactly once."""
    src, tok, lse = S * B * T * d * elt, B * T * d * elt, m * B * T * 4
    fwd = src + tok + lse
    bwd = src + tok + lse + src  # read the sources, dh and the lse again; write dx
    return fwd, fwd + bwd


def op_flops(S, B, T, d, m, kernels=KERNELS) -> tuple[float, float]:
    """(forward, forward+backward) CUDA-core FLOPs, each multiply-add counted as 2 (``kernels``: the views' k_j)."""
    per_source = sum(2 * k * d for k in kernels) + 4 * m * d + 2 * m * d  # convs, key RMS + logit, Σ w E
    mixer = 4 * m * d + 2 * m * m * d  # ‖R‖² and Σ g r, R·φ
    fwd = B * T * (S * per_source + mixer)
    return fwd, 3 * fwd


def timings(fn, S, B, T, d, seed) -> dict[str, float]:
    x, taps, q, g, phi, alpha, bias, doc = make_inputs(S, B, T, d, seed)
    inputs = [x.requires_grad_(), [c.requires_grad_() for c in taps], q.requires_grad_(), g.requires_grad_(),
              phi.requires_grad_(), alpha.requires_grad_(), bias.requires_grad_()]
    up = torch.randn(B, T, d, device="cuda", dtype=x.dtype)

    def fwd():
        with torch.no_grad():
            return fn(inputs, doc)

    def fwd_bwd():
        return torch.autograd.grad(fn(inputs, doc), flat(inputs), grad_outputs=up)

    out = {"fwd": bench_ms(fwd), "fb": bench_ms(fwd_bwd)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return out


def fused_breakdown(S, B, T, d, seed, x_dtype=torch.bfloat16, device="cuda") -> dict[str, float]:
    """Milliseconds of the fused op's pieces: the forward kernels saving nothing (as the op runs under no_grad),
    the forward kernels saving the streams and statistics for the backward (as in training), the mixer backward
    (from the saved streams, with dφ), the stats and source-gradient kernels (streams backward)."""
    from kernels.msar_attn import fused

    x, taps, q, g, phi, alpha, bias, doc = make_inputs(S, B, T, d, seed, x_dtype=x_dtype, device=device)
    doc = fused.doc_window(doc)  # the window bits the kernels take (computed once per call of the op)
    m = 1 + len(taps)
    packed, ks, _ = fused.pack_taps(taps, d, x.device)
    qg = fused.folded_queries(q, g)
    mixer = fused._mixer_params(phi, alpha, bias)
    dh = torch.randn(B, T, d, device=device, dtype=x.dtype)
    kw = dict(key_norm=True, eps=1e-6)
    _, lse, _, saved, stats = fused.forward(x, packed, ks, m, qg, doc, mixer=mixer, save=True, save_stats=True, **kw)
    dr, *_ = fused.mixer_backward(dh, saved, mixer, eps=kw["eps"], sigmoid=True)
    return {  # as training runs them: the forward saves what the backward reads
        "forward, saving nothing": bench_ms(lambda: fused.forward(x, packed, ks, m, qg, doc, mixer=mixer, **kw)),
        "forward": bench_ms(lambda: fused.forward(x, packed, ks, m, qg, doc, mixer=mixer, save=True, save_stats=True,
                                                  **kw)),
        "mixer bwd": bench_ms(lambda: fused.mixer_backward(dh, saved, mixer, eps=kw["eps"], sigmoid=True)),
        "streams bwd": bench_ms(lambda: fused.streams_backward(dr, lse, x, taps, packed, ks, qg, doc, stats=stats,
                                                               **kw)),
    }


def implementations(compile_reference: bool):
    from kernels.msar_attn import msar, reference

    impls = {
        "fused": lambda inp, doc: call(msar, inp, doc, backend="triton"),
        "reference": lambda inp, doc: call(msar, inp, doc, backend="torch"),
    }
    if compile_reference:
        compiled = torch.compile(reference.msar)
        impls["reference, torch.compile"] = lambda inp, doc: call(compiled, inp, doc)
    return impls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sources", nargs="+", type=int, default=[2, 5, 9])
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument("--seed", type=int, default=0)
    roofline.add_timer_option(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.msar_attn needs a CUDA GPU (the CPU interpreter cannot time kernels)")
    with held([(roofline, "TIMER", args.timer)]):
        return _timed(args)


def _timed(args) -> int:
    """main's tables, timed under its --timer."""
    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}: {ceil.describe()}", flush=True)
    m = 1 + len(KERNELS)
    table = Table(
        title="MSAR fused op (views + depth attention + mixer) vs its reference",
        columns=["shape", "S", "B×T", "d", "parity (max rel err: tensor)", "impl", "fwd ms", "fwd roofline ms",
                 "fwd % of roofline", "fwd+bwd ms", "fwd+bwd roofline ms", "fwd+bwd % of roofline",
                 "peak fwd+bwd GiB", "fused speedup fwd / fwd+bwd"],
        notes=[f"ceilings measured in this run: {ceil.describe()}",
               f"kernels {KERNELS} (m = {m} views), key RMSNorm with gains, sigmoid fusion, ~2 documents per "
               "1024 tokens; bf16 sources, fp32 parameters; fwd under no_grad; "
               + ("medians of CUDA-graph replays (no launch gaps, no L2 flush; --timer graphs)" if args.timer == "graphs"
                  else "medians of CUDA-event timings around each call (launch gaps count)"),
               "minimal bytes: fwd reads the sources once, writes h and the lse; fwd+bwd also reads the sources, "
               "dh and the lse and writes dx. FLOPs: the op's arithmetic once (backward = 2× forward); the "
               "roofline is the larger of bytes / copy bandwidth and FLOPs / fp32 rate (binding term in brackets)",
               f"parity: fused bf16 vs fp32 reference on the same values, 2 rows, h and every gradient; "
               f"tolerance {PARITY_TOL}"])
    impls = implementations(not args.no_compile)
    failed, verdicts, breakdown = [], [], []
    gpu = torch.cuda.get_device_name()
    name = (f"msar_attn_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}"
            f"{'_graphs' if args.timer == 'graphs' else ''}")
    for shape in args.shapes:
        B, T, d = SHAPES[shape]
        for S in args.sources:
            errs = parity(S, T, d, args.seed)
            worst = max(errs, key=errs.get)
            ok = errs[worst] < PARITY_TOL
            print(f"[{shape} S={S}] parity " + " ".join(f"{k}={v:.1e}" for k, v in errs.items())
                  + (" ok" if ok else " FAIL"), flush=True)
            if not ok:
                failed.append(f"{shape} S={S}: {worst} {errs[worst]:.2e}")
            fwd_bytes, fb_bytes = op_bytes(S, B, T, d, m)
            fwd_flops, fb_flops = op_flops(S, B, T, d, m)
            floor_f, floor_fb = ceil.floor_ms(fwd_bytes, fwd_flops), ceil.floor_ms(fb_bytes, fb_flops)
            bind_f, bind_fb = ceil.binding(fwd_bytes, fwd_flops), ceil.binding(fb_bytes, fb_flops)
            results = {}
            parity_cell = f"{errs[worst]:.1e}: {worst} {'ok' if ok else 'FAIL'}"
            for impl, fn in impls.items():  # each row saved as soon as it is timed (fused first: the others' speedup)
                try:
                    r = timings(fn, S, B, T, d, args.seed)
                except torch.cuda.OutOfMemoryError as e:  # recorded in the table and printed, not hidden
                    print(f"[{shape} S={S}] {impl}: out of memory: {e}", flush=True)
                    r = None
                except Exception:  # torch.compile failures: recorded in the table with the traceback printed
                    print(f"[{shape} S={S}] {impl} failed:\n{traceback.format_exc()}", flush=True)
                    r = "error"
                torch.cuda.empty_cache()
                results[impl] = r
                fused = results.get("fused")
                if not isinstance(r, dict):
                    table.add(shape, S, f"{B}×{T}", d, parity_cell, impl, "OOM" if r is None else "error",
                              *["–"] * 7)
                else:
                    speed = (f"{r['fwd'] / fused['fwd']:.2f}× / {r['fb'] / fused['fb']:.2f}×"
                             if isinstance(fused, dict) and impl != "fused" else "–")
                    table.add(shape, S, f"{B}×{T}", d, parity_cell, impl, f"{r['fwd']:.3f}",
                              f"{floor_f:.3f} ({bind_f})", f"{100 * floor_f / r['fwd']:.0f}%", f"{r['fb']:.3f}",
                              f"{floor_fb:.3f} ({bind_fb})", f"{100 * floor_fb / r['fb']:.0f}%", f"{r['peak_gib']:.2f}",
                              speed)
                print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
                table.write(name, partial=f"{len(table.rows)} rows")  # a run stopped by its time limit keeps them
            parts = fused_breakdown(S, B, T, d, args.seed)
            breakdown.append(f"{shape} S={S}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in parts.items()))
            print(f"[{shape} S={S}] fused pieces: {breakdown[-1]}", flush=True)
            if isinstance(fused, dict):
                frac_f, frac_fb = floor_f / fused["fwd"], floor_fb / fused["fb"]
                verdicts.append(f"{shape} S={S}: fwd {100 * frac_f:.0f}% ({'met' if frac_f >= TARGET_FWD else 'MISSED'}"
                                f", bound by {bind_f}), fwd+bwd {100 * frac_fb:.0f}% "
                                f"({'met' if frac_fb >= TARGET_FB else 'MISSED'}, bound by {bind_fb})")
    table.notes.append("fused op's pieces (forward kernels saving nothing, as under no_grad; forward kernels saving the "
                       "streams; mixer backward from the saved streams, with dφ; stats + source-gradient kernels): " + "; ".join(breakdown))
    table.notes.append(f"targets (fused ≥ {TARGET_FWD:.0%} of roofline fwd, ≥ {TARGET_FB:.0%} fwd+bwd): "
                       + "; ".join(verdicts))
    path = table.write(name)
    print(f"wrote {path}")
    print("\n".join(["targets:", *verdicts]))
    if failed:
        print("PARITY FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
