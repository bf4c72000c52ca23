"""Training-step throughput and MFU of the backbone, every residual side by side in one process.

    python -m benchmarks.throughput --models small medium --residuals vanilla attnres_block msar_block mhc msar
    python -m benchmarks.throughput --models small --compile off on --recompute none mlp
    python -m benchmarks.throughput --models small medium --compile sublayers on --graphs on   # the compiled loss
    python -m benchmarks.throughput --models small medium --ddp 2        # 2-GPU scaling efficiency
    python -m benchmarks.throughput --models small --graphs on --ddp 2 --ddp-sync ddp flat  # DDP's buckets vs one all-reduce
    python -m benchmarks.throughput --models small --compile on model --graphs on   # per sublayer vs whole forward
    python -m benchmarks.throughput --models small --graphs on --set 'model.flex_fwd=[]' --set   # A/B of overrides

One step = forward + backward + gradient clipping + AdamW (fused on CUDA) + the routing-bias update,
bf16 autocast on CUDA, as `platform.run trainer=gpu` trains. Per model size, residual, compile
switch and recomputation choice: ms/step (median of CUDA-event-timed steps after warm-up),
tokens/s, model TFLOP/s (analytic FLOPs of `platform.accounting`: 3x forward, no recomputation),
MFU against the bf16 matmul rate measured in this process (`roofline.matmul_rate`) and against the
datasheet's dense bf16 peak, and peak memory. Ratios to vanilla are within one process, because
timings of the same run swing 13-17% between invocations on a shared host. Batches are packed
like real data: about 2 documents per 1024 tokens.

`--ddp N` also times the same per-GPU batch on N GPUs (DistributedDataParallel over NCCL, one
process per GPU) and reports the scaling efficiency: tokens/s on N GPUs / (N x tokens/s on 1);
`--ddp-sync flat` averages the gradients after the backward in one all-reduce instead
(`trainer.grad_sync=flat`, platform/parallel.py).
`--set` overrides the config of every row; given several times, each set is timed as its own rows
of the one table (an empty `--set`: the defaults). A row that raises is reported FAILED in its row.
A residual may carry overrides of its own row after `@`: config keys (`mhc@residual.stream_dtype=bf16`), or
`py:MODULE.NAME.ATTR=VALUE`, a setting of the code (a kernel's variant, a class attribute) held for that row alone
and restored after it (`attnres_block@py:residuals.attnres_block.BlockSummaries.sum_in_merge=False`).
Writes benchmarks/results/throughput_<models>[_ddpN][tag].md via `roofline.Table`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from benchmarks.roofline import Table, held



def code_settings(run: str) -> list[tuple[object, str, object]]:
    """The ``py:MODULE.NAME.ATTR=VALUE`` parts of a row's name as (object, attribute, value): the longest importable
    prefix is the module, the rest a chain of attributes whose last must exist; VALUE is a Python literal (else a
    string). A part that does not resolve is a ValueError naming it."""
    import ast
    import importlib

    settings = []
    for part in run.split("@")[1:]:
        if not part.startswith("py:"):
            continue
        path, sep, text = part[3:].partition("=")
        names = path.split(".")
        if not sep or len(names) < 2:
            raise ValueError(f"{part!r}: a code setting is py:MODULE.NAME.ATTR=VALUE")
        for cut in range(len(names) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(names[:cut]))
                break
            except ImportError:
                continue
        else:
            raise ValueError(f"{part!r}: no importable module in {path!r}")
        try:
            for name in names[cut:-1]:
                obj = getattr(obj, name)
            getattr(obj, names[-1])
        except AttributeError as exc:
            raise ValueError(f"{part!r}: {exc}") from None
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        settings.append((obj, names[-1], value))
    return settings


def build(model_name: str, residual: str, vocab: int, overrides: list[str], device: str):
    """``residual``: a registered residual, or ``ablation=<name>`` (the preset picks the residual); either may carry
    overrides of its own row after ``@`` (``mhc@residual.stream_dtype=bf16``, several joined by ``@``); the
    ``py:`` ones are code settings (``code_settings``), which the caller holds around the row, not config."""
    from platform.config import compose, residual_config
    from platform.model import Backbone

    residual, *own = residual.split("@")
    own = [part for part in own if not part.startswith("py:")]
    choice = residual if residual.startswith("ablation=") else f"residual={residual}"
    cfg = compose(f"model={model_name}", choice, *overrides, *own)
    with torch.device(device):  # initialised where it runs: no host-side init of a billion weights
        model = Backbone(cfg.model, vocab, residual_config(cfg))
    return model, cfg


def row_overrides(attention: str, extra: list[str], recompute: str | None) -> list[str]:
    """The config overrides of one table row: the attention backend, one --set, the recompute choice."""
    return [f"model.attention={attention}", *extra] + ([f"model.recompute={recompute}"] if recompute else [])


def check_configs(models: list[str], runs: list[str], sets: list[list[str]], recompute: list, attention: str,
                  vocab: int) -> None:
    """Build every row's model on the meta device (no memory, no compute) before any row is timed: the
    config, the residual's validation and the model's own checks, as the timed build runs them.
    SystemExit naming the row and the error (a bad override in a later --set would otherwise end the
    run after the earlier rows)."""
    for model_name in models:
        for extra in sets:
            for rec in recompute:
                for name in runs:
                    try:
                        code_settings(name)
                        build(model_name, name, vocab, row_overrides(attention, extra, rec), "meta")
                    except Exception as e:  # noqa: BLE001 - Hydra's and ours: reported with the row
                        raise SystemExit(f"error: {model_name} {name} {' '.join(extra)}: "
                                         f"{' '.join(str(e).split())[:300]}") from None


def run_names(residual_names: list[str], ablation_names: list[str]) -> list[str]:
    """What ``build`` takes, residuals first, then ``ablation=<name>`` per ablation; an unknown name is
    a SystemExit before any work, listing the registered ones."""
    import ablations
    import residuals

    try:
        for n in residual_names:
            residuals.get(n.split("@")[0])
        for n in ablation_names:
            ablations.get(n.split("@")[0])
    except KeyError as exc:
        raise SystemExit(f"error: {exc.args[0]}") from None
    return [*residual_names, *(f"ablation={n}" for n in ablation_names)]


def packed_batch(batch: int, seq: int, vocab: int, device: str, seed: int = 0):
    """Random tokens; document starts with probability 1/512 (about 2 documents per 1024 tokens)."""
    g = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=g)
    starts = torch.rand(batch, seq + 1, device=device, generator=g) < 1 / 512
    return tokens, torch.cumsum(starts.long(), 1)


class _Replay(torch.nn.Module):
    """A captured loss as a module holding the model, so DDP registers its gradient hooks on the model's
    parameters (the replayed graph hands them their gradients through autograd, as eager code does)."""

    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, tokens, docs):
        return self.loss(tokens, docs)


def training_step(model, batch: int, seq: int, vocab: int, device: str, seed: int = 0, ddp: bool = False,
                  graphs: bool = False, ddp_comm: str = "fp32", ddp_sync: str = "ddp"):
    """One training step as `platform.run` trains (bf16 autocast on CUDA, clipping, AdamW fused on
    CUDA, the routing-bias update), on one fixed packed batch: returns ``step()``.

    ``ddp``: through DistributedDataParallel;
    ``graphs``: forward and backward replayed as CUDA graphs (`trainer.cuda_graphs`), captured here;
    ``ddp_comm``: the gradient all-reduce's dtype under DDP (`trainer.ddp_comm`); ``ddp_sync``: how the
    ranks average gradients (`trainer.grad_sync`: "ddp" wraps the loss in DistributedDataParallel,
    "flat" averages after the backward with `platform.parallel.all_reduce_gradients`)."""
    from platform.graphs import TrainLoss, graphed_loss
    from platform.module import clip_in_fused_step
    from platform.moe import update_biases
    from platform.parallel import all_reduce_gradients
    from platform.train import ddp_comm_hook

    model.train()
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    moes = [m for _, m in model.moe_layers()]
    tokens, docs = packed_batch(batch, seq, vocab, device, seed=seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    loss_fn = TrainLoss(model)
    if graphs:
        with autocast:
            loss_fn = _Replay(model, graphed_loss(model, tokens, docs))
    flat = ddp and ddp_sync == "flat"
    if ddp and not flat:
        loss_fn = torch.nn.parallel.DistributedDataParallel(loss_fn)
        hook = ddp_comm_hook(ddp_comm)
        if hook is not None:
            loss_fn.register_comm_hook(None, hook)

    def step():
        with autocast:
            loss = loss_fn(tokens, docs)
        loss.backward()
        if flat:
            all_reduce_gradients(model.parameters(), ddp_comm)
        if cuda:  # as LMModule clips for its fused AdamW: inside the step
            clip_in_fused_step(opt, model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_biases(moes)

    return step


def free_between_rows() -> int:
    """Free what an earlier row left on the GPU and return the bytes still allocated: its graphed callables (reference
    cycles), the cached blocks, and the cuBLAS / cuBLASLt workspaces, which PyTorch keeps per (handle, stream) pair
    until told otherwise: before 2026-12-06 (end) 0.16 GiB stayed after a table's first row and 64 MiB more after each
    next one (H100 logs), the size of two 32 MiB workspaces for each graph capture's side stream, and the next rows'
    peaks counted them. PyTorch's own memory leak check clears them the same way
    (``torch._C._cuda_clearCublasWorkspaces``)."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent: what stays is subtracted all the same
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def time_training(model, batch: int, seq: int, vocab: int, steps: int, warmup: int, device: str,
                  compile_mode: str, ddp: bool = False, graphs: bool = False,
                  ddp_comm: str = "fp32", ddp_sync: str = "ddp", inductor: dict | None = None) -> tuple[float, float]:
    """(median seconds per step, peak GiB) of `steps` timed training steps after `warmup` ones.
    ``inductor``: the row's Inductor settings (its config's trainer.compile_options)."""
    if compile_mode != "off":  # on: trainer.compile=true with compile_scope=sublayers; model: the whole forward
        model.compile_as("model" if compile_mode == "model" else "sublayers", inductor)
    if compile_mode == "sublayers":  # the sublayers only, the loss eager (trainer.compile before 2026-11-30)
        from platform.model import cross_entropy
        model.cross_entropy = cross_entropy
    cuda = device.startswith("cuda")
    rank = torch.distributed.get_rank() if ddp else 0
    if cuda:  # the peak covers the warm-up (and a graph's capture), whose pools stay allocated
        torch.cuda.reset_peak_memory_stats()
    step = training_step(model, batch, seq, vocab, device, seed=rank, ddp=ddp,
                         graphs=graphs, ddp_comm=ddp_comm, ddp_sync=ddp_sync)

    for _ in range(warmup):
        step()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        peak = float("nan")
    return statistics.median(times), peak


def _ddp_rank(rank: int, world: int, init_file: str, job: dict, out: dict) -> None:
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank}" if cuda else "cpu"  # gloo on CPU: only to check this code path without GPUs
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    # a file rendezvous: no TCP port to pick (a port found free can be taken before the ranks bind it)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world)
    try:
        torch.manual_seed(0)
        model, cfg = build(job["model"], job["residual"], job["vocab"], job["overrides"], device)
        sec, peak = time_training(model, job["batch"], cfg.model.seq_len, job["vocab"], job["steps"], job["warmup"],
                                  device, job["compile"], ddp=True, graphs=job["graphs"], ddp_comm=job["ddp_comm"],
                                  ddp_sync=job["ddp_sync"], inductor=dict(cfg.trainer.compile_options))
        times = torch.tensor([sec], device=device)
        torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)  # the slowest rank sets the pace
        if rank == 0:
            out["sec"], out["peak"] = float(times), peak
        del model
        gc.collect()  # the DDP wrapper (and its communication hook) gone before its process group
        torch.distributed.barrier()  # no rank tears the group down while another still talks to it
    finally:
        torch.distributed.destroy_process_group()


def time_ddp(world: int, job: dict) -> tuple[float, float]:
    import tempfile

    import torch.multiprocessing as mp

    from platform.env import GPU_SAFE_DEFAULTS

    for key, value in GPU_SAFE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    out = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ddp_rank, args=(world, os.path.join(tmp, "rendezvous"), job, out), nprocs=world, join=True)
    return out["sec"], out["peak"]


def main(argv=None) -> str:
    import residuals
    from platform import accounting
    from platform.parallel import resolve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["small", "medium"])
    p.add_argument("--residuals", nargs="+", default=["vanilla"],
                   help=f"any of {residuals.names()}; NAME@KEY=VALUE[@...] adds overrides to that row alone "
                        "(mhc@residual.stream_dtype=bf16 beside mhc and vanilla, in one process); @py:MODULE.NAME.ATTR=VALUE holds a "
                        "setting of the code for that row alone")
    p.add_argument("--ablations", nargs="*", default=[], help="registered ablations, timed after the residuals")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (per GPU)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--compile", nargs="+", default=["on"], choices=["off", "on", "sublayers", "model"],
                   help="on: torch.compile each attention / MLP sublayer and the loss (trainer.compile); sublayers: "
                        "the sublayers only, the loss eager; model: the whole forward below the attention mask and the loss "
                        "(trainer.compile_scope=model)")
    p.add_argument("--graphs", nargs="+", default=["off"], choices=["off", "on"],
                   help="on: replay forward + backward as CUDA graphs (trainer.cuda_graphs; platform/graphs.py)")
    p.add_argument("--recompute", nargs="+", default=[None], help="model.recompute values (default: the model's)")
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--set", nargs="*", action="append", default=None,
                   help="extra config overrides, e.g. model.checkpoint_reads=false; given again, another set, timed "
                        "as rows of their own in the same process (an empty --set: the defaults)")
    p.add_argument("--ddp", type=int, default=0, help="also time N GPUs with DDP at the same per-GPU batch")
    p.add_argument("--ddp-comm", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                   help="gradient all-reduce dtype of the DDP runs (trainer.ddp_comm); one DDP row each")
    p.add_argument("--ddp-sync", nargs="+", default=["auto"], choices=["auto", "ddp", "flat"],
                   help="how the DDP runs average gradients (trainer.grad_sync): ddp, DistributedDataParallel's "
                        "buckets; flat, one all-reduce after the backward; auto (the default), flat with --graphs "
                        "on, else ddp; one DDP row each")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    a = p.parse_args(argv)
    runs = run_names(a.residuals, a.ablations)
    sets = a.set or [[]]
    check_configs(a.models, runs, sets, a.recompute, a.attention, a.vocab)  # a bad override fails before any timing
    if a.ddp and torch.cuda.is_available() and torch.cuda.device_count() < a.ddp:
        raise SystemExit(f"--ddp {a.ddp}: only {torch.cuda.device_count()} CUDA device(s) here")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the same two denominators as the MFU a training run logs (platform.accounting)
    measured, datasheet = accounting.peak_rates(torch.device(device))

    def mfu(flops_per_s: float, peak: float | None) -> str:
        return f"{100 * flops_per_s / peak:.1f}%" if peak else "-"

    if "on" in a.graphs and device != "cuda":
        raise SystemExit("error: --graphs on: CUDA graphs need a CUDA device; valid here: --graphs off")
    columns = ["model", "residual", "compile", "graphs", "recompute", "GPUs", "tokens/step", "ms/step", "tokens/s",
               "vs vanilla", "TFLOP/s", "MFU (measured bf16)", "MFU (datasheet)", "peak GiB"]
    if len(sets) > 1:
        columns.insert(1, "overrides")
    if a.ddp:
        columns.append(f"scaling x{a.ddp}")
    title = f"Training-step throughput ({', '.join(a.models)}; batch {a.batch} per GPU, vocab {a.vocab})"
    table = Table(title, columns,
                  notes=[f"bf16 matmul measured here: {measured / 1e12:.0f} TFLOP/s; datasheet dense bf16: "
                         f"{datasheet / 1e12:.0f} TFLOP/s" if measured and datasheet else "CPU: no MFU",
                         "model FLOPs = 3 x analytic forward FLOPs (platform.accounting; attention at full causal "
                         "context, recomputation not counted); MFU per GPU",
                         "peak GiB: the most allocated from the run's start (warm-up and a graph's capture included), "
                         "the previous run's memory (its cuBLAS workspaces too) freed first and what stays allocated "
                         "of it not counted",
                         f"median of {a.steps} steps after {a.warmup} warm-up steps; attention={a.attention}"
                         + (f"; {' '.join(sets[0])}" if len(sets) == 1 and sets[0] else "")])
    out_name = "throughput_" + "_".join(a.models) + (f"_ddp{a.ddp}" if a.ddp else "") + (
        "" if device == "cuda" else "_cpu") + a.tag
    total = len(a.models) * len(a.compile) * len(a.graphs) * len(sets) * len(a.recompute) * len(runs)
    done = 0  # runs timed so far
    for model_name in a.models:
        for comp, graph, extra in [(c, g, e) for c in a.compile for g in a.graphs for e in sets]:
            graphs = graph == "on"
            for rec in a.recompute:
                base = None
                for name in runs:
                    if done:  # before each run, the rows timed so far: a time limit that stops the run keeps them
                        table.write(out_name, partial=f"{done} of {total} runs timed")
                    done += 1
                    overrides = row_overrides(a.attention, extra, rec)
                    torch._dynamo.reset()  # every row compiles afresh: no graphs (or recompile counts) of earlier rows
                    left = free_between_rows()  # the bytes earlier rows left: not this row's peak
                    torch.manual_seed(0)
                    with held(code_settings(name)):  # a row's py: settings, for its build and its steps alone
                        model, cfg = build(model_name, name, a.vocab, overrides, device)
                        seq = cfg.model.seq_len
                        flops_per_token = 3 * accounting.forward_flops_per_token(model, cfg.model, a.vocab)
                        failed = ""
                        try:
                            sec, peak = time_training(model, a.batch, seq, a.vocab, a.steps, a.warmup, device, comp,
                                                      graphs=graphs, inductor=dict(cfg.trainer.compile_options))
                        except torch.OutOfMemoryError:
                            sec, peak = float("nan"), float("inf")
                        except Exception as e:  # noqa: BLE001 - a row that cannot run (e.g. no kernel for its
                            # settings) is reported in its row; the other rows of the table are still timed
                            failed = f"FAILED: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
                            sec, peak = float("nan"), float("nan")
                            print(f"{model_name} {name} {' '.join(extra)}: {failed}", flush=True)
                    del model
                    after = free_between_rows()  # graphed callables live in reference cycles: freed before the next run
                    if device == "cuda":
                        print(f"  (allocated after the run, freed: {after / 2**30:.2f} GiB)", flush=True)
                        peak -= left / 2**30
                    tokens = a.batch * seq
                    tps = tokens / sec
                    if name == "vanilla":
                        base = tps
                    row = [model_name, *([" ".join(extra) or "-"] if len(sets) > 1 else []), name, comp, graph,
                           cfg.model.recompute, "1", f"{tokens:,}"]
                    if failed:
                        table.add(*row, failed, "-", "-", "-", "-", "-", "-", *([""] if a.ddp else []))
                        continue
                    if peak == float("inf"):
                        table.add(*row, "OOM", "-", "-", "-", "-", "-", "> device", *([""] if a.ddp else []))
                        print(f"{model_name} {name} compile={comp} graphs={graph}: OOM", flush=True)
                        continue
                    flops = tps * flops_per_token
                    cells = [f"{sec * 1e3:.1f}", f"{tps:,.0f}", f"{tps / base:.3f}" if base else "-",
                             f"{flops / 1e12:.1f}", mfu(flops, measured), mfu(flops, datasheet), f"{peak:.2f}"]
                    table.add(*row, *cells, *([""] if a.ddp else []))
                    print(f"{model_name} {name} compile={comp} graphs={graph} recompute={cfg.model.recompute}: "
                          f"{sec * 1e3:.1f} ms/step, {tps:,.0f} tokens/s, MFU {mfu(flops, measured)} "
                          f"(datasheet {mfu(flops, datasheet)}), peak {peak:.2f} GiB", flush=True)
                    syncs = dict.fromkeys(resolve(y, graphs) for y in a.ddp_sync)  # as trainer.grad_sync resolves
                    for comm, sync in [(c, y) for y in syncs for c in a.ddp_comm] if a.ddp else []:
                        job = {"model": model_name, "residual": name, "vocab": a.vocab, "overrides": overrides,
                               "batch": a.batch, "steps": a.steps, "warmup": a.warmup, "compile": comp,
                               "graphs": graphs, "ddp_comm": comm, "ddp_sync": sync}
                        sec_n, peak_n = time_ddp(a.ddp, job)
                        tps_n = a.ddp * tokens / sec_n
                        flops_n = tps_n * flops_per_token / a.ddp
                        table.add(*row[:-3], cfg.model.recompute, f"{a.ddp} ({sync}, {comm} all-reduce)",
                                  f"{a.ddp * tokens:,}", f"{sec_n * 1e3:.1f}", f"{tps_n:,.0f}", "-",
                                  f"{flops_n / 1e12:.1f}", mfu(flops_n, measured), mfu(flops_n, datasheet),
                                  f"{peak_n:.2f}", f"{tps_n / (a.ddp * tps):.3f}")
                        print(f"  DDP x{a.ddp} ({sync}, {comm} all-reduce): {sec_n * 1e3:.1f} ms/step, {tps_n:,.0f} tokens/s, "
                              f"scaling efficiency {tps_n / (a.ddp * tps):.3f}", flush=True)
    table.write(out_name)
    return table.markdown()


if __name__ == "__main__":
    main()
