"""platform.store merge: runs trained elsewhere (a copy of that host's store) become part of ours."""

import shutil
import sqlite3

import pytest

from platform import store


def _client(path):
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{path}")


def _run(client, exp_id, name, losses, status="FINISHED", artifact_dir=None):
    run = client.create_run(exp_id, run_name=name, tags={"platform.device": "1x test GPU"})
    rid = run.info.run_id
    client.log_param(rid, "model/d_model", "64")
    for step, loss in enumerate(losses):
        client.log_metric(rid, "val/loss", loss, step=step, timestamp=1000 + step)
        client.log_metric(rid, "moe/layer1/entropy", 0.5 + step, step=step, timestamp=1000 + step)
    if artifact_dir is not None:
        f = artifact_dir / "note.txt"
        f.write_text(name)
        client.log_artifact(rid, str(f))
    if status != "RUNNING":
        client.set_terminated(rid, status)
    return rid


def _history(client, rid, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(rid, key), key=lambda m: m.step)]


def test_merge_brings_new_runs_metrics_and_artifacts_and_is_idempotent(tmp_path):
    here, there = tmp_path / "here" / "mlruns", tmp_path / "there" / "mlruns"
    here.mkdir(parents=True)
    ours = _client(here / "mlflow.db")
    exp = ours.create_experiment("residuals", artifact_location=(here / "artifacts" / "residuals").as_uri())
    kept = _run(ours, exp, "kept", [3.0, 2.5])
    unfinished = _run(ours, exp, "unfinished", [4.0], status="RUNNING")
    # The other host starts from a slimmed copy of our store (per-step diagnostics dropped) ...
    shutil.copytree(here, there)
    db = sqlite3.connect(there / "mlflow.db")
    db.execute("DELETE FROM metrics WHERE key LIKE 'moe/%'")
    db.execute("UPDATE experiments SET artifact_location = ?", ((there / "artifacts" / "residuals").as_uri(),))
    db.commit()
    db.close()
    theirs = _client(there / "mlflow.db")
    # ... finishes the unfinished run, trains a new one (with an artifact) and opens a new experiment.
    theirs.log_metric(unfinished, "val/loss", 3.5, step=1, timestamp=2000)
    theirs.set_terminated(unfinished, "FINISHED")
    (tmp_path / "files").mkdir()
    new = _run(theirs, exp, "new", [3.2, 2.8, 2.4], artifact_dir=tmp_path / "files")
    other_exp = theirs.create_experiment("scaling-elsewhere")
    lone = _run(theirs, other_exp, "lone", [5.0])

    counts = store.merge(there / "mlflow.db", f"sqlite:///{here / 'mlflow.db'}")
    assert counts["runs"] == 2 and counts["experiments"] == 1 and counts["artifact_dirs"] == 1
    ours = _client(here / "mlflow.db")
    assert _history(ours, kept, "moe/layer1/entropy") == [(0, 0.5), (1, 1.5)]  # our full history stays
    assert _history(ours, new, "val/loss") == [(0, 3.2), (1, 2.8), (2, 2.4)]
    assert ours.get_run(new).data.metrics["val/loss"] == 2.4 and ours.get_run(new).data.params == {
        "model/d_model": "64"}
    assert ours.get_run(new).data.tags["platform.device"] == "1x test GPU"
    assert ours.get_run(unfinished).info.status == "FINISHED"
    assert _history(ours, unfinished, "val/loss") == [(0, 4.0), (1, 3.5)]
    assert ours.get_run(unfinished).data.metrics["val/loss"] == 3.5
    assert ours.get_run(lone).info.experiment_id == ours.get_experiment_by_name("scaling-elsewhere").experiment_id
    local = ours.download_artifacts(new, "note.txt", str(tmp_path / "dl"))
    assert open(local).read() == "new" and str(here) in ours.get_run(new).info.artifact_uri

    again = store.merge(there / "mlflow.db", here / "mlflow.db")
    assert again == {"experiments": 0, "runs": 0, "run_rows": 0, "artifact_dirs": 0}


def test_merge_refuses_what_it_cannot_merge(tmp_path):
    with pytest.raises(ValueError, match="no MLflow store there"):
        store.merge(tmp_path / "missing.db", tmp_path / "also_missing.db")
    with pytest.raises(ValueError, match="only SQLite stores"):
        store.merge("postgresql://h/db", tmp_path / "x.db")
    _client(tmp_path / "a.db").search_experiments()
    with pytest.raises(ValueError, match="cannot be merged into itself"):
        store.merge(tmp_path / "a.db", f"sqlite:///{tmp_path / 'a.db'}")
    shutil.copy(tmp_path / "a.db", tmp_path / "b.db")
    db = sqlite3.connect(tmp_path / "b.db")
    db.execute("UPDATE alembic_version SET version_num = 'older'")
    db.commit()
    db.close()
    with pytest.raises(ValueError, match="schema revisions differ"):
        store.merge(tmp_path / "b.db", tmp_path / "a.db")
