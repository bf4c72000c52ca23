"""Training end to end: learning, exact kill-and-resume, NaN stop, MLflow bookkeeping."""

import math
import os

import lightning as L
import mlflow
import pytest
import torch

from platform import tracking
from platform.train import train
from tests.helpers import ROOT, make_cfg
from tests.platform.callbacks import PoisonAfter, SigtermAt

# A smaller-than-tiny setup (conf/debug/fast.yaml) so each run takes seconds on one thread.
FAST = ["debug=fast", "trainer.progress_bar=false", "trainer.threads=1"]


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


class InterruptAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class PoisonAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.model.head.weight.fill_(float("nan"))


def cfg_for(tmp_path, *overrides):
    return make_cfg(*FAST, f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db", *overrides)


def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    common = ("trainer.max_steps=24", "trainer.ckpt_every=8", "trainer.val_every=12", "trainer.log_every=2",
              "residual=vanilla")
    full = LossRecorder()
    ra = train(cfg_for(tmp_path, *common), callbacks=[full], run_dir=tmp_path / "a")
    assert ra.steps == 24 and len(full.losses) == 24

    first = LossRecorder()
    with pytest.raises(SystemExit):  # killed at step 20: the last checkpoint is step 16
        train(cfg_for(tmp_path, *common), callbacks=[first, InterruptAt(20)], run_dir=tmp_path / "b")
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = (tmp_path / "b" / "mlflow_run_id").read_text().strip()
    client.set_tag(run_id, tracking.NOTE_TAG, tracking.REAPED_NOTE)  # as if the process had died
    second = LossRecorder()
    rb = train(cfg_for(tmp_path, *common, f"resume={tmp_path / 'b'}"), callbacks=[second])
    assert sorted(first.losses) == list(range(1, 21)) and sorted(second.losses) == list(range(17, 25))
    resumed = {**first.losses, **second.losses}
    for step, loss in full.losses.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), f"step {step}"
    assert rb.val_loss == pytest.approx(ra.val_loss, rel=1e-6)

    # MLflow: the interrupted run was marked KILLED, then the same run went on to FINISHED.
    assert rb.mlflow_run_id == run_id
    run = client.get_run(rb.mlflow_run_id)
    assert run.info.status == "FINISHED" and tracking.NOTE_TAG not in run.data.tags
    for key in ("train/loss", "val/loss", "lr"):
        steps = [m.step for m in client.get_metric_history(rb.mlflow_run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))  # steps 17..20 are not logged twice
    steps = {m.step for m in client.get_metric_history(rb.mlflow_run_id, "train/loss")}
    assert min(steps) < 16 < max(steps) == 24, steps  # one run's history spans the interruption
    full_hist = {m.step: m.value for m in client.get_metric_history(ra.mlflow_run_id, "train/loss")}
    for m in client.get_metric_history(rb.mlflow_run_id, "train/loss"):
        assert m.value == pytest.approx(full_hist[m.step], rel=1e-6, abs=1e-6), m.step

    # The command line resumes in the run's own dir (no stray Hydra dir named after the default).
    from platform.run import preflight_cli

    argv = preflight_cli([f"resume={tmp_path / 'b'}", "trainer.max_steps=30"])
    assert f"hydra.run.dir={tmp_path / 'b'}" in argv and "hydra.output_subdir=null" in argv


def test_sigterm_marks_the_run_killed_and_exits_non_zero(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        train(cfg_for(tmp_path, "trainer.max_steps=20"), callbacks=[SigtermAt(3)], run_dir=tmp_path / "t")
    assert exit_info.value.code == 143  # 128 + SIGTERM, as a shell reports it
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("residuals").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_mlflow_run_params_metrics_artifacts(tmp_path):
    r = train(cfg_for(tmp_path, "residual=vanilla", "trainer.max_steps=12", "trainer.val_every=5", "trainer.log_every=2"),
              run_dir=tmp_path / "run")
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(r.mlflow_run_id)
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["residual/name"] == "vanilla" and p["model/d_model"] == "32" and p["seed"] == "0"
    assert int(p["params/total"]) > 0
    for key in ("train/loss", "val/loss", "val/ppl", "perf/tokens_per_s", "perf/tflops", "perf/peak_mem_mb", "lr/decay",
                "moe/layer3/max_over_mean", "moe/layer3/entropy", "final/val_loss"):
        assert client.get_metric_history(r.mlflow_run_id, key), key
    val = client.get_metric_history(r.mlflow_run_id, "val/loss")
    assert sorted(m.step for m in val) == [5, 10, 12] and all(math.isfinite(m.value) for m in val)
    arts = {a.path for a in client.list_artifacts(r.mlflow_run_id, "hydra")}
    assert "hydra/config.yaml" in arts
    plots = {a.path for a in client.list_artifacts(r.mlflow_run_id, "plots")}
    assert "plots/loss_curve.png" in plots
    local = client.download_artifacts(r.mlflow_run_id, "plots/loss_curve.png", str(tmp_path))
    assert open(local, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_depth_attention_heatmaps_and_accounting_are_logged(tmp_path):
    r = train(cfg_for(tmp_path, "residual=msar_block", "trainer.max_steps=4", "trainer.val_every=4",
                      "mlflow.depth_heatmaps=true"), run_dir=tmp_path / "run")
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    plots = {a.path for a in client.list_artifacts(r.mlflow_run_id, "plots")}
    assert {"plots/depth_attention.png", "plots/depth_attention.json"} <= plots
    weights = __import__("json").loads((r.run_dir / "depth_attention.json").read_text())
    assert sorted(weights) == ["view0", "view1", "view2", "view3"]  # m = 4 views, one heatmap each
    for w in weights.values():
        cols = torch.tensor(w).sum(0)  # every consuming sublayer's weights over its sources sum to 1
        torch.testing.assert_close(cols, torch.ones_like(cols), atol=1e-4, rtol=0)
    p = client.get_run(r.mlflow_run_id).data.params
    assert int(p["params/residual_extra"]) > 0 and float(p["flops/residual_extra_pct"]) > 0
    assert float(p["state/per_token_d"]) == 3  # b_0, one completed block summary, the partial (L=8, S=4)


def test_nan_loss_stops_with_message_and_marks_failed(tmp_path):
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 6; stopping. Last good checkpoint: .*last.ckpt"):
        train(cfg_for(tmp_path, "trainer.max_steps=20", "trainer.ckpt_every=3"), callbacks=[PoisonAt(6)],
              run_dir=tmp_path / "nan")
    assert (tmp_path / "nan" / "checkpoints" / "last.ckpt").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("residuals").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_diverged_update_never_becomes_the_last_good_checkpoint(tmp_path):
    # The update of step 6 leaves NaN weights; the checkpoint due at step 6 must not be written.
    common = ("trainer.max_steps=9", "trainer.ckpt_every=3", "residual=vanilla")
    with pytest.raises(FloatingPointError, match=r"parameters are not finite after step 6; .*Last good checkpoint: "
                                                 r".*last.ckpt"):
        train(cfg_for(tmp_path, *common), callbacks=[PoisonAfter(6)], run_dir=tmp_path / "nan")
    assert not (tmp_path / "nan" / "checkpoints" / "step000006.ckpt").exists()
    assert torch.load(tmp_path / "nan" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    losses = LossRecorder()
    r = train(cfg_for(tmp_path, *common, f"resume={tmp_path / 'nan'}"), callbacks=[losses])
    assert sorted(losses.losses) == list(range(4, 10)) and all(math.isfinite(v) for v in losses.losses.values())
    assert math.isfinite(r.val_loss)


def test_orphaned_running_runs_are_reaped(tmp_path):
    from platform import tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = tracking.ensure_experiment(client, "residuals", uri)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    tags = tracking.run_tags()
    orphan = client.create_run(exp, tags={**tags, tracking.PID_TAG: str(dead)}).info.run_id
    alive = client.create_run(exp, tags=tags).info.run_id
    assert tracking.reap_orphans(client, exp) == [orphan]
    assert client.get_run(orphan).info.status == "KILLED"
    assert client.get_run(alive).info.status == "RUNNING"


@pytest.mark.slow
def test_tiny_default_learns_well_below_unigram_entropy(tmp_path):
    from data import CorpusDataModule

    cfg = make_cfg(f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "trainer.progress_bar=false",
                   "residual=vanilla", "mlflow.depth_heatmaps=false")
    dm = CorpusDataModule(cfg.data, seq_len=cfg.model.seq_len, seed=0, max_steps=1)
    dm.prepare_data()
    dm.setup("fit")
    unigram = dm.val_unigram_entropy()
    r = train(cfg, run_dir=tmp_path / "run")
    # 0.75 nats below the unigram entropy: less than half its perplexity, i.e. context is used.
    assert r.val_loss < unigram - 0.75, (r.val_loss, unigram)


def test_the_run_path_a_user_watches(tmp_path):
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = subprocess.run([sys.executable, "-m", "platform.run", "debug=fast", "trainer.max_steps=4", "trainer.val_every=4",
                          "trainer.threads=1", f"mlflow.tracking_uri={uri}", f"hydra.run.dir={tmp_path}/run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert text.count("GPU available") == 1, text  # Lightning's INFO lines once, not twice
    assert "Tip" not in text and "litlogger" not in text and "FutureWarning" not in text, text
    assert "Epoch" not in text and "v_num" not in text, text
    assert f"results: {tmp_path / 'run'}" in text
    assert f"mlflow ui --backend-store-uri {uri}" in text
