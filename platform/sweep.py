"""Optuna search over config values, every trial an MLflow run: `python -m platform.sweep sweep=<preset> [overrides]`.

Examples (from the repo root):
    python -m platform.sweep sweep=msar_kernels                              # m and kernel sizes of Block MSAR
    python -m platform.sweep sweep=msar_kernels sweep.n_trials=4 trainer.max_steps=150
    python -m platform.sweep sweep=msar_kernels_lr sweep.timeout=3600        # + learning rate and block size
    python -m platform.sweep sweep=msar_kernels_grid                         # a small grid of kernel sets
    python -m platform.sweep sweep=msar_kernels sweep.storage=postgresql://host/db   # several workers, one study
Run the same command again to continue a study (a killed trial is marked FAIL, numbering goes on).

The base config is composed from the command line exactly as `platform.run` does; each trial composes
it again with its sampled overrides (`residual.kernels=[3,7]`, ...) and trains with the same
`platform.train.train`. A preset in `conf/sweep/` is a `# @package _global_` file that sets
`sweep.*` (study name, sampler, ...) and the search space `sweep.params`, one entry per Optuna
parameter: `{key: <config key>, type: int|float|categorical|kernel_set, low, high, step, log,
choices, streams}`. The objective is the final validation loss at a fixed token budget
(`trainer.max_steps` x batch x seq_len, recorded on the study; the space may not change it).

Kernel sets (`type: kernel_set`) are valid by construction: the sampler draws m (the number of
streams, `streams: [lo, hi]`), then k1 < k2 < ... < k_{m-1} one at a time, each from the range that
still leaves room for the rest (`k_j` in [k_{j-1} + 1, high - (m - 1 - j)]). Optuna allows ranges
that depend on earlier draws, the parameters stay readable (m, k1 < k2 < ... are the kernel sizes,
smallest first, so the slice and contour plots mean something), and no trial is spent on a set the
model would reject. The price: drawn uniformly, later kernels crowd toward `high` (mean sets for
m = 4 in [2, 16]: 7.9 / 12.0 / 14.5, against 5 / 9 / 13 for a uniform draw over sets); with
`log: true` (the presets; kernel sizes are scales) they come out at 5.7 / 9.9 / 13.1, close to
uniform, and TPE learns around the rest. Rejection sampling would keep the plots but spend trials
on invalid sets (about half of the m = 6 draws); one categorical over all sets would lose the
ordering TPE exploits. With explicit `choices` (or `sampler=grid`) a kernel set is one categorical
parameter, encoded "4-8-12".

A trial that draws a point already evaluated takes that trial's value instead of training again
(same config, same seed: the same number). The README lists every `sweep.*` option.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
import optuna  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from . import tracking  # noqa: E402
from .config import REPO_ROOT, compose, tracking_uri, validate  # noqa: E402

PARAM_TYPES = ("int", "float", "categorical", "kernel_set")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "none")
# Keys that set the token budget: the objective compares trials at one budget, so no trial may change them.
BUDGET_KEYS = ("trainer.max_steps", "data.batch_size", "model.seq_len", "trainer.accumulate_grad_batches",
               "trainer.devices")
GRID_LIMIT = 2000  # points; a grid beyond this is a mistake, not a plan
STATE_NAMES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "fail",
               TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
COST_KEYS = ("extra_params", "extra_params_pct", "extra_active_pct", "extra_flops", "extra_flops_pct")


def default_storage() -> str:
    return f"sqlite:///{REPO_ROOT / 'mlruns' / 'optuna.db'}"


@contextmanager
def _quiet_experimental():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


# --- the search space -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One entry of `sweep.params`, checked."""

    name: str  # the Optuna parameter name (kernel sets: "m" and "k1".. unless given as choices)
    key: str  # the config key it sets
    type: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple | None = None  # categorical values; kernel_set: tuples of kernel sizes
    streams: tuple[int, int] | None = None  # kernel_set: (min m, max m)


def check_kernel_set(kernels: Sequence[int], low: int = 2, high: int | None = None,
                     streams: Sequence[int] | None = None) -> list[int]:
    """A kernel set as the sweep accepts it: distinct integer sizes, sorted ascending, within
    [low, high] (low >= 2: view 0 is already the identity), m = 1 + len within `streams`.
    Returns it as a list; raises ValueError with the reason otherwise."""
    ks = list(kernels)
    if not ks:
        raise ValueError("kernel set [] is empty: m = 1 + len(kernels) must be >= 2")
    if any(isinstance(k, bool) or not isinstance(k, int) for k in ks):
        raise ValueError(f"kernel set {ks}: sizes must be integers")
    dup = sorted({k for k in ks if ks.count(k) > 1})
    if dup:
        raise ValueError(f"kernel set {ks}: sizes must be distinct, {dup} repeated")
    if ks != sorted(ks):
        raise ValueError(f"kernel set {ks}: sizes must be sorted ascending (use {sorted(ks)})")
    if ks[0] < max(2, low) or (high is not None and ks[-1] > high):
        raise ValueError(f"kernel set {ks}: sizes must lie in [{max(2, low)}, {high if high is not None else '∞'}]")
    if streams is not None and not streams[0] <= 1 + len(ks) <= streams[1]:
        raise ValueError(f"kernel set {ks}: m = 1 + {len(ks)} = {1 + len(ks)} streams, "
                         f"outside [{streams[0]}, {streams[1]}]")
    return ks


def kernel_sets(low: int, high: int, streams: Sequence[int]) -> list[tuple[int, ...]]:
    """Every valid kernel set, by m then lexicographically."""
    sizes = range(low, high + 1)
    return [c for m in range(streams[0], streams[1] + 1) for c in combinations(sizes, m - 1)]


def encode_kernels(kernels: Sequence[int]) -> str:
    return "-".join(str(k) for k in kernels)


def decode_kernels(text: str) -> list[int]:
    return [int(k) for k in str(text).split("-")]


def _primitive(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def parse_space(sweep: DictConfig, cfg: DictConfig | None = None) -> list[Param]:
    """Check `sweep.params` and return it as Params; every error names the entry and what is wrong."""
    params = OmegaConf.to_container(sweep.params, resolve=True) if sweep.params is not None else {}
    if not params:
        raise ValueError("sweep.params is empty: a preset must define the search space (see conf/sweep/)")
    space, seen_keys, kernel_entries = [], set(), 0
    from omegaconf.errors import OmegaConfBaseException

    from .config import SweepParam

    for name, spec in params.items():
        where = f"sweep.params.{name}"
        try:  # the schema: unknown fields and wrong types fail here, naming the entry
            spec = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(SweepParam), spec or {}))
        except OmegaConfBaseException as e:
            raise ValueError(f"{where}: {str(e).splitlines()[0]}; fields: "
                             f"{', '.join(SweepParam.__dataclass_fields__)}") from None
        key, kind = spec.get("key"), spec.get("type")
        if kind not in PARAM_TYPES:
            raise ValueError(f"{where}.type={kind!r} is not valid; choose one of: {', '.join(PARAM_TYPES)}")
        if not key:
            raise ValueError(f"{where}.key is missing: the config key it sets, e.g. trainer.lr")
        if key in BUDGET_KEYS:
            raise ValueError(f"{where}.key={key}: trials are compared at a fixed token budget, so "
                             f"{', '.join(BUDGET_KEYS)} cannot be searched (set them on the command line)")
        if key in seen_keys:
            raise ValueError(f"{where}.key={key} is searched twice")
        seen_keys.add(key)
        if cfg is not None and OmegaConf.select(cfg, key, default="<absent>") == "<absent>":
            raise ValueError(f"{where}.key={key} is not a key of the config (for residual=" 
                             f"{cfg.residual.name})")
        low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), bool(spec.get("log"))
        choices, streams = spec.get("choices"), spec.get("streams")
        if kind in ("int", "float"):
            if low is None or high is None or not low <= high:
                raise ValueError(f"{where}: {kind} needs low <= high, got low={low}, high={high}")
            if log and low <= 0:
                raise ValueError(f"{where}: log=true needs low > 0, got low={low}")
            if log and step is not None:
                raise ValueError(f"{where}: step and log=true cannot be combined")
            if kind == "int" and any(v is not None and float(v) != int(v) for v in (low, high, step)):
                raise ValueError(f"{where}: int bounds and step must be integers")
            if step is not None and step <= 0:
                raise ValueError(f"{where}: step={step} must be > 0")
            space.append(Param(name, key, kind, low=low, high=high, step=step, log=log))
        elif kind == "categorical":
            if not choices or not all(_primitive(c) for c in choices):
                raise ValueError(f"{where}: categorical needs a non-empty list of choices, each a number, "
                                 f"string, bool or null; got {choices!r}")
            space.append(Param(name, key, kind, choices=tuple(choices)))
        else:  # kernel_set
            kernel_entries += 1
            low = int(low) if low is not None else 2
            if low < 2:
                raise ValueError(f"{where}.low={low}: kernel sizes start at 2 (view 0 is the identity, k = 1)")
            if streams is not None and (len(streams) != 2 or not 2 <= streams[0] <= streams[1]):
                raise ValueError(f"{where}.streams={streams}: give [min m, max m] with 2 <= min <= max "
                                 f"(m = 1 + len(kernels))")
            if choices:
                try:
                    sets = tuple(tuple(check_kernel_set(c, low, int(high) if high is not None else None, streams))
                                 for c in choices)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{where}.choices: {e}") from None
                space.append(Param(name, key, kind, low=low, high=high, choices=sets,
                                   streams=tuple(streams) if streams else None))
                continue
            if high is None or streams is None:
                raise ValueError(f"{where}: kernel_set needs high and streams (or explicit choices)")
            high = int(high)
            if streams[1] - 1 > high - low + 1:
                raise ValueError(f"{where}: m = {streams[1]} needs {streams[1] - 1} distinct sizes, but "
                                 f"[{low}, {high}] holds only {high - low + 1}")
            space.append(Param(name, key, kind, low=low, high=high, log=log,
                               streams=(int(streams[0]), int(streams[1]))))
    if kernel_entries > 1:
        raise ValueError("sweep.params: at most one kernel_set entry (its parameters are named m, k1, k2, ...)")
    hierarchical = [p for p in space if p.type == "kernel_set" and p.choices is None]
    if hierarchical:
        taken = {p.name for p in space if p is not hierarchical[0]}
        reserved = {"m", *(f"k{j}" for j in range(1, hierarchical[0].streams[1]))}
        if taken & reserved:
            raise ValueError(f"sweep.params: names {sorted(taken & reserved)} are used by the kernel set's m, k1, ...")
    return space


def grid_values(p: Param) -> list:
    if p.type == "int":
        return list(range(int(p.low), int(p.high) + 1, int(p.step or 1)))
    if p.type == "float":
        if p.step is None:
            raise ValueError(f"sweep.params.{p.name}: sampler=grid needs a step for a float parameter")
        n = int(math.floor((p.high - p.low) / p.step + 1e-9)) + 1
        return [round(p.low + i * p.step, 12) for i in range(n)]
    if p.type == "categorical":
        return list(p.choices)
    sets = p.choices if p.choices is not None else kernel_sets(int(p.low), int(p.high), p.streams)
    if len(sets) > GRID_LIMIT:
        raise ValueError(f"sweep.params.{p.name}: {len(sets)} kernel sets in [{p.low}, {p.high}] with m in "
                         f"{list(p.streams)}; for sampler=grid give explicit choices or narrow the bounds")
    return [encode_kernels(s) for s in sets]


def grid_space(space: list[Param]) -> dict[str, list]:
    grid = {p.name: grid_values(p) for p in space}
    size = math.prod(len(v) for v in grid.values())
    if size > GRID_LIMIT:
        raise ValueError(f"sampler=grid: {size} points (over {GRID_LIMIT}); narrow the space or use tpe/random")
    return grid


def suggest(trial: optuna.Trial, space: list[Param], grid: bool = False) -> dict[str, Any]:
    """Sample one point; returns {config key: value}. Kernel sets also go to user attrs m and kernels."""
    values: dict[str, Any] = {}
    for p in space:
        if p.type == "int":
            v = trial.suggest_int(p.name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        elif p.type == "float":
            v = trial.suggest_float(p.name, p.low, p.high, step=p.step, log=p.log)
        elif p.type == "categorical":
            v = trial.suggest_categorical(p.name, list(p.choices))
        elif p.choices is not None or grid:
            v = decode_kernels(trial.suggest_categorical(p.name, grid_values(p)))
        else:
            m = trial.suggest_int("m", p.streams[0], p.streams[1])
            v, prev = [], int(p.low) - 1
            for j in range(1, m):  # room for the m - 1 - j kernels still to come
                prev = trial.suggest_int(f"k{j}", prev + 1, int(p.high) - (m - 1 - j), log=p.log)
                v.append(prev)
        if p.type == "kernel_set":
            v = check_kernel_set(v, int(p.low), int(p.high) if p.high is not None else None, p.streams)
            trial.set_user_attr("m", 1 + len(v))
            trial.set_user_attr("kernels", v)
        values[p.key] = v
    return values


def hydra_value(v: Any) -> str:
    """A Python value as a Hydra override value (strings always quoted, so '1' stays a string)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def token_budget(cfg: DictConfig) -> int:
    t = cfg.trainer
    return int(t.max_steps * t.accumulate_grad_batches * t.devices * cfg.data.batch_size * cfg.model.seq_len)


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# --- per trial --------------------------------------------------------------------------------------
def trial_cost(cfg: DictConfig, overrides: Sequence[str]) -> dict[str, float]:
    """Extra params and forward FLOPs/token over vanilla (platform.accounting) of the trial's config."""
    from .accounting import account

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


class Objective:
    def __init__(self, ctx: SweepContext):
        self.ctx = ctx

    def __call__(self, trial: optuna.Trial) -> float:
        from .train import train

        ctx = self.ctx
        trial.set_user_attr("pid", os.getpid())  # lets a later invocation tell a dead trial from a live one
        trial.set_user_attr("host", socket.gethostname())
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


# --- bookkeeping: dead trials, MLflow states ----------------------------------------------------------
def fail_dead_trials(study: optuna.Study, client=None) -> list[int]:
    """Mark this study's trials left RUNNING by a dead process of this host as FAIL (and their MLflow
    runs KILLED). Trials of other hosts are left to the heartbeat (`sweep.heartbeat_s`)."""
    host, failed = socket.gethostname(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") != host or pid is None or tracking._alive(int(pid)):
            continue
        # the public Trial API only reaches the trial of this process; the storage reaches any
        study._storage.set_trial_user_attr(t._trial_id, "fail_reason", f"process {pid} on {host} died mid-trial")
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        failed.append(t.number)
        _close_trial_run(client, t.user_attrs.get("mlflow_run_id"), "fail")
    return failed


def _close_trial_run(client, run_id: str | None, state: str) -> None:
    if client is None or not run_id:
        return
    run = client.get_run(run_id)
    if run.info.status == "RUNNING":
        client.set_tag(run_id, "platform.note", "process died without closing the run")
        client.set_terminated(run_id, "KILLED")
    if run.data.tags.get("optuna.state") != state:
        client.set_tag(run_id, "optuna.state", state)


def sync_trial_states(study: optuna.Study, client) -> None:
    """Every finished trial's MLflow run carries its final state (complete / pruned / fail)."""
    if client is None:
        return
    for t in study.get_trials(deepcopy=False):
        if t.state.is_finished() and t.user_attrs.get("mlflow_run_id"):
            _close_trial_run(client, t.user_attrs["mlflow_run_id"], STATE_NAMES[t.state])


def _stale_trial_callback(client):
    def callback(study: optuna.Study, trial) -> None:  # a trial whose heartbeat stopped (any host)
        _close_trial_run(client, trial.user_attrs.get("mlflow_run_id"), "fail")

    return callback


def storage_label(url: str) -> str:
    """The storage URL without a password (it goes into MLflow params and reports)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a SQLAlchemy URL: keep only the scheme
        return url.split("://", 1)[0] + "://..."


def find_or_create_parent(client, experiment_id: str, study_name: str, storage: str, params: dict,
                          artifacts: dict[str, Path]) -> str:
    """The study's parent run: found by its study-name and storage tags (a resumed study reuses it)."""
    flt = (f"tags.`optuna.study` = '{study_name}' and tags.`sweep.role` = 'parent' "
           f"and tags.`optuna.storage` = '{storage}'")
    found = client.search_runs([experiment_id], filter_string=flt, order_by=["attributes.start_time ASC"],
                               max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        if "platform.note" in found[0].data.tags:  # a note from reaping the killed invocation: resumed now
            client.delete_tag(run_id, "platform.note")
        for k, v in tracking.run_tags().items():
            client.set_tag(run_id, k, v)
        return run_id
    from mlflow.entities import Param as MlflowParam

    tags = {**tracking.run_tags(), "optuna.study": study_name, "sweep.role": "parent", "optuna.storage": storage,
            "mlflow.runName": f"study-{study_name}"}
    run_id = client.create_run(experiment_id, tags=tags, run_name=f"study-{study_name}").info.run_id
    client.log_batch(run_id, params=[MlflowParam(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()])
    for sub, path in artifacts.items():
        client.log_artifact(run_id, str(path), artifact_path=sub)
    return run_id


# --- reporting ----------------------------------------------------------------------------------------
def _best(study: optuna.Study):
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return min(complete, key=lambda t: t.value) if complete else None


def _shown_params(t) -> dict[str, Any]:
    """Parameters as a researcher reads them: m and the kernel set as a list first (instead of m, k1, k2,
    ... or the encoded "4-8-12"), then the rest."""
    out, ks = {}, t.user_attrs.get("kernels")
    if ks is not None:
        out["m"], out["kernels"] = t.user_attrs["m"], ks
    for k, v in t.params.items():
        if ks is not None and (k == "m" or re.fullmatch(r"k\d+", k) or v == encode_kernels(ks)):
            continue
        out[k] = v
    return out


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def machine_description() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    import platform  # this package, which carries the standard library's platform functions

    return f"{os.cpu_count()}-core CPU ({platform.machine()}), torch {torch.__version__}"


def study_report(study: optuna.Study, ctx: SweepContext, command: str) -> str:
    from .stats import markdown_table

    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    best = _best(study)
    cfg = ctx.cfg
    names = []
    for t in trials:
        for k in _shown_params(t):
            if k not in names:
                names.append(k)
    rows = []
    for t in trials:
        shown = _shown_params(t)
        ua = t.user_attrs
        if t.state == TrialState.COMPLETE:
            value = f"**{t.value:.4f}**" if best is not None and t.number == best.number else f"{t.value:.4f}"
        elif t.state == TrialState.PRUNED and t.intermediate_values:
            step = max(t.intermediate_values)
            value = f"({t.intermediate_values[step]:.4f} at step {step})"
        else:
            value = "—"
        note = ua.get("fail_reason") or ua.get("invalid_reason") or ""
        if "duplicate_of" in ua:
            note = f"same parameters as trial {ua['duplicate_of']}: its value, not trained again"
        cost_f = f"{ua['extra_flops']:,.0f} ({ua['extra_flops_pct']:.2f}%)" if "extra_flops" in ua else "—"
        cost_p = f"{ua['extra_params']:,.0f} ({ua['extra_params_pct']:.2f}%)" if "extra_params" in ua else "—"
        if "wall_s" in ua:
            wall = f"{ua['wall_s']:.0f}"
        elif t.datetime_complete and t.datetime_start:
            wall = f"{(t.datetime_complete - t.datetime_start).total_seconds():.0f}"
        else:
            wall = "—"
        rows.append([t.number, STATE_NAMES[t.state], *(_fmt_value(shown[k]) if k in shown else "" for k in names),
                     value, cost_f, cost_p, wall, (ua.get("mlflow_run_id") or "")[:8], note[:80]])
    headers = ["trial", "state", *names, "val loss", "extra FLOPs/token (%)", "extra params (%)", "wall s",
               "MLflow run", "note"]
    table = markdown_table(headers, rows, "rl" + "l" * len(names) + "rrrrll")
    counts = {s: sum(t.state == st for t in trials) for st, s in STATE_NAMES.items()}
    t = cfg.trainer
    lines = [
        f"# Optuna study `{ctx.study_name}`",
        "",
        f"- command: `{command}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine_description()}",
        f"- model `{cfg.model.name}`, residual `{cfg.residual.name}`, objective: final `val/loss` "
        f"(nats/token, {t.val_batches} validation batches) after {t.max_steps} steps = "
        f"{token_budget(cfg):,} training tokens per trial",
        f"- sampler `{cfg.sweep.sampler}`, pruner `{cfg.sweep.pruner}`, "
        f"storage `{storage_label(cfg.sweep.storage or default_storage())}`",
        f"- trials: {counts['complete']} complete, {counts['pruned']} pruned, {counts['fail']} failed, "
        f"{counts['running']} running (target {cfg.sweep.n_trials})",
        "",
        table,
    ]
    if best is not None:
        lines.append(f"Best: trial {best.number}, val loss {best.value:.4f}, "
                     + ", ".join(f"{k}={_fmt_value(v)}" for k, v in _shown_params(best).items()) + ".")
    lines.append("Extra FLOPs/params are over vanilla (platform.accounting; % of the backbone's). A pruned "
                 "trial's loss is its last intermediate value, not comparable with the final ones.")
    return "\n".join(lines) + "\n"


def _figure(ax):
    import numpy as np

    return (ax.flat[0] if isinstance(ax, np.ndarray) else ax).figure


def study_plots(study: optuna.Study, out_dir: Path) -> dict[str, Path | str]:
    """Optuna's matplotlib plots as PNGs; {name: path, or the reason it was skipped}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    out_dir.mkdir(parents=True, exist_ok=True)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    common = set.intersection(*(set(t.params) for t in complete)) if complete else set()
    varying = sorted(p for p in common if len({repr(t.params[p]) for t in complete}) > 1)
    order = {"m": 0, **{f"k{j}": j for j in range(1, 20)}}
    all_params = sorted({p for t in complete for p in t.params}, key=lambda p: (order.get(p, 100), p))
    contour = sorted(varying, key=lambda p: (order.get(p, 100), p))[:3]
    plan = {
        "optimization_history": (len(complete) >= 1, "no complete trial", lambda: ovm.plot_optimization_history(study)),
        "param_importances": (len(complete) >= 2 and len(varying) >= 2,
                              f"needs >= 2 complete trials and >= 2 varying parameters ({len(complete)}, {varying})",
                              lambda: ovm.plot_param_importances(study, params=varying)),
        "slice": (len(complete) >= 1 and bool(all_params), "no complete trial",
                  lambda: ovm.plot_slice(study, params=all_params)),
        "contour": (len(complete) >= 2 and len(contour) >= 2,
                    f"needs >= 2 complete trials over >= 2 varying parameters ({varying})",
                    lambda: ovm.plot_contour(study, params=contour)),
    }
    made: dict[str, Path | str] = {}
    for name, (ok, why, draw) in plan.items():
        if not ok:
            made[name] = f"skipped: {why}"
            continue
        try:
            with _quiet_experimental(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fig = _figure(draw())
                _tidy_log_axes(fig)
                path = out_dir / f"{name}.png"
                fig.savefig(path, dpi=110, bbox_inches="tight")
            made[name] = path
        except Exception as e:  # a plot must never cost the study
            made[name] = f"skipped: {type(e).__name__}: {e}"
        finally:
            plt.close("all")
    made["loss_vs_cost"] = _plot_loss_vs_cost(complete, out_dir) or "skipped: no complete trial with a cost"
    return made


def _tidy_log_axes(fig) -> None:
    """Log-scaled parameters (kernel sizes, lr) over short ranges get no or cluttered labels from
    matplotlib's defaults: label a few round numbers (1, 1.2, 1.5, 2, ... 8 x 10^e) in plain notation."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale != "log":
                continue
            lo, hi = sorted(axis.get_view_interval())
            if not (lo > 0 and hi > lo):
                continue
            exps = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
            marks = (m * 10.0**e for e in exps for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8))
            nice = sorted(v for v in marks if lo <= v <= hi)
            if len(nice) > 6:  # about six, evenly spread on the log axis
                nice = [nice[round(i * (len(nice) - 1) / 5)] for i in range(6)]
            axis.set_major_locator(FixedLocator(nice))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
            axis.set_minor_formatter(NullFormatter())


def _plot_loss_vs_cost(complete, out_dir: Path) -> Path | None:
    """Compute-matched view: each complete trial's loss against its extra FLOPs per token."""
    pts = [(t.user_attrs["extra_flops_pct"], t.value, t) for t in complete
           if "extra_flops_pct" in t.user_attrs and "duplicate_of" not in t.user_attrs]
    if not pts:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, t in pts:
        label = encode_kernels(t.user_attrs["kernels"]) if "kernels" in t.user_attrs else str(t.number)
        ax.annotate(f"#{t.number} {label}", (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("extra forward FLOPs per token over vanilla (% of backbone)")
    ax.set_ylabel("final val/loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "loss_vs_cost.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finalize(study: optuna.Study, ctx: SweepContext, command: str, status: str) -> str:
    """Report, plots and the parent run's best-trial record; safe to call after any invocation."""
    report = study_report(study, ctx, command)
    ctx.study_dir.mkdir(parents=True, exist_ok=True)
    (ctx.study_dir / "study.md").write_text(report)
    if ctx.cfg.sweep.report:
        out = Path(ctx.cfg.sweep.report)
        out = out if out.is_absolute() else REPO_ROOT / out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    plots = study_plots(study, ctx.study_dir / "plots")
    csv = None
    try:
        csv = ctx.study_dir / "trials.csv"
        study.trials_dataframe().to_csv(csv, index=False)
    except Exception:  # pandas missing: the markdown report has the same table
        csv = None
    client, run_id = ctx.client, ctx.parent_run_id
    if client is not None and run_id:
        sync_trial_states(study, client)
        trials = study.get_trials(deepcopy=False)
        n_done = sum(t.state.is_finished() for t in trials)
        for st in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            client.log_metric(run_id, f"trials/{STATE_NAMES[st]}", sum(t.state == st for t in trials), step=n_done)
        best = _best(study)
        if best is not None:
            # Metrics, not params: a resumed study may find a better trial, and MLflow params never change.
            client.log_metric(run_id, "best/value", best.value, step=n_done)
            client.log_metric(run_id, "best/trial", best.number, step=n_done)
            for k, v in best.params.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    client.log_metric(run_id, f"best/{k}", v, step=n_done)
            for k in ("extra_flops_pct", "extra_params_pct"):
                if k in best.user_attrs:
                    client.log_metric(run_id, f"best/{k}", best.user_attrs[k], step=n_done)
            shown = _shown_params(best)
            client.set_tag(run_id, "best.params", json.dumps(shown))
            if "kernels" in shown:
                client.set_tag(run_id, "best.kernels", encode_kernels(shown["kernels"]))
            if best.user_attrs.get("mlflow_run_id"):
                client.set_tag(run_id, "best.run_id", best.user_attrs["mlflow_run_id"])
        client.log_artifact(run_id, str(ctx.study_dir / "study.md"), artifact_path="study")
        if csv is not None:
            client.log_artifact(run_id, str(csv), artifact_path="study")
        for name, path in plots.items():
            if isinstance(path, Path):
                client.log_artifact(run_id, str(path), artifact_path="plots")
        skipped = {k: v for k, v in plots.items() if isinstance(v, str)}
        client.set_tag(run_id, "plots.skipped", json.dumps(skipped)[:MAX_PARAM_CHARS] if skipped else "none")
        client.set_terminated(run_id, status)
    return report


# --- progress -----------------------------------------------------------------------------------------
def _announce(ctx: SweepContext, trial: optuna.Trial) -> None:
    study = trial.study
    done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    best = _best(study)
    best_txt = f"best so far {best.value:.4f} (trial {best.number})" if best else "no complete trial yet"
    elapsed = time.time() - ctx.started
    msg = (f"{ctx.study_name} · trial {trial.number} · {done + 1}/{ctx.n_trials} · {best_txt} · "
           f"{elapsed / 60:.1f} min")
    if ctx.console is not None:
        ctx.console.rule(f"[bold]{msg}")
    else:
        print(f"--- {msg}", flush=True)


def _after_trial(ctx: SweepContext):
    def callback(study: optuna.Study, t) -> None:
        state = STATE_NAMES[t.state]
        ctx.consecutive_failures = ctx.consecutive_failures + 1 if t.state == TrialState.FAIL else 0
        _close_trial_run(ctx.client, t.user_attrs.get("mlflow_run_id"), state)
        shown = ", ".join(f"{k}={_fmt_value(v)}" for k, v in _shown_params(t).items())
        value = f"{t.value:.4f}" if t.value is not None else ""
        why = t.user_attrs.get("fail_reason") or t.user_attrs.get("invalid_reason") or ""
        if t.state == TrialState.PRUNED:
            why = f"at step {t.user_attrs.get('pruned_at_step')}"
        if "duplicate_of" in t.user_attrs:
            why = f"(same parameters as trial {t.user_attrs['duplicate_of']}: not trained again)"
        style = {"complete": "green", "pruned": "yellow", "fail": "red"}.get(state, "white")
        line = f"trial {t.number} [{style}]{state}[/{style}] {value} {shown} {why}".rstrip()
        if ctx.console is not None:
            ctx.console.print(line)
        else:
            print(re.sub(r"\[/?\w+\]", "", line), flush=True)

    return callback


def _summary_table(study: optuna.Study, console) -> None:
    from rich.table import Table

    best = _best(study)
    table = Table(title=f"study {study.study_name}")
    for col in ("trial", "state", "params", "val loss", "extra FLOPs %"):
        table.add_column(col, justify="right" if col in ("trial", "val loss", "extra FLOPs %") else "left")
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        value = f"{t.value:.4f}" if t.value is not None else ""
        if t.state == TrialState.PRUNED and value:
            value = f"({value})"  # the last intermediate value
        if best is not None and t.number == best.number:
            value = f"[bold green]{value}"
        table.add_row(str(t.number), STATE_NAMES[t.state],
                      ", ".join(f"{k}={_fmt_value(v)}" for k, v in _shown_params(t).items()), value,
                      f"{t.user_attrs['extra_flops_pct']:.2f}" if "extra_flops_pct" in t.user_attrs else "")
    console.print(table)


# --- the study ----------------------------------------------------------------------------------------
def check_sweep(sw: DictConfig) -> None:
    for key, value, choices in (("sampler", sw.sampler, SAMPLERS), ("pruner", sw.pruner, PRUNERS)):
        if value not in choices:
            raise ValueError(f"sweep.{key}={value!r} is not valid; choose one of: {', '.join(choices)}")
    if sw.n_trials < 1:
        raise ValueError(f"sweep.n_trials={sw.n_trials} must be >= 1")
    if sw.timeout is not None and sw.timeout <= 0:
        raise ValueError(f"sweep.timeout={sw.timeout} must be > 0 seconds (or null)")
    if sw.heartbeat_s < 0 or sw.max_failures < 1 or sw.startup_trials < 0 or sw.pruner_startup_trials < 0:
        raise ValueError("sweep.heartbeat_s, startup_trials, pruner_startup_trials must be >= 0 and "
                         "sweep.max_failures >= 1")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", sw.study_name or ""):
        raise ValueError(f"sweep.study_name={sw.study_name!r}: use letters, digits, '_', '-', '.'")


def make_sampler(sw: DictConfig, space: list[Param], offset: int):
    seed = sw.seed + offset  # a resumed study must not replay the first invocation's random draws
    with _quiet_experimental():
        if sw.sampler == "grid":
            return optuna.samplers.GridSampler(grid_space(space), seed=seed)
        if sw.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        # multivariate + group: joint TPE over parameters that appear together (m decides which k_j exist);
        # constant_liar: parallel workers do not all sample next to the same running trial
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=sw.startup_trials, multivariate=True,
                                          group=True, constant_liar=True)


def make_pruner(sw: DictConfig):
    if sw.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=sw.pruner_startup_trials, n_warmup_steps=sw.pruner_warmup_steps)


def make_storage(sw: DictConfig, client):
    url = sw.storage or default_storage()
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if sw.heartbeat_s > 0:
        kwargs = {"heartbeat_interval": sw.heartbeat_s, "grace_period": 2 * sw.heartbeat_s,
                  "heartbeat_stale_trial_callback": _stale_trial_callback(client)}
    with _quiet_experimental():
        return optuna.storages.RDBStorage(url, **kwargs), url


def space_signature(space: list[Param], grid: bool) -> str:
    return json.dumps({"grid": grid, "params": [asdict(p) for p in space]}, sort_keys=True, default=list)


def _record_or_check(study: optuna.Study, key: str, value, what: str) -> None:
    old = study.user_attrs.get(key)
    if old is None:
        study.set_user_attr(key, value)
    elif old != value:
        raise ValueError(f"study {study.study_name!r} was run with {what} {old!r}, now {value!r}: its trials "
                         f"would not be comparable. Use the same settings or a new sweep.study_name")


def run_sweep(cfg: DictConfig, overrides: Sequence[str], console=None) -> optuna.Study:
    """Run (or continue) the study `cfg.sweep.study_name` until it has `n_trials` finished trials."""
    sw = cfg.sweep
    check_sweep(sw)
    validate(cfg)  # the base config is sound before any study or run is touched
    space = parse_space(sw, cfg)
    searched = {p.key for p in space}
    clash = [o for o in overrides if override_key(o) in searched]
    if clash:
        raise ValueError(f"{clash} set keys that the sweep searches; remove them from the command line")
    grid = sw.sampler == "grid"
    if grid:
        grid_space(space)  # fail now on a grid too large, not inside the first trial
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    client = experiment_id = None
    if cfg.mlflow.enabled:
        import mlflow

        uri = tracking_uri(cfg)
        client = mlflow.MlflowClient(uri)
        experiment_id = tracking.ensure_experiment(client, cfg.mlflow.experiment, uri)
        tracking.reap_orphans(client, experiment_id)  # e.g. the parent run of a killed invocation
    storage, url = make_storage(sw, client)
    study = optuna.create_study(study_name=sw.study_name, storage=storage, direction="minimize",
                                load_if_exists=True, pruner=make_pruner(sw))
    _record_or_check(study, "token_budget", token_budget(cfg), "a token budget of")
    _record_or_check(study, "search_space", space_signature(space, grid), "the search space")
    study.set_user_attr("base_overrides", " ".join(overrides))
    with _quiet_experimental():
        optuna.storages.fail_stale_trials(study)  # other hosts' trials whose heartbeat stopped
    dead = fail_dead_trials(study, client)
    study.sampler = make_sampler(sw, space, offset=len(study.get_trials(deepcopy=False)))

    study_dir = Path(sw.out_dir) if sw.out_dir else REPO_ROOT / "outputs" / "sweeps" / sw.study_name
    study_dir = study_dir if study_dir.is_absolute() else REPO_ROOT / study_dir
    study_dir.mkdir(parents=True, exist_ok=True)
    ctx = SweepContext(cfg=cfg, base_overrides=list(overrides), space=space, study_name=sw.study_name,
                       study_dir=study_dir, grid=grid, prune=sw.pruner != "none", client=client,
                       experiment_id=experiment_id, console=console, n_trials=sw.n_trials)
    if client is not None:
        (study_dir / "search_space.json").write_text(json.dumps([asdict(p) for p in space], indent=2, default=list))
        OmegaConf.save(cfg, study_dir / "base_config.yaml", resolve=True)
        params = {"sweep/study_name": sw.study_name, "sweep/storage": storage_label(url), "sweep/sampler": sw.sampler,
                  "sweep/pruner": sw.pruner, "sweep/seed": sw.seed, "sweep/token_budget": token_budget(cfg),
                  "sweep/base_overrides": " ".join(overrides), "sweep/space": ", ".join(
                      f"{p.name}:{p.type}" for p in space), "sweep/model": cfg.model.name,
                  "sweep/residual": cfg.residual.name, "sweep/max_steps": cfg.trainer.max_steps}
        ctx.parent_run_id = find_or_create_parent(
            client, experiment_id, sw.study_name, storage_label(url), params,
            {"study": study_dir / "search_space.json", "hydra": study_dir / "base_config.yaml"})
    _say(ctx, f"study {sw.study_name!r} in {storage_label(url)}: "
              f"{sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))} of {sw.n_trials} trials "
              f"finished" + (f"; trials {dead} were left running by a dead process and are now FAIL" if dead else "")
         + (f"; MLflow parent run {ctx.parent_run_id}" if ctx.parent_run_id else ""))

    command = "python -m platform.sweep " + " ".join(overrides)
    objective, after = Objective(ctx), _after_trial(ctx)
    status = "FINISHED"
    try:
        while True:
            trials = study.get_trials(deepcopy=False)
            # finished trials count toward n_trials; running ones of live workers will finish
            started = sum(t.state.is_finished() or t.state == TrialState.RUNNING for t in trials)
            if started >= sw.n_trials:
                break
            if grid and study.sampler.is_exhausted(study):
                _say(ctx, "the grid is exhausted")
                break
            if sw.timeout is not None and time.time() - ctx.started >= sw.timeout:
                _say(ctx, f"sweep.timeout={sw.timeout}s reached; run the same command to continue")
                break
            if ctx.consecutive_failures >= sw.max_failures:
                status = "FAILED"
                _say(ctx, f"{ctx.consecutive_failures} trials failed in a row (sweep.max_failures); stopping. "
                          "See the fail_reason of the trials in the report")
                break
            study.optimize(objective, n_trials=1, catch=(Exception,), callbacks=[after], gc_after_trial=True)
    except KeyboardInterrupt:
        status = "KILLED"
        _say(ctx, "interrupted: the running trial is marked FAIL; run the same command to continue the study")
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        report = finalize(study, ctx, command, status)
        if console is not None and status == "FINISHED":
            _summary_table(study, console)
        elif status == "FINISHED":
            print(report)
        _say(ctx, f"report: {ctx.study_dir / 'study.md'}")
    return study


def _say(ctx: SweepContext, msg: str) -> None:
    if ctx.console is not None:
        ctx.console.print(msg)
    else:
        print(msg, flush=True)


def main(argv: Sequence[str] | None = None) -> optuna.Study | None:
    from rich.console import Console

    from .config import register_configs
    from .run import check_choices, preload_plugins

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return None
    preload_plugins(argv)
    check_choices(argv)
    presets = sorted(p.stem for p in (REPO_ROOT / "conf" / "sweep").glob("*.yaml"))
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "sweep" and value not in presets:
            raise SystemExit(f"error: unknown sweep preset {value!r}; presets: {', '.join(presets)}")
    register_configs()
    cfg = compose(*argv)
    if cfg.sweep is None:
        raise SystemExit(f"error: choose a sweep preset, sweep=<name>; presets: {', '.join(presets)}")
    try:
        return run_sweep(cfg, argv, console=Console())
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
