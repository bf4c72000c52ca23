"""Parallel sweeps: N worker processes on one study, against SQLite (the single-machine default) and
against a real PostgreSQL server started by the test (the cluster setup: Optuna's storage and the
MLflow store both in PostgreSQL); the study resumes from the shared storage afterwards."""

import mlflow
import optuna
import pytest
from optuna.trial import TrialState

from platform import sweep
from tests.helpers import make_cfg
from tests.platform.test_train import FAST


@pytest.fixture
def postgres(tmp_path):
    """A PostgreSQL server of its own (PyPI `pgserver`, a server in a wheel) with two databases."""
    import pgserver  # a dev dependency (pyproject's dev extras): this test needs a real server

    server = pgserver.get_server(tmp_path / "pg", cleanup_mode="delete")  # "stop" leaves an atexit hook that logs to a closed stream
    try:
        for db in ("optuna", "mlflow"):
            server.psql(f"CREATE DATABASE {db};")
        yield server
    finally:
        server.cleanup()


def _stores(kind, tmp_path, request):
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/optuna.db", f"sqlite:///{tmp_path}/mlflow.db"
    server = request.getfixturevalue("postgres")
    optuna_url, mlflow_url = server.get_uri("optuna"), server.get_uri("mlflow")
    # the experiment's artifacts go to the test's folder (a database store has no folder of its own)
    client = mlflow.MlflowClient(mlflow_url)
    client.create_experiment("residuals", artifact_location=(tmp_path / "artifacts").as_uri())
    return optuna_url, mlflow_url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_two_workers_share_one_study_and_it_resumes(kind, tmp_path, request):
    storage, tracking_uri = _stores(kind, tmp_path, request)
    common = ["sweep=msar_kernels", *FAST, "trainer.max_steps=4", "trainer.val_every=2", "sweep.heartbeat_s=0", "sweep.pruner=none",
              f"sweep.storage='{storage}'", f"mlflow.tracking_uri='{tracking_uri}'", f"sweep.out_dir={tmp_path}/study"]
    args = [*common, "sweep.n_trials=3", "sweep.workers=2"]
    study = sweep.run_sweep(make_cfg(*args), args)

    trials = optuna.load_study(study_name="msar_kernels", storage=storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert {t.user_attrs["worker"] for t in trials} == {0, 1}  # both workers trained trials
    assert len({t.user_attrs["pid"] for t in trials}) >= 2
    logs = sorted(p.name for p in (tmp_path / "study" / "workers").glob("worker_*.log"))
    assert logs == ["worker_0.log", "worker_1.log"]

    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("residuals")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(int(r.data.tags["optuna.trial"]) for r in children) == [0, 1, 2]
    assert all(r.info.status == "FINISHED" and r.data.tags["optuna.state"] == "complete" for r in children)
    assert parents[0].data.metrics["trials/complete"] == 3
    assert parents[0].data.metrics["best/value"] == pytest.approx(study.best_value)

    # the same study continues from its storage (here with one worker in this process)
    more = [*common, "sweep.n_trials=4"]
    study = sweep.run_sweep(make_cfg(*more), more)
    assert [t.number for t in study.trials] == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    assert sum(r.data.tags.get("sweep.role") == "parent" for r in runs) == 1


def test_worker_settings_are_checked():
    with pytest.raises(ValueError, match="sweep.workers=0 must be >= 1"):
        sweep.check_sweep(make_cfg("sweep=msar_kernels", "sweep.workers=0").sweep)
    with pytest.raises(ValueError, match="sweep.workers=0 must be >= 1"):
        sweep.check_workers(0, [], 1, "sweep.workers")
    with pytest.raises(ValueError, match="trainer.devices=2: each worker gets one GPU"):
        sweep.check_workers(2, ["0", "1"], 2, "sweep.workers")
    sweep.check_workers(3, [], 1, "sweep.workers")  # CPU: N processes
    with pytest.raises(Exception, match="wokers"):
        make_cfg("sweep=msar_kernels", "sweep.wokers=2")


def test_workers_that_count_at_once_do_not_start_more_than_n_trials(tmp_path, monkeypatch):
    """Two workers finish their trials together and count the study at once: counting and creating
    the next trial is one step under the study folder's lock, so only one of them starts the last
    trial. The two counts are made to meet (a barrier) so that, without the lock, both see 2 of 3 and start one."""
    import threading
    import time
    from types import SimpleNamespace

    from platform.sweep import study as study_mod
    from platform.sweep.objective import SweepContext

    class SlowObjective:  # stands in for training: the trial exists, then takes a while
        def __init__(self, ctx):
            self.ctx = ctx

        def __call__(self, trial):
            self.ctx.on_trial_created()
            time.sleep(0.3)
            return float(trial.number)

    monkeypatch.setattr(study_mod, "Objective", SlowObjective)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    slow_get_trials = study.get_trials
    together = threading.Barrier(2)

    def get_trials(*a, **k):
        trials = slow_get_trials(*a, **k)
        try:  # the two workers count at the same moment, unless the lock keeps one of them out (then it times out)
            together.wait(timeout=0.5)
        except threading.BrokenBarrierError:
            pass
        return trials

    monkeypatch.setattr(study, "get_trials", get_trials)
    sw = SimpleNamespace(n_trials=3, timeout=None, max_failures=3)

    def worker():
        ctx = SweepContext(cfg=None, base_overrides=[], space=[], study_name="s", study_dir=tmp_path,
                           grid=False, prune=False)
        study_mod._trial_loop(study, ctx, sw)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [t.state for t in slow_get_trials()] == [TrialState.COMPLETE] * 3
