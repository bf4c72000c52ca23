"""Variants x seeds, with confidence intervals, from MLflow: `python -m platform.compare [compare.*] [overrides]`.

Examples (from the repo root):
    python -m platform.compare compare.runs=[vanilla,msar_block] compare.seeds=[0,1,2] trainer.max_steps=300
    python -m platform.compare compare.runs=[wo_conv,attnres_mhc_sum] trainer.max_steps=300   # + their baseline
    python -m platform.compare compare.runs=[vanilla,msar_block] compare.train=false          # only read MLflow
    python -m platform.compare compare.runs=[msar_block] compare.seeds=null compare.train=false   # every seed found

`compare.*` options (typed; a misspelt one fails):
    runs          residual or ablation names (an ablation when one of that name is registered)
    seeds         seeds per variant (default [0,1,2]); null with train=false: every seed found
    train         true: train what MLflow lacks; false: only read MLflow (runs from earlier, or another machine)
    baseline      what plain residuals are compared with (default vanilla); an ablation uses its own `baseline`
    add_baselines also run/read the baselines of the variants (default true)
    name          report name (default: the variants joined by "_"); out_dir, report: where files go
    level         confidence level (default 0.95)
Every other argument is a config override shared by all runs (`trainer.max_steps=300`, `model=small`,
`trainer=gpu`, `mlflow.experiment=...`); `residual=`, `ablation=` and `seed=` come from `compare.*`.

A run counts for (variant, seed) when a FINISHED MLflow run has the same config: the same
model/data/trainer/residual params as the run `platform.run` would make (hash of the logged params,
without knobs that do not change the numbers: progress bar, threads, checkpoint and log intervals,
compile, data workers and cache dir). So a comparison resumes: run it again and only the missing runs
train; runs made by `platform.run`, sweeps or another machine's store count alike. Each missing run
is its own `python -m platform.run` process (a crash costs one run, and the process's peak memory is
that run's).

The table: per variant n seeds, mean final validation loss with its Student-t interval, the
difference to its baseline with an interval (paired by seed when both have the same seeds, else
Welch), the paper's number, median tokens/s and peak memory. Written as markdown and a PNG of the
validation curves (mean over seeds, band = min..max), and logged to an MLflow run tagged
`platform.kind=comparison`.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .env import REPO_ROOT, machine_description, set_offline_defaults  # noqa: E402

set_offline_defaults()

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from . import stats, tracking  # noqa: E402
from .accounting import token_budget  # noqa: E402
from .config import compose  # noqa: E402

# Knobs that do not change a run's numbers: runs that differ only in these are the same run.
HASH_IGNORED = ("trainer/progress_bar", "trainer/threads", "trainer/ckpt_every", "trainer/log_every",
                "trainer/compile", "data/num_workers", "data/cache_dir")
HASH_GROUPS = ("model/", "data/", "trainer/", "residual/")
# SPEC §5, main results (MoE, 18B tokens); the paper's method is the block variant.
PAPER_MAIN = {"vanilla": "1.799", "mhc": "1.776", "attnres": "1.769", "attnres_block": "1.769",
              "msar": "1.750", "msar_block": "1.750"}
PAPER_MAIN_NOTE = "final loss, MoE 18B tokens"


@dataclass
class CompareConfig:
    runs: list[str] = field(default_factory=lambda: ["vanilla", "msar_block"])  # residual or ablation names
    seeds: Optional[list[int]] = field(default_factory=lambda: [0, 1, 2])  # null (train=false): all found
    train: bool = True  # train the runs MLflow lacks; false: only read
    baseline: str = "vanilla"  # plain residuals' baseline; ablations use their own
    add_baselines: bool = True  # also run/read the variants' baselines
    name: Optional[str] = None  # report name; default the variants joined by "_"
    out_dir: Optional[str] = None  # default outputs/compare/<name>
    report: Optional[str] = None  # also write the markdown here (e.g. benchmarks/results/...)
    level: float = 0.95  # confidence level of the intervals
    log_comparison: bool = True  # log the table and plot to an MLflow comparison run


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "residual" | "ablation"
    override: str  # the config override that selects it
    baseline: str | None  # the variant it is compared with (None: it is the reference)
    paper: str = ""
    describe: str = ""


@dataclass
class RunRecord:
    seed: int
    run_id: str
    final_val_loss: float
    tokens_per_s: float
    peak_mem_mb: float
    val_curve: list[tuple[int, float]]
    trained_now: bool = False


# --- the command line ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> tuple[CompareConfig, list[str]]:
    """Split `compare.*` options (typed) from the config overrides that every run shares."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    node = OmegaConf.structured(CompareConfig)
    base = []
    for text, ov in zip(argv, OverridesParser.create().parse_overrides(list(argv))):
        key = ov.key_or_group
        if not key.startswith("compare."):
            if key.lstrip("+~") in ("residual", "ablation", "seed"):
                raise ValueError(f"{text!r}: the variants come from compare.runs and the seeds from compare.seeds")
            base.append(text)
            continue
        if ov.is_sweep_override():
            raise ValueError(f"{text!r}: give a list, e.g. compare.runs=[vanilla,msar_block]")
        OmegaConf.update(node, key[len("compare."):], ov.value(), merge=False)
    cc: CompareConfig = OmegaConf.to_object(node)
    if not cc.runs:
        raise ValueError("compare.runs is empty")
    if cc.seeds is not None and not cc.seeds:
        raise ValueError("compare.seeds is empty (null reads every seed found, with compare.train=false)")
    if cc.seeds is None and cc.train:
        raise ValueError("compare.seeds=null needs compare.train=false: training needs the seeds to run")
    if not 0 < cc.level < 1:
        raise ValueError(f"compare.level={cc.level} must be in (0, 1)")
    return cc, base


def resolve_variant(name: str, default_baseline: str) -> Variant:
    import ablations
    import residuals

    if name in ablations.names():
        ab = ablations.get(name)
        return Variant(name, "ablation", f"ablation={name}", ab.baseline if ab.baseline != name else None,
                       ab.paper, f"ablation: {ab.describe_changes()}")
    if name in residuals.names():
        paper = f"{PAPER_MAIN[name]} ({PAPER_MAIN_NOTE})" if name in PAPER_MAIN else ""
        return Variant(name, "residual", f"residual={name}", default_baseline if name != default_baseline else None,
                       paper, "residual")
    raise ValueError(f"compare.runs: {name!r} is neither a registered ablation ({', '.join(ablations.names())}) "
                     f"nor a residual ({', '.join(residuals.names())})")


def plan_variants(cc: CompareConfig) -> list[Variant]:
    """The variants in table order: each added baseline just before the first variant that needs it."""
    asked = [resolve_variant(n, cc.baseline) for n in dict.fromkeys(cc.runs)]
    names = {v.name for v in asked}
    out: list[Variant] = []
    for v in asked:
        if cc.add_baselines and v.baseline and v.baseline not in names:
            out.append(resolve_variant(v.baseline, cc.baseline))
            names.add(v.baseline)
        out.append(v)
    return out


# --- matching runs by config ------------------------------------------------------------------------
def flat_params(cfg: DictConfig) -> dict[str, str]:
    """The params `train` logs for this config, as MLflow stores them (Lightning's flattening, str, 250 chars)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    flat = _flatten_dict(_convert_params(OmegaConf.to_container(cfg, resolve=True)))
    return {k: str(v)[:250] for k, v in flat.items()}


def config_key(params: Mapping[str, str]) -> str:
    """Hash of what decides a run's numbers (model, data, trainer, residual params; not the seed)."""
    items = sorted((k, v) for k, v in params.items() if k.startswith(HASH_GROUPS) and k not in HASH_IGNORED)
    return hashlib.sha1(json.dumps(items).encode()).hexdigest()[:16]


def _search_all(client, experiment_ids: list[str], filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def finished_runs_by_key(client, experiment_id: str, residual: str) -> dict[tuple[str, int], list]:
    """FINISHED runs of a residual, grouped by (config key, seed), newest first."""
    flt = f"params.`residual/name` = '{residual}' and attributes.status = 'FINISHED'"
    out: dict[tuple[str, int], list] = {}
    for run in _search_all(client, [experiment_id], flt):
        p = run.data.params
        if "seed" not in p:
            continue
        try:
            seed = int(p["seed"])
        except ValueError:
            continue
        out.setdefault((config_key(p), seed), []).append(run)
    return out


def _nearest_difference(client, experiment_id: str, residual: str, want: Mapping[str, str]) -> str:
    """For a variant with no matching run: which params differ in the closest run of that residual."""
    flt = f"params.`residual/name` = '{residual}' and attributes.status = 'FINISHED'"
    runs = client.search_runs([experiment_id], filter_string=flt, max_results=50)
    if not runs:
        return f"no FINISHED run of residual {residual} in this experiment"
    keys = [k for k in want if k.startswith(HASH_GROUPS) and k not in HASH_IGNORED]

    def diff(run):
        return [k for k in keys if run.data.params.get(k) != want[k]]

    best = min(runs, key=lambda r: len(diff(r)))
    shown = ", ".join(f"{k}: {best.data.params.get(k)} (wanted {want[k]})" for k in diff(best)[:4])
    return f"closest run {best.info.run_id[:8]} differs in {shown}"


def record_of(client, run, seed: int, trained_now: bool = False) -> RunRecord:
    def history(key):
        return sorted(((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)))

    val = history("val/loss")
    metrics = run.data.metrics
    final = metrics.get("final/val_loss", val[-1][1] if val else math.nan)
    tps = stats.median([v for _, v in history("perf/tokens_per_s")])
    return RunRecord(seed, run.info.run_id, float(final), tps, float(metrics.get("perf/peak_mem_mb", math.nan)),
                     val, trained_now)


# --- training what is missing -------------------------------------------------------------------------
def train_run(base: Sequence[str], variant: Variant, seed: int, run_dir: Path) -> int:
    """One run as its own `platform.run` process; returns its exit code."""
    cmd = [sys.executable, "-m", "platform.run", *base, variant.override, f"seed={seed}", f"hydra.run.dir={run_dir}"]
    print(f"$ python {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, cwd=REPO_ROOT).returncode


# --- the table --------------------------------------------------------------------------------------
@dataclass
class Row:
    variant: Variant
    records: list[RunRecord]
    interval: stats.Interval
    delta: stats.Interval | None
    note: str = ""


def build_rows(variants: list[Variant], records: dict[str, list[RunRecord]], level: float = 0.95) -> list[Row]:
    rows = []
    for v in variants:
        recs = sorted(records.get(v.name, []), key=lambda r: r.seed)
        by_seed = {r.seed: r.final_val_loss for r in recs}
        iv = stats.mean_ci(list(by_seed.values()), level)
        delta, note = None, ""
        if v.baseline is not None:
            base = {r.seed: r.final_val_loss for r in records.get(v.baseline, [])}
            if base and by_seed:
                delta = stats.difference_ci(by_seed, base, level)
            else:
                note = f"baseline {v.baseline} not in the comparison" if not base else ""
        rows.append(Row(v, recs, iv, delta, note))
    return rows


def markdown(rows: list[Row], level: float = 0.95) -> str:
    pct = f"{round(level * 100)}%"
    headers = ["variant", "what", "n", "seeds", f"final val loss (mean ± {pct} CI)",
               f"Δ vs baseline (± {pct} CI)", "baseline", "paper", "tokens/s (median)", "peak mem MB (median)"]
    table = []
    for r in rows:
        if r.delta is not None:
            mark = " *" if r.delta.excludes_zero() else ""
            delta = f"{stats.fmt_interval(r.delta, signed=True)} ({r.delta.method}){mark}"
        else:
            delta = "— (reference)" if r.variant.baseline is None else f"n/a: {r.note}" if r.note else "n/a"
        table.append([f"`{r.variant.name}`", r.variant.describe, len(r.records),
                      ",".join(str(x.seed) for x in r.records) or "—", stats.fmt_interval(r.interval), delta,
                      r.variant.baseline or "", r.variant.paper or "",
                      stats.fmt(stats.median([x.tokens_per_s for x in r.records]), 0),
                      stats.fmt(stats.median([x.peak_mem_mb for x in r.records]), 0)])
    return stats.markdown_table(headers, table, "llrlllllrr")


def runs_markdown(rows: list[Row]) -> str:
    table = [[f"`{r.variant.name}`", x.seed, f"`{x.run_id}`", stats.fmt(x.final_val_loss),
              stats.fmt(x.tokens_per_s, 0), stats.fmt(x.peak_mem_mb, 0), "trained now" if x.trained_now else "reused"]
             for r in rows for x in r.records]
    return stats.markdown_table(["variant", "seed", "MLflow run", "final val loss", "tokens/s", "peak mem MB", ""],
                                table, "lrlrrrl")


def plot_curves(rows: list[Row], out: Path, title: str) -> Path | None:
    """Validation loss per variant: mean over seeds, band from the min to the max seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = False
    for r in rows:
        curves = [dict(x.val_curve) for x in r.records if x.val_curve]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        vals = np.array([[c[s] for s in steps] for c in curves])  # (seeds, steps)
        line, = ax.plot(steps, vals.mean(0), "o-", ms=3, label=f"{r.variant.name} (n={len(curves)})")
        if len(curves) > 1:
            ax.fill_between(steps, vals.min(0), vals.max(0), color=line.get_color(), alpha=0.2)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("val/loss (nats/token)")
    ax.set_title(title + "\nmean over seeds; band: min..max over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    # the interesting part is the end: zoom on the last two thirds of the curves
    ends = [v for r in rows for x in r.records for s, v in x.val_curve if x.val_curve and s >= x.val_curve[-1][0] / 3]
    if ends:
        lo, hi = min(ends), max(ends)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# --- the command -------------------------------------------------------------------------------------
def run_compare(cc: CompareConfig, base: list[str], command: str = "") -> tuple[str, list[Row]]:
    variants = plan_variants(cc)
    name = cc.name or "_".join(v.name for v in variants)
    out_dir = Path(cc.out_dir) if cc.out_dir else REPO_ROOT / "outputs" / "compare" / name
    out_dir = out_dir if out_dir.is_absolute() else REPO_ROOT / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    cfg0 = compose(*base, variants[0].override, f"seed={(cc.seeds or [0])[0]}")
    client, uri, exp_id = tracking.open_experiment(cfg0)

    records: dict[str, list[RunRecord]] = {}
    missing, failed, trained = [], [], 0
    for v in variants:
        cfg = compose(*base, v.override, f"seed={(cc.seeds or [0])[0]}")
        want = flat_params(cfg)
        key = config_key(want)
        index = finished_runs_by_key(client, exp_id, cfg.residual.name)
        seeds = cc.seeds if cc.seeds is not None else sorted(s for k, s in index if k == key)
        if not seeds:
            missing.append(f"{v.name}: " + _nearest_difference(client, exp_id, cfg.residual.name, want))
        recs = []
        for seed in seeds:
            runs = index.get((key, seed), [])
            trained_now = False
            if not runs and cc.train:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                rc = train_run(base, v, seed, out_dir / "runs" / f"{v.name}_s{seed}_{stamp}")
                if rc != 0:
                    failed.append(f"{v.name} seed {seed} (exit code {rc})")
                    continue
                trained += 1
                trained_now = True
                runs = finished_runs_by_key(client, exp_id, cfg.residual.name).get((key, seed), [])
            if not runs:
                missing.append(f"{v.name} seed {seed}: " + _nearest_difference(client, exp_id, cfg.residual.name, want))
                continue
            recs.append(record_of(client, runs[0], seed, trained_now))
        records[v.name] = recs

    rows = build_rows(variants, records, cc.level)
    t = cfg0.trainer
    tokens = token_budget(cfg0)
    lines = [
        f"# Comparison `{name}`",
        "",
        f"- command: `{command or 'python -m platform.compare'}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine_description()}",
        f"- model `{cfg0.model.name}`, {t.max_steps} steps x {cfg0.data.batch_size} x {cfg0.model.seq_len} tokens "
        f"= {tokens:,} training tokens per run; MLflow experiment `{cfg0.mlflow.experiment}` at `{uri}`",
        f"- runs: {sum(len(r.records) for r in rows)} ({trained} trained now, the rest reused from MLflow by config)",
        "",
        markdown(rows, cc.level),
        f"Final val loss: the last validation of each run ({t.val_batches} batches, nats/token). Intervals: "
        f"Student t over seeds. Δ = variant − baseline (negative: the variant is better); *paired* by seed when "
        "both have the same seeds (seed-to-seed variation cancels), else *Welch*; `*`: the interval excludes 0. "
        "Paper numbers are at full scale and not comparable in absolute value. "
        f"Tokens/s: median over logged intervals and seeds; peak memory: "
        + ("process max RSS (CPU)" if cfg0.trainer.accelerator == "cpu" else "max allocated (GPU)")
        + ", median over seeds.",
        "",
        "## Runs",
        "",
        runs_markdown(rows),
    ]
    if missing or failed:
        lines += ["## Missing", ""] + [f"- {m}" for m in missing] + [f"- failed: {f}" for f in failed] + [""]
    text = "\n".join(lines)
    (out_dir / "compare.md").write_text(text)
    if cc.report:
        rep = Path(cc.report) if Path(cc.report).is_absolute() else REPO_ROOT / cc.report
        rep.parent.mkdir(parents=True, exist_ok=True)
        rep.write_text(text)
    plot = plot_curves(rows, out_dir / "compare.png", f"{name}: {cfg0.model.name}, {t.max_steps} steps")
    summary = {r.variant.name: {"n": len(r.records), "seeds": [x.seed for x in r.records],
                                "mean": r.interval.estimate, "ci": r.interval.half_width,
                                "delta": r.delta.estimate if r.delta else None,
                                "delta_ci": r.delta.half_width if r.delta else None,
                                "delta_method": r.delta.method if r.delta else None,
                                "baseline": r.variant.baseline, "runs": [x.run_id for x in r.records]}
               for r in rows}
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=2, default=str))
    if cc.log_comparison:
        _log_comparison(client, exp_id, name, cc, base, rows, out_dir, plot)
    print(text)
    if failed or missing:
        print(f"warning: {len(failed)} run(s) failed, {len(missing)} missing; see above", file=sys.stderr)
    return text, rows


def _log_comparison(client, exp_id, name, cc, base, rows, out_dir, plot) -> str:
    from mlflow.entities import Metric, Param

    tags = {**tracking.run_tags(), "platform.kind": "comparison",
            "compare.variants": ",".join(r.variant.name for r in rows)}
    run_id = client.create_run(exp_id, tags=tags, run_name=f"compare-{name}"[:250]).info.run_id
    params = [Param("compare/runs", ",".join(cc.runs)), Param("compare/seeds", str(cc.seeds)),
              Param("compare/base_overrides", " ".join(base)[:6000]), Param("compare/level", str(cc.level))]
    now, metrics = int(time.time() * 1000), []
    for r in rows:
        for k, v in (("val_loss_mean", r.interval.estimate), ("val_loss_ci", r.interval.half_width),
                     ("n", len(r.records)), ("delta", r.delta.estimate if r.delta else math.nan),
                     ("delta_ci", r.delta.half_width if r.delta else math.nan)):
            if v is not None and math.isfinite(v):
                metrics.append(Metric(f"{r.variant.name}/{k}", float(v), now, 0))
    client.log_batch(run_id, metrics=metrics, params=params)
    for f in ("compare.md", "compare.json"):
        client.log_artifact(run_id, str(out_dir / f))
    if plot:
        client.log_artifact(run_id, str(plot))
    client.set_terminated(run_id, "FINISHED")
    return run_id


def main(argv: Sequence[str] | None = None):
    from .config import register_configs
    from .run import preload_plugins

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return None
    preload_plugins(argv)
    register_configs()
    try:
        cc, base = parse_args(argv)
        text, rows = run_compare(cc, base, command="python -m platform.compare " + " ".join(argv))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    expected = len(cc.seeds) if cc.seeds is not None else 1
    if any(len(r.records) < expected for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
