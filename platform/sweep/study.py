"""Running a study: settings checked, the study created or continued in its storage (the token budget
and the search space recorded and checked on resume), sampler and pruner, and the trial loop.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import ExitStack
from dataclasses import asdict
from typing import Sequence

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from .. import tracking
from ..accounting import token_budget
from ..cli import override_key
from ..config import validate
from ..env import REPO_ROOT, check_workers, repo_path, visible_gpus, worker_index
from .objective import Objective, SweepContext
from .report import _after_trial, _say, _summary_table, finalize, find_or_create_parent
from .space import Param, grid_space, parse_space
from .storage import _quiet_experimental, fail_dead_trials, make_storage, storage_label

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "none")


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
    if sw.workers < 1:
        raise ValueError(f"sweep.workers={sw.workers} must be >= 1 (worker processes, one GPU each)")
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


def space_signature(space: list[Param], grid: bool) -> str:
    return json.dumps({"grid": grid, "params": [asdict(p) for p in space]}, sort_keys=True, default=list)


def _record_or_check(study: optuna.Study, key: str, value, what: str) -> None:
    old = study.user_attrs.get(key)
    if old is None:
        study.set_user_attr(key, value)
    elif old != value:
        raise ValueError(f"study {study.study_name!r} was run with {what} {old!r}, now {value!r}: its trials "
                         f"would not be comparable. Use the same settings or a new sweep.study_name")


WORKER_ENV = "PLATFORM_SWEEP_WORKER"  # set by the coordinator in its workers: "<parent run id or ->"
WORKER_SEED_STRIDE = 7919  # workers' sampler seeds differ by this (a prime), so their random draws differ


def run_sweep(cfg: DictConfig, overrides: Sequence[str], console=None) -> optuna.Study:
    """Run (or continue) the study `cfg.sweep.study_name` until it has `n_trials` finished trials.

    With `sweep.workers=N` this process is the coordinator: it creates the study and its MLflow parent
    run, starts N worker processes (`platform.sweep.workers`) that each run the same study against the
    shared storage, waits for them, and writes the report. A worker (WORKER_ENV set) runs the trial
    loop only; the coordinator closes the parent run."""
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
    worker_of = os.environ.get(WORKER_ENV)  # None: the command the user ran
    coordinating = worker_of is None and sw.workers > 1
    gpus = visible_gpus()
    if coordinating:
        check_workers(sw.workers, gpus, cfg.trainer.devices, "sweep.workers")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    client = experiment_id = None
    if cfg.mlflow.enabled:
        client, _, experiment_id = tracking.open_experiment(cfg, reap=worker_of is None)
    storage, url = make_storage(sw, client)
    study = optuna.create_study(study_name=sw.study_name, storage=storage, direction="minimize",
                                load_if_exists=True, pruner=make_pruner(sw))
    _record_or_check(study, "token_budget", token_budget(cfg), "a token budget of")
    _record_or_check(study, "search_space", space_signature(space, grid), "the search space")
    dead: list[int] = []
    if worker_of is None:
        study.set_user_attr("base_overrides", " ".join(overrides))
        with _quiet_experimental():
            optuna.storages.fail_stale_trials(study)  # other hosts' trials whose heartbeat stopped
        dead = fail_dead_trials(study, client)
    offset = len(study.get_trials(deepcopy=False)) + WORKER_SEED_STRIDE * worker_index()
    study.sampler = make_sampler(sw, space, offset=offset)

    study_dir = repo_path(sw.out_dir) if sw.out_dir else REPO_ROOT / "outputs" / "sweeps" / sw.study_name
    study_dir.mkdir(parents=True, exist_ok=True)
    ctx = SweepContext(cfg=cfg, base_overrides=list(overrides), space=space, study_name=sw.study_name,
                       study_dir=study_dir, grid=grid, prune=sw.pruner != "none", client=client,
                       experiment_id=experiment_id, console=console, n_trials=sw.n_trials)
    if worker_of is not None:
        ctx.parent_run_id = worker_of if worker_of != "-" else None
        return _trial_loop(study, ctx, sw)
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
    status = "FINISHED"
    try:
        if coordinating:
            from .workers import run_workers

            status = run_workers(study, ctx, list(overrides), sw.workers, gpus)
        else:
            status = "FAILED" if _trial_loop(study, ctx, sw) is None else "FINISHED"
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


def _trial_loop(study: optuna.Study, ctx: SweepContext, sw: DictConfig):
    """Trials until the study has `n_trials` finished or running ones (every worker counts the same
    storage, so N workers stop together), the grid is exhausted, the timeout passes, or
    `max_failures` trials fail in a row. Returns the study, or None when stopped by failures.

    Counting the trials and creating the next one is one step under a file lock in the study folder
    (`tracking.file_lock`, released by the objective once its trial is RUNNING in the storage): without it
    two workers that count at once both start the last trial. The lock covers the workers of one host
    (one study folder); workers on other hosts can still overshoot `n_trials` by one trial each at the
    very end."""
    objective, after = Objective(ctx), _after_trial(ctx)
    while True:
        with ExitStack() as held:
            held.enter_context(tracking.file_lock(ctx.study_dir / ".trial.lock"))
            ctx.on_trial_created = held.close  # the objective's first step; closing again on exit is a no-op
            trials = study.get_trials(deepcopy=False)
            # finished trials count toward n_trials; running ones of live workers will finish
            started = sum(t.state.is_finished() or t.state == TrialState.RUNNING for t in trials)
            if started >= sw.n_trials:
                return study
            if ctx.grid and study.sampler.is_exhausted(study):
                _say(ctx, "the grid is exhausted")
                return study
            if sw.timeout is not None and time.time() - ctx.started >= sw.timeout:
                _say(ctx, f"sweep.timeout={sw.timeout}s reached; run the same command to continue")
                return study
            if ctx.consecutive_failures >= sw.max_failures:
                _say(ctx, f"{ctx.consecutive_failures} trials failed in a row (sweep.max_failures); stopping. "
                          "See the fail_reason of the trials in the report")
                return None
            study.optimize(objective, n_trials=1, catch=(Exception,), callbacks=[after], gc_after_trial=True)
