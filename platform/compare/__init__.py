"""Variants x seeds, with confidence intervals, from MLflow: `python -m platform.compare [compare=<preset>] [compare.*] [overrides]`.

Examples (from the repo root):
    python -m platform.compare compare.runs=[vanilla,msar_block] compare.seeds=[0,1,2] trainer.max_steps=300
    python -m platform.compare compare.runs=[wo_conv,attnres_mhc_sum] trainer.max_steps=300   # + their baseline
    python -m platform.compare compare.runs=[vanilla,msar_block] compare.train=false          # only read MLflow
    python -m platform.compare compare.runs=[msar_block] compare.seeds=null compare.train=false   # every seed found
    python -m platform.compare compare=paper_small                      # the paper's study at model=small (GPU)
    python -m platform.compare compare=paper_small compare.workers=2 trainer.max_steps=500   # 2 GPUs, shorter

`compare.*` options (typed; a misspelt one fails; a preset in conf/compare/ sets the same keys):
    runs          residual or ablation names (an ablation when one of that name is registered)
    seeds         seeds per variant (default [0,1,2]); null with train=false: every seed found
    train         true: train what MLflow lacks; false: only read MLflow (runs from earlier, or another machine)
    baseline      what plain residuals are compared with (default vanilla); an ablation uses its own `baseline`
    references    a "Δ vs" column each, paired by seed (default [vanilla]; paper_small: vanilla, attnres_block)
    target        whose final loss the wall-clock column times (default: the first reference)
    add_baselines also run/read the baselines and references of the variants (default true)
    overrides     config overrides of a preset; the command line's come after them and win
    workers       runs trained at once, one GPU each (default 1; 0: one per visible GPU)
    name          report name (default: the variants joined by "_"); out_dir, report: where files go
    level         confidence level (default 0.95)
Every other argument is a config override shared by all runs (`trainer.max_steps=300`, `model=small`,
`trainer=gpu`, `mlflow.experiment=...`); `residual=`, `ablation=` and `seed=` come from `compare.*`.

A run counts for (variant, seed) when a FINISHED MLflow run has the same config: the same
model/data/trainer/residual params as the run `platform.run` would make (hash of the logged params,
without knobs that do not change the numbers: progress bar, threads, checkpoint and log intervals,
compile, data workers and cache dir; a renamed residual's runs count under its new name through
`platform.tracking.RENAMED`). So a comparison resumes: run it again and only the missing runs train;
runs made by `platform.run`, sweeps or another machine's store count alike. Each missing run is its
own `python -m platform.run` process (a crash costs one run, and the process's peak memory is that
run's); with `compare.workers=N`, N of them at a time, each with one GPU.

The table (docs/experiments.md): per variant n seeds, mean final validation loss with its Student-t
interval, the difference to each reference and to its baseline (paired by seed when both have the
same seeds, else Welch), the paper's number, median tokens/s and peak memory, and the wall-clock
time to reach the target's final loss. Written as markdown, JSON, a PNG of the validation curves
(mean over seeds, band = min..max) and a bar chart with intervals, to the output folder, the report
path, and an MLflow run tagged `platform.kind=comparison`.

The package: plan (options, presets, variants), matching (runs in MLflow by config), table,
plots, command (training what is missing, writing the outputs).
"""

from .command import log_comparison, main, n_workers, run_compare, train_missing, train_run
from .matching import (HASH_GROUPS, HASH_IGNORED, RunRecord, config_key, finished_runs_by_key, flat_params,
                       nearest_difference, record_of)
from .plan import (PAPER_MAIN, CompareConfig, Variant, load_preset, parse_args, plan_variants, presets,
                   resolve_variant)
from .plots import plot_bars, plot_curves
from .table import Row, build_rows, markdown, runs_markdown, summary, time_to_loss

__all__ = ["HASH_GROUPS", "HASH_IGNORED", "PAPER_MAIN", "CompareConfig", "Row", "RunRecord", "Variant",
           "build_rows", "config_key", "finished_runs_by_key", "flat_params", "load_preset", "log_comparison", "main",
           "markdown", "n_workers", "nearest_difference", "parse_args", "plan_variants", "plot_bars", "plot_curves",
           "presets", "record_of", "resolve_variant", "run_compare", "runs_markdown", "summary", "time_to_loss",
           "train_missing", "train_run"]
