"""Optuna search over config values, every trial an MLflow run: `python -m platform.sweep sweep=<preset> [overrides]`.

Examples (from the repo root):
    python -m platform.sweep sweep=msar_kernels                              # m and kernel sizes of Block MSAR
    python -m platform.sweep sweep=msar_kernels sweep.n_trials=4 trainer.max_steps=150
    python -m platform.sweep sweep=msar_kernels_lr sweep.timeout=3600        # + learning rate and block size
    python -m platform.sweep sweep=msar_kernels_grid                         # a small grid of kernel sets
    python -m platform.sweep sweep=msar_kernels sweep.workers=2 trainer=gpu  # two workers, one GPU each
    python -m platform.sweep sweep=msar_kernels sweep.storage=postgresql://host/db   # a study shared by hosts
Run the same command again to continue a study (a killed trial is marked FAIL, numbering goes on).

The base config is composed from the command line exactly as `platform.run` does; each trial composes
it again with its sampled overrides (`residual.kernels=[3,7]`, ...) and trains with the same
`platform.train.train`. A preset in `conf/sweep/` is a `# @package _global_` file that sets
`sweep.*` (study name, sampler, ...) and the search space `sweep.params`, one entry per Optuna
parameter: `{key: <config key>, type: int|float|categorical|kernel_set, low, high, step, log,
choices, streams}`. The objective is the final validation loss at a fixed token budget
(`trainer.max_steps` x batch x seq_len, recorded on the study; the space may not change it).
A trial that draws a point already evaluated takes that trial's value instead of training again
(same config, same seed: the same number). docs/experiments.md explains every `sweep.*` option.

The package, by responsibility:
    space      the search space: `sweep.params` checked, kernel sets valid by construction, grids
    objective  one trial: overrides -> config -> `train`, pruning callback, cost
    storage    the Optuna storage (SQLite under a file lock, PostgreSQL), dead trials, trial run states
    report     console lines, the markdown report, plots, the MLflow parent run
    study      the study: settings, sampler, pruner, resume checks, the trial loop
    workers    N worker processes on one study (`sweep.workers`)
    cli        the command line
"""

from .objective import InvalidTrial, Objective, SweepContext, TrialCallback, trial_cost
from .report import find_or_create_parent, finalize, study_plots, study_report
from .space import (BUDGET_KEYS, GRID_LIMIT, PARAM_TYPES, Param, check_kernel_set, decode_kernels, encode_kernels,
                    grid_space, grid_values, hydra_value, kernel_sets, parse_space, suggest)
from .storage import (STATE_NAMES, default_storage, fail_dead_trials, make_storage,
                      storage_label, sync_trial_states)
from ..cli import override_key
from ..env import check_workers
from .study import PRUNERS, SAMPLERS, check_sweep, make_pruner, make_sampler, run_sweep

__all__ = ["BUDGET_KEYS", "GRID_LIMIT", "PARAM_TYPES", "PRUNERS", "SAMPLERS", "STATE_NAMES", "InvalidTrial",
           "Objective", "Param", "SweepContext", "TrialCallback", "check_kernel_set", "check_sweep", "check_workers",
           "decode_kernels", "default_storage", "encode_kernels", "fail_dead_trials", "finalize",
           "find_or_create_parent", "grid_space", "grid_values", "hydra_value", "kernel_sets", "make_pruner",
           "make_sampler", "make_storage", "override_key", "parse_space", "run_sweep", "storage_label",
           "study_plots", "study_report", "suggest", "sync_trial_states", "trial_cost", "main"]

from .cli import main  # noqa: E402 - the command itself (`python -m platform.sweep` runs it)
