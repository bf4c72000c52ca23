"""One trial: the sampled overrides composed into a config, validated, costed and trained by the same
`platform.train.train` as a plain run, with a callback that reports `val/loss` for pruning and puts
the trial's parameters and cost on its MLflow run.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import optuna
from omegaconf import DictConfig
from optuna.trial import TrialState

from ..accounting import COST_KEYS
from ..cli import override_key
from ..config import compose, validate
from ..env import worker_index
from .report import _announce
from .space import Param, encode_kernels, hydra_value, suggest

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def trial_cost(cfg: DictConfig, overrides: Sequence[str]) -> dict[str, float]:
    """Extra params and forward FLOPs/token over vanilla (platform.accounting) of the trial's config."""
    from ..accounting import account

    rest = tuple(o for o in overrides if override_key(o) not in ("model", "residual"))
    a = account(cfg.model.name, cfg.residual.name, vocab=cfg.data.vocab_size, extra_overrides=rest)
    return {k: float(a[k]) for k in COST_KEYS}


class TrialCallback(L.Callback):
    """Reports `val/loss` to the trial at each validation and prunes when the pruner says so; puts the
    trial's parameters and compute cost on its MLflow run as soon as the run exists."""

    def __init__(self, trial: optuna.Trial, cost: dict[str, float], prune: bool = True, monitor: str = "val/loss"):
        self.trial, self.cost, self.prune, self.monitor = trial, cost, prune, monitor

    def on_fit_start(self, trainer, pl_module):
        run_id = getattr(trainer.logger, "run_id", None)
        if not run_id:
            return
        from mlflow.entities import Metric, Param as MlflowParam

        self.trial.set_user_attr("mlflow_run_id", run_id)
        now = int(time.time() * 1000)
        shown = {**self.trial.params, **({"kernels": encode_kernels(self.trial.user_attrs["kernels"])}
                                         if "kernels" in self.trial.user_attrs else {})}
        params = [MlflowParam(f"trial/{k}", str(v)[:MAX_PARAM_CHARS]) for k, v in shown.items()]
        params.append(MlflowParam("trial/number", str(self.trial.number)))
        metrics = [Metric(f"cost/{k}", v, now, 0) for k, v in self.cost.items()]
        trainer.logger.experiment.log_batch(run_id, metrics=metrics, params=params)

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        value, step = float(trainer.callback_metrics[self.monitor]), trainer.global_step
        self.trial.report(value, step)
        # never prune at the budget's end: the trial is complete, its value is the objective
        if self.prune and step < trainer.max_steps and self.trial.should_prune():
            self.trial.set_user_attr("pruned_at_step", step)
            raise optuna.TrialPruned(f"{self.monitor}={value:.4f} at step {step} is worse than the median "
                                     f"of earlier trials at that step")


class InvalidTrial(ValueError):
    """The sampled config fails `validate` (the reason is the trial's `invalid_reason` user attr)."""


@dataclass
class SweepContext:
    cfg: DictConfig  # the base config
    base_overrides: list[str]
    space: list[Param]
    study_name: str
    study_dir: Path
    grid: bool
    prune: bool
    client: Any = None  # MlflowClient or None (mlflow.enabled=false)
    experiment_id: str | None = None
    parent_run_id: str | None = None
    console: Any = None
    n_trials: int = 0
    consecutive_failures: int = 0
    started: float = field(default_factory=time.time)
    on_trial_created: Any = None  # called once the trial exists in the storage (releases the trial lock)


class Objective:
    def __init__(self, ctx: SweepContext):
        self.ctx = ctx

    def __call__(self, trial: optuna.Trial) -> float:
        from ..train import train

        ctx = self.ctx
        if ctx.on_trial_created is not None:
            ctx.on_trial_created()
        trial.set_user_attr("pid", os.getpid())  # lets a later invocation tell a dead trial from a live one
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("worker", worker_index())
        _announce(ctx, trial)
        values = suggest(trial, ctx.space, grid=ctx.grid)
        overrides = [f"{k}={hydra_value(v)}" for k, v in values.items()]
        trial.set_user_attr("overrides", " ".join(overrides))
        same = next((t for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.params == trial.params), None)
        if same is not None:  # same config and seed: training again would give the same number
            trial.set_user_attr("duplicate_of", same.number)
            for k in COST_KEYS:
                if k in same.user_attrs:
                    trial.set_user_attr(k, same.user_attrs[k])
            return same.value
        try:
            cfg = compose(*ctx.base_overrides, *overrides)
            cfg.sweep = None  # the trial's run is a plain run: its config reproduces it with platform.run
            cfg.mlflow.run_name = f"{ctx.study_name}-t{trial.number:03d}"
            validate(cfg)
        except Exception as e:  # a combination the config or the model cannot take (e.g. a block size)
            trial.set_user_attr("invalid_reason", f"{type(e).__name__}: {e}"[:2000])
            raise InvalidTrial(str(e)) from e
        try:
            cost = trial_cost(cfg, [*ctx.base_overrides, *overrides])
            for k, v in cost.items():
                trial.set_user_attr(k, v)
            tags = {"optuna.study": ctx.study_name, "optuna.trial": str(trial.number), "optuna.state": "running",
                    "sweep.overrides": " ".join(overrides)[:MAX_PARAM_CHARS]}
            result = train(cfg, callbacks=[TrialCallback(trial, cost, prune=ctx.prune)],
                           parent_run_id=ctx.parent_run_id, run_dir=ctx.study_dir / f"trial_{trial.number:04d}",
                           extra_tags=tags)
        except SystemExit as e:  # Lightning turns Ctrl-C into sys.exit(1); Optuna marks FAIL on KeyboardInterrupt
            raise KeyboardInterrupt from e
        except optuna.TrialPruned:
            raise
        except Exception as e:
            trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}"[:2000])
            raise
        trial.set_user_attr("wall_s", result.wall_s)
        trial.set_user_attr("steps", result.steps)
        if not math.isfinite(result.val_loss):
            trial.set_user_attr("fail_reason", f"val/loss is {result.val_loss}")
            raise FloatingPointError(f"trial {trial.number}: val/loss is {result.val_loss}")
        return result.val_loss
