"""Optuna sweeps: the search space, valid kernel sets, a study end to end in MLflow, pruning, resume
after SIGKILL, and a study logged to a real MLflow tracking server through its REST API."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from platform import sweep
from platform.sweep.storage import _quiet_experimental
from platform.train import train
from tests.helpers import ROOT, make_cfg
from tests.platform.test_train import FAST

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sweep_args(tmp_path, *extra, steps=6):
    return ["sweep=msar_kernels", *FAST, f"trainer.max_steps={steps}", f"trainer.val_every={max(1, steps // 2)}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"sweep.storage=sqlite:///{tmp_path}/optuna.db",
            f"sweep.out_dir={tmp_path}/study", "sweep.heartbeat_s=0", *extra]


# --- kernel sets and the space ------------------------------------------------------------------------
@pytest.mark.parametrize("kernels,match", [
    ([4, 4, 8], r"distinct, \[4\] repeated"),
    ([8, 4], r"sorted ascending \(use \[4, 8\]\)"),
    ([1, 4], r"must lie in \[2, 16\]"),
    ([4, 17], r"must lie in \[2, 16\]"),
    ([], r"empty"),
    ([2, 3, 4, 5, 6, 7], r"m = 1 \+ 6 = 7 streams, outside \[2, 6\]"),
    ([2.5, 4], r"integers"),
])
def test_invalid_kernel_sets_are_rejected_with_a_reason(kernels, match):
    with pytest.raises(ValueError, match=match):
        sweep.check_kernel_set(kernels, 2, 16, (2, 6))


def test_valid_kernel_set_passes():
    assert sweep.check_kernel_set([2, 7, 16], 2, 16, (2, 6)) == [2, 7, 16]


@pytest.mark.parametrize("params,match", [
    ({"k": {"key": "residual.kernels", "type": "kernel_set", "choices": [[4, 4]]}}, r"choices: .*repeated"),
    ({"k": {"key": "residual.kernels", "type": "kernel_set", "choices": [[8, 4]]}}, r"choices: .*sorted"),
    ({"k": {"key": "residual.kernels", "type": "kernel_set", "low": 1, "high": 8, "streams": [2, 3]}}, r"start at 2"),
    ({"k": {"key": "residual.kernels", "type": "kernel_set", "low": 2, "high": 4, "streams": [2, 6]}},
     r"needs 5 distinct sizes, but \[2, 4\] holds only 3"),
    ({"s": {"key": "trainer.max_steps", "type": "int", "low": 10, "high": 20}}, r"fixed token budget"),
    ({"x": {"key": "trainer.lr", "type": "uniform", "low": 0.1, "high": 1}}, r"type='uniform' is not valid"),
    ({"x": {"key": "trainer.lr", "type": "float", "low": 0, "high": 1, "log": True}}, r"log=true needs low > 0"),
    ({"x": {"key": "trainer.nope", "type": "float", "low": 0.1, "high": 1}}, r"not a key of the config"),
    ({"x": {"key": "trainer.lr", "type": "float", "lwo": 0.1, "high": 1}}, r"sweep.params.x: Key 'lwo' .*fields: key"),
])
def test_bad_search_spaces_fail_before_any_trial(params, match):
    from platform.config import SweepConfig

    cfg = make_cfg("sweep=msar_kernels")
    space = OmegaConf.merge(OmegaConf.structured(SweepConfig(study_name="t")), {"params": params})
    with pytest.raises(ValueError, match=match):
        sweep.parse_space(space, cfg)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_sampler_never_proposes_an_invalid_kernel_set(sampler):
    cfg = make_cfg("sweep=msar_kernels_lr")
    space = sweep.parse_space(cfg.sweep, cfg)
    with _quiet_experimental():
        smp = (optuna.samplers.RandomSampler(seed=0) if sampler == "random" else
               optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True, group=True))
    study = optuna.create_study(sampler=smp)
    seen_m = set()

    def objective(trial):
        values = sweep.suggest(trial, space)
        ks = values["residual.kernels"]
        assert sweep.check_kernel_set(ks, 2, 16, (2, 6)) == ks  # distinct, sorted, in bounds
        assert trial.params["m"] == 1 + len(ks) and [trial.params[f"k{j + 1}"] for j in range(len(ks))] == ks
        seen_m.add(len(ks) + 1)
        return sum(ks) / 10 + abs(values["trainer.lr"] - 3e-3)  # something for TPE to model

    study.optimize(objective, n_trials=120 if sampler == "random" else 40)
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert seen_m == {2, 3, 4, 5, 6} or sampler == "tpe"


def test_grid_enumerates_every_valid_kernel_set_once():
    cfg = make_cfg("sweep=msar_kernels", "sweep.sampler=grid", "sweep.params.kernels.high=6",
                   "sweep.params.kernels.streams=[2,3]")
    space = sweep.parse_space(cfg.sweep, cfg)
    grid = sweep.grid_space(space)
    # m = 2: 5 single kernels in [2, 6]; m = 3: C(5, 2) = 10 pairs
    assert len(grid["kernels"]) == 15 and len(set(grid["kernels"])) == 15
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(grid, seed=0))
    got = []
    study.optimize(lambda t: got.append(tuple(sweep.suggest(t, space, grid=True)["residual.kernels"])) or 0.0,
                   n_trials=15)
    assert sorted(got) == sorted(sweep.kernel_sets(2, 6, (2, 3)))
    too_big = make_cfg("sweep=msar_kernels", "sweep.sampler=grid")
    with pytest.raises(ValueError, match="explicit choices or narrow the bounds"):
        sweep.grid_space(sweep.parse_space(too_big.sweep, too_big))


def test_trial_overrides_compose_into_the_config():
    values = {"residual.kernels": [3, 7], "trainer.lr": 0.0025, "residual.fusion": "softmax"}
    cfg = make_cfg("sweep=msar_kernels", *[f"{k}={sweep.hydra_value(v)}" for k, v in values.items()])
    assert list(cfg.residual.kernels) == [3, 7] and cfg.trainer.lr == 0.0025 and cfg.residual.fusion == "softmax"
    assert sweep.hydra_value("1") == "'1'"  # a string stays a string


def test_trial_cost_is_the_accounting_of_the_trial_config():
    from platform.accounting import account

    overrides = ["sweep=msar_kernels", *FAST, "residual.kernels=[3,7]"]
    cost = sweep.trial_cost(make_cfg(*overrides), overrides)
    ref = account("tiny", "msar_block", vocab=512, extra_overrides=tuple(FAST) + ("residual.kernels=[3,7]",))
    assert cost["extra_flops"] == ref["extra_flops"] > 0 and cost["extra_params"] == ref["extra_params"] > 0
    more = [*overrides[:-1], "residual.kernels=[3,7,11]"]
    other = sweep.trial_cost(make_cfg(*more), more)
    assert other["extra_flops"] > cost["extra_flops"]  # one more view costs more


def test_study_settings_are_checked():
    cfg = make_cfg("sweep=msar_kernels", "sweep.sampler=annealing")
    with pytest.raises(ValueError, match=r"sweep.sampler='annealing' is not valid; choose one of: tpe, random, grid"):
        sweep.check_sweep(cfg.sweep)
    with pytest.raises(Exception, match="n_trial"):
        make_cfg("sweep=msar_kernels", "sweep.n_trial=3")  # a misspelt key fails at composition
    with pytest.raises(Exception, match="hgih"):
        make_cfg("sweep=msar_kernels", "sweep.params.kernels.hgih=3")


# --- a study end to end -------------------------------------------------------------------------------
def _runs(uri, experiment="residuals"):
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], max_results=100)


def test_two_trial_study_nested_in_mlflow_with_best_trial_and_plots(tmp_path):
    args = sweep_args(tmp_path, "sweep.n_trials=2")
    study = sweep.run_sweep(make_cfg(*args), args)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2

    client, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db")
    parents = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    assert len(parents) == 1
    parent = parents[0]
    trials = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                    key=lambda r: int(r.data.tags["optuna.trial"]))
    assert [r.data.tags["optuna.trial"] for r in trials] == ["0", "1"]
    for r, t in zip(trials, study.trials):
        assert r.info.status == "FINISHED" and r.data.tags["optuna.state"] == "complete"
        assert r.data.params["trial/m"] == str(t.params["m"])
        assert r.data.params["trial/kernels"] == "-".join(map(str, t.user_attrs["kernels"]))
        assert json.loads(r.data.params["residual/kernels"].replace("'", '"')) == t.user_attrs["kernels"]
        assert r.data.metrics["final/val_loss"] == pytest.approx(t.value)
        assert r.data.metrics["cost/extra_flops"] == t.user_attrs["extra_flops"] > 0
        assert "cost/extra_params_pct" in r.data.metrics
        assert t.user_attrs["mlflow_run_id"] == r.info.run_id
        assert r.data.params["sweep"] == "None"  # the trial's run is a plain run

    best = study.best_trial
    pm, pt = parent.data.metrics, parent.data.tags
    assert parent.info.status == "FINISHED"
    assert pm["best/value"] == pytest.approx(best.value) and pm["best/trial"] == best.number
    assert pm["best/m"] == best.params["m"] and pm["trials/complete"] == 2
    assert json.loads(pt["best.params"])["kernels"] == best.user_attrs["kernels"]
    assert pt["best.run_id"] == best.user_attrs["mlflow_run_id"]
    assert parent.data.params["sweep/token_budget"] == str(6 * 8 * 64)
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert {"plots/optimization_history.png", "plots/slice.png", "plots/loss_vs_cost.png"} <= plots
    # importances and contour need >= 2 varying parameters: drawn, or skipped with the reason
    skipped = json.loads(pt["plots.skipped"]) if pt["plots.skipped"] != "none" else {}
    for name in ("param_importances", "contour"):
        assert f"plots/{name}.png" in plots or name in skipped
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "study")} >= {"study/study.md",
                                                                                  "study/search_space.json"}
    report = (tmp_path / "study" / "study.md").read_text()
    assert "| trial | state | m | kernels |" in report and f"Best: trial {best.number}" in report

    # the same command again: nothing left to run, the same parent is reused
    again = sweep.run_sweep(make_cfg(*args), args)
    assert len(again.trials) == 2
    _, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert sum(r.data.tags.get("sweep.role") == "parent" for r in runs) == 1


def test_a_repeated_point_is_not_trained_again(tmp_path):
    args = sweep_args(tmp_path, "sweep.n_trials=2")
    study = optuna.create_study(study_name="msar_kernels", storage=f"sqlite:///{tmp_path}/optuna.db")
    for _ in range(2):
        study.enqueue_trial({"m": 2, "k1": 4})
    study = sweep.run_sweep(make_cfg(*args), args)
    first, second = study.trials
    assert first.user_attrs["kernels"] == second.user_attrs["kernels"] == [4]
    assert second.value == first.value and second.user_attrs["duplicate_of"] == 0
    assert second.user_attrs["extra_flops"] == first.user_attrs["extra_flops"]
    assert "mlflow_run_id" not in second.user_attrs
    _, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert sum("optuna.trial" in r.data.tags for r in runs) == 1
    assert "same parameters as trial 0" in (tmp_path / "study" / "study.md").read_text()


def test_changed_token_budget_is_refused_on_resume(tmp_path):
    args = sweep_args(tmp_path, "sweep.n_trials=1", steps=4)
    sweep.run_sweep(make_cfg(*args), args)
    more = sweep_args(tmp_path, "sweep.n_trials=2", steps=8)
    with pytest.raises(ValueError, match="token budget"):
        sweep.run_sweep(make_cfg(*more), more)


class AlwaysPrune(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return True


def test_pruned_trial_is_killed_not_failed_in_mlflow(tmp_path):
    study = optuna.create_study(pruner=AlwaysPrune())
    trial = study.ask()
    cfg = make_cfg(*FAST, f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "trainer.max_steps=8",
                   "trainer.val_every=2", "residual=vanilla")
    with pytest.raises(optuna.TrialPruned, match="at step 2"):
        train(cfg, callbacks=[sweep.TrialCallback(trial, {"extra_flops": 0.0})], run_dir=tmp_path / "run")
    assert trial.user_attrs["pruned_at_step"] == 2
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(trial.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["pruned"] == "true"


# --- resume after SIGKILL -----------------------------------------------------------------------------
def _sweep_cmd(args):
    return [sys.executable, "-m", "platform.sweep", *args]


def test_resume_after_sigkill_fails_the_killed_trial_and_continues(tmp_path):
    args = sweep_args(tmp_path, "sweep.n_trials=2", "sweep.pruner=none", steps=40)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    storage = f"sqlite:///{tmp_path}/optuna.db"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(_sweep_cmd(args), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed, deadline = None, time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:  # until trial 0 trains inside its MLflow run
            time.sleep(0.2)
            try:
                trials = optuna.load_study(study_name="msar_kernels", storage=storage).trials
            except Exception:  # the study does not exist yet
                continue
            if trials and trials[0].state == TrialState.RUNNING and "mlflow_run_id" in trials[0].user_attrs:
                killed = trials[0]
                break
        assert killed is not None, (tmp_path / "first.log").read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert optuna.load_study(study_name="msar_kernels", storage=storage).trials[0].state == TrialState.RUNNING

    done = subprocess.run(_sweep_cmd(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "trials [0] were left running by a dead process and are now FAIL" in " ".join(done.stdout.split())

    study = optuna.load_study(study_name="msar_kernels", storage=storage)
    assert [t.number for t in study.trials] == [0, 1]  # no number repeats; the total reached n_trials
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert "died mid-trial" in study.trials[0].user_attrs["fail_reason"]
    client, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(killed.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["optuna.state"] == "fail"
    assert not [r for r in runs if r.info.status == "RUNNING"]
    parents = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.metrics["trials/fail"] == 1 and parents[0].data.metrics["trials/complete"] == 1


# --- a real MLflow tracking server -------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
         f"sqlite:///{tmp_path}/server.db", "--artifacts-destination", str(tmp_path / "server_artifacts"),
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).read().strip() == b"OK":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _rest(url, endpoint, body=None, **query):
    if body is not None:
        req = urllib.request.Request(f"{url}/api/2.0/mlflow/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    else:
        from urllib.parse import urlencode

        req = urllib.request.Request(f"{url}/api/2.0/mlflow/{endpoint}?{urlencode(query)}")
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def test_study_on_a_tracking_server_is_served_by_its_rest_api(tmp_path, mlflow_server):
    url = mlflow_server
    args = sweep_args(tmp_path, "sweep.n_trials=2", f"mlflow.tracking_uri={url}")
    study = sweep.run_sweep(make_cfg(*args), args)

    exp = _rest(url, "experiments/get-by-name", experiment_name="residuals")["experiment"]
    runs = _rest(url, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 100})["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs}
    parent = [rid for rid, t in tags.items() if t.get("sweep.role") == "parent"]
    assert len(parent) == 1
    children = [rid for rid, t in tags.items() if t.get("mlflow.parentRunId") == parent[0]]
    assert len(children) == 2
    for rid in children:
        hist = _rest(url, "metrics/get-history", run_id=rid, metric_key="val/loss")["metrics"]
        assert [m["step"] for m in hist] == [3, 6]
        trial = study.trials[int(tags[rid]["optuna.trial"])]
        assert hist[-1]["value"] == pytest.approx(trial.value)
    arts = _rest(url, "artifacts/list", run_id=parent[0], path="plots")["files"]
    assert "plots/optimization_history.png" in {a["path"] for a in arts}
    pm = {m["key"]: m["value"] for r in runs if r["info"]["run_id"] == parent[0] for m in r["data"]["metrics"]}
    assert pm["best/value"] == pytest.approx(study.best_value)
