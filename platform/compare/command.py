"""Running a comparison: find each (variant, seed) in MLflow, train what is missing (each run its own
`platform.run` process; with `compare.workers=N`, N at a time, one GPU each), then write the table,
the plots and the JSON to the output folder, the report path and an MLflow comparison run."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from .. import tracking
from ..accounting import token_budget
from ..config import compose
from ..env import REPO_ROOT, check_workers, machine_description, repo_path, run_in_slots, visible_gpus
from .matching import RunRecord, config_key, finished_runs_by_key, flat_params, nearest_difference, record_of
from .plan import CompareConfig, Variant, plan_variants
from .plots import plot_bars, plot_curves
from .table import Row, build_rows, markdown, reached_times, runs_markdown, summary, to_resolve_markdown


def train_run(base: Sequence[str], variant: Variant, seed: int, run_dir: Path, env: dict | None = None,
              log: Path | None = None) -> int:
    """One run as its own `platform.run` process; returns its exit code. With `log`, its output goes there."""
    cmd = [sys.executable, "-m", "platform.run", *base, variant.override, f"seed={seed}", f"hydra.run.dir={run_dir}"]
    where = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" if env and "CUDA_VISIBLE_DEVICES" in env else ""
    print(f"$ python {' '.join(cmd[1:])}{where}" + (f"  > {log}" if log else ""), flush=True)
    if log is None:
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env).returncode
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode


def trained_on(rows: list[Row]) -> str:
    """The devices the table's runs were trained on (their platform.device tags), with run counts."""
    counts: dict[str, int] = {}
    for r in rows:
        for x in r.records:
            counts[x.device or "not recorded"] = counts.get(x.device or "not recorded", 0) + 1
    return ", ".join(f"{device} ({n} runs)" for device, n in sorted(counts.items())) or "no runs"


def speed_caveat(rows: list[Row]) -> str:
    """A warning under the table when its speed columns come from runs that shared their device (the
    platform.shared_by tag) or do not say whether they did; empty when every run ran alone."""
    shares = [x.shared_by for r in rows for x in r.records]
    if not shares or all(s == 1 for s in shares):
        return ""
    shared, unknown = max(shares), sum(s == 0 for s in shares)
    what = (f"up to {shared} runs shared one device at once" if shared > 1 else "") + (
        (" and " if shared > 1 else "") + f"{unknown} run(s) do not record whether they shared it" if unknown else "")
    verb = "are not" if shared > 1 else "may not be"
    return (f"**Speed columns:** {what}, so tokens/s and the times to the target's loss {verb} the variants' own "
            "speeds (the losses are unaffected). Measure those with `python -m benchmarks.throughput`, every "
            "variant in one process.")


def n_workers(cc: CompareConfig, gpus: list[str]) -> int:
    return cc.workers if cc.workers > 0 else max(1, len(gpus))


def train_missing(base: Sequence[str], jobs: list[tuple[Variant, int]], out_dir: Path, workers: int,
                  gpus: list[str]) -> dict[tuple[str, int], int]:
    """Train the (variant, seed) jobs, `workers` at a time, worker i on GPU i (`env.run_in_slots`); with
    several workers each run's output goes to its train.log. Returns {(variant, seed): exit code}."""
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def launch(job, env, parallel):
        variant, seed = job
        run_dir = out_dir / "runs" / f"{variant.name}_s{seed}_{stamp}"
        return train_run(base, variant, seed, run_dir, env=env, log=run_dir / "train.log" if parallel else None)

    codes = run_in_slots(jobs, workers, gpus, launch)
    return {(v.name, s): rc for (v, s), rc in zip(jobs, codes)}


def run_compare(cc: CompareConfig, base: list[str], command: str = "") -> tuple[str, list[Row]]:
    variants = plan_variants(cc)
    name = cc.name or "_".join(v.name for v in variants)
    out_dir = repo_path(cc.out_dir) if cc.out_dir else REPO_ROOT / "outputs" / "compare" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    seed0 = (cc.seeds or [0])[0]
    cfgs = {v.name: compose(*base, v.override, f"seed={seed0}") for v in variants}
    budgets = {n: token_budget(c) for n, c in cfgs.items()}
    if len(set(budgets.values())) > 1:
        raise ValueError(f"the variants train different token budgets {budgets}: a comparison needs one budget")
    cfg0 = cfgs[variants[0].name]
    gpus = visible_gpus()
    workers = n_workers(cc, gpus)
    if workers > 1:
        check_workers(workers, gpus, cfg0.trainer.devices, "compare.workers")
    client, uri, exp_id = tracking.open_experiment(cfg0)  # the store exists before any worker starts

    wants = {v.name: flat_params(cfgs[v.name]) for v in variants}
    keys = {n: config_key(w) for n, w in wants.items()}
    residual_of = {v.name: cfgs[v.name].residual.name for v in variants}

    def lookup():
        idx = {v.name: finished_runs_by_key(client, exp_id, residual_of[v.name]) for v in variants}
        seeds = {v.name: (cc.seeds if cc.seeds is not None else sorted(s for k, s in idx[v.name] if k == keys[v.name]))
                 for v in variants}
        return idx, seeds

    index, seeds_of = lookup()
    jobs = [(v, s) for v in variants for s in seeds_of[v.name] if not index[v.name].get((keys[v.name], s))]
    jobs.sort(key=lambda job: job[1])  # seed by seed: a study cut short still holds whole seeds of every variant
    codes: dict[tuple[str, int], int] = {}
    if cc.train and jobs:
        print(f"{len(jobs)} run(s) to train, {workers} at a time"
              + (f" on GPU(s) {','.join(gpus)}" if gpus else " on the CPU"), flush=True)
        codes = train_missing(base, jobs, out_dir, workers, gpus)
        index, seeds_of = lookup()

    records: dict[str, list[RunRecord]] = {}
    missing, failed = [], []
    for v in variants:
        if not seeds_of[v.name]:
            missing.append(f"{v.name}: " + nearest_difference(client, exp_id, residual_of[v.name], wants[v.name]))
        recs = []
        for seed in seeds_of[v.name]:
            rc = codes.get((v.name, seed))
            if rc not in (None, 0):
                failed.append(f"{v.name} seed {seed} (exit code {rc})")
                continue
            runs = index[v.name].get((keys[v.name], seed), [])
            if not runs:
                missing.append(f"{v.name} seed {seed}: "
                               + nearest_difference(client, exp_id, residual_of[v.name], wants[v.name]))
                continue
            recs.append(record_of(client, runs[0], seed, trained_now=(v.name, seed) in codes))
        records[v.name] = recs

    names = {v.name for v in variants}
    references = [r for r in cc.references if r in names]
    target = cc.target if cc.target in names else (references[0] if references else None)
    rows = build_rows(variants, records, cc.level, references, target)
    t = cfg0.trainer
    title = f"{name}: {cfg0.model.name}, {t.max_steps} steps"
    curves = plot_curves(rows, out_dir / "compare.png", title)
    bars = plot_bars(rows, out_dir / "compare_bars.png", title, cc.level, reference=target)
    trained = len([c for c in codes.values() if c == 0])
    written = time.strftime('%Y-%m-%d %H:%M %Z')  # one date for compare.md and the report (each rendered below)

    def document(curves_name: str | None, bars_name: str | None) -> str:
        lines = [
            f"# Comparison `{name}`",
            "",
            f"- command: `{command or 'python -m platform.compare'}`",
            f"- date: {written}; report written on: {machine_description()}; runs trained "
            f"on: {trained_on(rows)}",
            f"- model `{cfg0.model.name}`, {t.max_steps} steps x {cfg0.data.batch_size} x {cfg0.model.seq_len} tokens "
            f"= {budgets[variants[0].name]:,} training tokens per run (every variant); data order: a function of "
            f"the seed only, the same for every variant of a seed; MLflow experiment `{cfg0.mlflow.experiment}` "
            f"at `{tracking.display_uri(uri)}`",
            f"- runs: {sum(len(r.records) for r in rows)} ({trained} trained now, {workers} at a time; the rest "
            "reused from MLflow by config)",
            "",
            markdown(rows, cc.level, references),
            f"Final val loss: the last validation of each run ({t.val_batches} batches, nats/token). Intervals: "
            "Student t over seeds. Δ = variant − reference (negative: the variant is better); *paired* by seed "
            "when both have the same seeds (seed-to-seed variation cancels), else *Welch*; `*`: the interval "
            "excludes 0. Paper numbers are at full scale and not comparable in absolute value. "
            "Tokens/s: median over logged intervals and seeds; peak memory: "
            + ("process max RSS (CPU)" if t.accelerator == "cpu" else "max allocated (GPU)")
            + ", median over seeds."
            + (f" Time to {target}'s loss: wall-clock seconds from the run's start until its validation loss "
               f"first reaches the final validation loss of the `{target}` run with the same seed, linearly "
               "interpolated between the two validations around it (mean over the seeds that reach it, with "
               "the mean step at which they do, which does not depend on the device's speed; "
               f"speed-up = {target}'s mean time / the variant's)." if target else ""),
            "",
        ]
        sharing = speed_caveat(rows)
        if sharing:
            lines += [sharing, ""]
        to_resolve = to_resolve_markdown(rows, references)
        if to_resolve:
            lines += [to_resolve]
        if curves_name:
            lines += [f"![validation curves]({curves_name})", ""]
        if bars_name:
            lines += [f"![final loss with intervals]({bars_name})", ""]
        lines += ["## Runs", "", runs_markdown(rows)]
        if missing or failed:
            lines += ["## Missing", ""] + [f"- {m}" for m in missing] + [f"- failed: {f}" for f in failed] + [""]
        return "\n".join(lines)

    text = document(curves.name if curves else None, bars.name if bars else None)
    (out_dir / "compare.md").write_text(text)
    data = summary(rows)
    (out_dir / "compare.json").write_text(json.dumps(data, indent=2, default=str))
    if cc.report:
        rep = repo_path(cc.report)
        rep.parent.mkdir(parents=True, exist_ok=True)
        extra = {}
        for src, suffix in ((curves, ".png"), (bars, "_bars.png")):
            if src:
                dst = rep.with_name(rep.stem + suffix)
                shutil.copyfile(src, dst)
                extra[suffix] = dst.name
        rep.with_name(rep.stem + ".json").write_text(json.dumps(data, indent=2, default=str))
        rep.write_text(document(extra.get(".png"), extra.get("_bars.png")))
    if cc.log_comparison:
        log_comparison(client, exp_id, name, cc, base, rows, out_dir, [p for p in (curves, bars) if p])
    print(text)
    if failed or missing:
        print(f"warning: {len(failed)} run(s) failed, {len(missing)} missing; see above", file=sys.stderr)
    return text, rows


def log_comparison(client, exp_id, name, cc, base, rows: list[Row], out_dir: Path, plots: list[Path]) -> str:
    from mlflow.entities import Metric, Param

    tags = {**tracking.run_tags(), "platform.kind": "comparison",
            "compare.variants": ",".join(r.variant.name for r in rows)}
    run_id = client.create_run(exp_id, tags=tags, run_name=f"compare-{name}"[:250]).info.run_id
    params = [Param("compare/runs", ",".join(cc.runs)), Param("compare/seeds", str(cc.seeds)),
              Param("compare/base_overrides", " ".join(base)[:6000]), Param("compare/level", str(cc.level)),
              Param("compare/references", ",".join(cc.references)), Param("compare/workers", str(cc.workers))]
    now, metrics = int(time.time() * 1000), []
    for r in rows:
        times = reached_times(r)
        values = [("val_loss_mean", r.interval.estimate), ("val_loss_ci", r.interval.half_width),
                  ("n", len(r.records)), ("delta", r.delta.estimate if r.delta else math.nan),
                  ("delta_ci", r.delta.half_width if r.delta else math.nan),
                  ("time_to_target_s", sum(times) / len(times) if times else math.nan),
                  ("reached_target", len(times))]
        for ref, iv in r.refs.items():
            values += [(f"vs_{ref}", iv.estimate if iv else math.nan), (f"vs_{ref}_ci", iv.half_width if iv else math.nan)]
        for k, v in values:
            if v is not None and math.isfinite(v):
                metrics.append(Metric(f"{r.variant.name}/{k}", float(v), now, 0))
    for i in range(0, len(metrics), 500):
        client.log_batch(run_id, metrics=metrics[i:i + 500], params=params if i == 0 else [])
    if not metrics:
        client.log_batch(run_id, params=params)
    for f in ("compare.md", "compare.json"):
        client.log_artifact(run_id, str(out_dir / f))
    for plot in plots:
        client.log_artifact(run_id, str(plot))
    client.set_terminated(run_id, "FINISHED")
    return run_id


def main(argv: Sequence[str] | None = None):
    from ..cli import one_line_errors, start
    from . import __doc__ as compare_doc
    from .plan import parse_args

    argv = start(argv, compare_doc)
    if argv is None:
        return None
    with one_line_errors(argv):
        cc, base = parse_args(argv)
        text, rows = run_compare(cc, base, command="python -m platform.compare " + " ".join(argv))
    expected = len(cc.seeds) if cc.seeds is not None else 1
    if any(len(r.records) < expected for r in rows):
        raise SystemExit(1)
    return rows
