"""Parallel trials: N worker processes on one study, Optuna's documented pattern for parallel
optimisation (every worker runs the same study against one shared storage; `load_if_exists`).

The coordinator (`python -m platform.sweep ... sweep.workers=N`) creates the study and its MLflow
parent run first, so no two processes create a schema at once, then starts N copies of the same
command as workers. Worker i gets GPU i (`CUDA_VISIBLE_DEVICES`, round robin over the visible GPUs;
on a CPU machine N plain processes) with NVLink multicast kept off (`platform.env.GPU_SAFE_DEFAULTS`),
a sampler seed of its own, and the parent run id. Each worker trains trials until the study has
`n_trials` finished or running ones; its output goes to `<study dir>/workers/worker_<i>.log`. The
coordinator prints progress from the storage, and when every worker has exited writes the report
and closes the parent run.

On a cluster, run the same command on each node with `sweep.storage=postgresql://...` and
`mlflow.tracking_uri=` a shared tracking server: each node's workers join the one study. A killed
worker's trial is failed on the next invocation (same host: by its pid; other hosts: by heartbeat),
and the same command continues the study.
"""

from __future__ import annotations

import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState

from ..env import REPO_ROOT, worker_env
from .objective import SweepContext
from .report import _best, _say
from .study import WORKER_ENV

POLL_S = 2.0


def worker_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "platform.sweep", *overrides]


def run_workers(study: optuna.Study, ctx: SweepContext, overrides: list[str], n: int, gpus: list[str]) -> str:
    """Start `n` workers on the study, wait for them; returns the parent run's status."""
    log_dir = ctx.study_dir / "workers"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        env = worker_env(i, gpus, workers=n)
        env[WORKER_ENV] = ctx.parent_run_id or "-"
        log = open(log_dir / f"worker_{i}.log", "w")
        procs.append((subprocess.Popen(worker_command(overrides), cwd=REPO_ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
        where = f"GPU {env['CUDA_VISIBLE_DEVICES']}" if gpus else "CPU"
        _say(ctx, f"worker {i} (pid {procs[-1][0].pid}, {where}): log {log_dir / f'worker_{i}.log'}")
    seen = None
    try:
        while any(p.poll() is None for p, _ in procs):
            time.sleep(POLL_S)
            seen = _progress(study, ctx, seen)
    except KeyboardInterrupt:
        for p, _ in procs:  # the workers got the terminal's SIGINT too; make sure they stop
            if p.poll() is None:
                p.terminate()
        for p, _ in procs:
            p.wait()
        raise
    finally:
        for _, log in procs:
            log.close()
    _progress(study, ctx, seen)
    codes = [p.returncode for p, _ in procs]
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if bad:
        _say(ctx, "workers that failed: " + ", ".join(f"{i} (exit code {c}, log {log_dir / f'worker_{i}.log'})"
                                                      for i, c in bad))
    return "FINISHED" if not bad else "FAILED"


def _progress(study: optuna.Study, ctx: SweepContext, seen):
    trials = study.get_trials(deepcopy=False)
    now = (sum(t.state.is_finished() for t in trials), sum(t.state == TrialState.RUNNING for t in trials))
    if now != seen:
        best = _best(study)
        best_txt = f"; best {best.value:.4f} (trial {best.number})" if best else ""
        _say(ctx, f"{ctx.study_name}: {now[0]} of {ctx.n_trials} trials finished, {now[1]} running{best_txt}")
    return now
