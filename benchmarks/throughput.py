"""Training-step throughput of the backbone for every residual: tokens/s and peak memory.

    python -m benchmarks.throughput --model small --batch 16 --steps 20 [--residuals vanilla msar_block]

Times a full forward + backward + AdamW step (bf16 autocast on CUDA, fp32 on CPU) with CUDA events,
after warm-up, and reports the median. Writes a markdown table with the command, the device and the
date under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def build(model_name: str, residual: str, vocab: int, moe_impl: str | None, extra: list[str]):
    from platform.config import compose as make_cfg
    from platform.config import residual_config
    from platform.model import Backbone

    ov = [f"model={model_name}", f"residual={residual}", *extra] + ([f"model.moe_impl={moe_impl}"] if moe_impl else [])
    cfg = make_cfg(*ov)
    return Backbone(cfg.model, vocab, residual_config(cfg)), cfg


def time_steps(model, batch: int, seq: int, vocab: int, steps: int, warmup: int, device: str,
               compile: bool = False) -> tuple[float, float]:
    model = model.to(device)
    fwd = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    docs = torch.cumsum((torch.rand(batch, seq + 1, device=device) < 1 / 512).long(), 1)
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    def step():
        with ac:
            logits = fwd(tokens[:, :-1], docs[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        peak = float("nan")
    return statistics.median(times), peak


def main(argv=None) -> str:
    import residuals

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--residuals", nargs="*", default=None, help=f"default: all of {residuals.names()}")
    p.add_argument("--moe-impl", nargs="*", default=["grouped_mm"], help="grouped_mm and/or sliced")
    p.add_argument("--compile", nargs="*", default=["off"], help="off and/or on: torch.compile the backbone")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides, e.g. model.checkpoint_reads=true")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = a.residuals or residuals.names()
    for n in names:
        residuals.get(n)  # unknown names fail here, listing the registered ones
    rows, base = [], None
    for impl, comp in [(i, c) for i in a.moe_impl for c in a.compile]:
        for name in names:
            torch.manual_seed(0)
            model, cfg = build(a.model, name, a.vocab, impl, a.set)
            seq = cfg.model.seq_len
            n_params = sum(p.numel() for p in model.parameters())
            impl_label = impl + (" +compile" if comp == "on" else "")
            try:
                sec, peak = time_steps(model, a.batch, seq, a.vocab, a.steps, a.warmup, device, comp == "on")
            except torch.OutOfMemoryError:
                sec, peak = float("nan"), float("inf")  # reported as OOM, the other rows still run
            tps = a.batch * seq / sec
            if name == "vanilla" and base is None:
                base = tps
            rows.append((name, impl_label, n_params, sec * 1e3, tps, peak))
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"{name:>16} {impl_label:>20}: {sec * 1e3:8.1f} ms/step {tps:12,.0f} tok/s peak {peak:6.2f} GiB", flush=True)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    lines = [f"# Training-step throughput: model={a.model}, batch={a.batch}, vocab={a.vocab} {' '.join(a.set)}",
             "", f"- command: `python -m benchmarks.throughput {' '.join(sys.argv[1:] if argv is None else argv)}`",
             f"- device: {gpu}; torch {torch.__version__}; date {dt.date.today().isoformat()}",
             "- one step = forward + backward + AdamW, bf16 autocast on CUDA; median of timed steps after warm-up", "",
             "| residual | MoE impl | params | ms/step | tokens/s | vs vanilla | peak mem (GiB) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, impl, n, ms, tps, peak in rows:
        if peak == float("inf"):
            lines.append(f"| {name} | {impl} | {n / 1e6:.1f}M | OOM | - | - | > device memory |")
            continue
        rel = f"{tps / base:.3f}" if base else "-"
        lines.append(f"| {name} | {impl} | {n / 1e6:.1f}M | {ms:.1f} | {tps:,.0f} | {rel} | {peak:.2f} |")
    text = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if device == "cuda" else "cpu"
    (out / f"throughput_{a.model}_{tag}{a.tag}.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
