"""Generic tests every registered ablation gets: it composes, changes what it says, trains."""

import subprocess
import sys

import mlflow
import pytest
import torch
from omegaconf import OmegaConf

import ablations
import residuals
from platform.config import residual_config, validate
from platform.model import Backbone
from tests.helpers import ROOT, make_cfg, packed_batch

NAMES = ablations.names()


def test_paper_ablations_are_registered():
    for name in ("channel_split", "hpost_streams", "wo_conv", "attnres_mhc_sum", "kernels_4_8_12", "kernels_2_4",
                 "kernels_3_5_7_9", "m2", "m6", "attnres_conv", "keys_only_conv", "input_query"):
        assert name in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_preset_changes_exactly_its_fields(name):
    ab = ablations.get(name)
    assert ab.question and ab.baseline and ab.residual in residuals.names()
    assert ab.baseline in residuals.names() or ab.baseline in NAMES
    cfg = make_cfg(f"ablation={name}")
    validate(cfg)
    assert cfg.residual.name == ab.residual and cfg.ablation.name == name
    got = OmegaConf.to_container(cfg.residual)
    default = OmegaConf.to_container(OmegaConf.structured(residuals.config_for(ab.residual)))
    changed = {k: v for k, v in got.items() if default[k] != v}
    assert changed == {k: v for k, v in ab.changes.items() if default[k] != v}
    # Model, data and trainer stay the default: only the residual differs.
    base = make_cfg()
    for key in ("model", "data", "trainer"):
        assert OmegaConf.to_container(cfg[key]) == OmegaConf.to_container(base[key])


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name):
    cfg = make_cfg(f"ablation={name}")
    torch.manual_seed(0)
    model = Backbone(cfg.model, 61, residual_config(cfg))
    tokens, docs = packed_batch(2, 21, 61)
    logits = model(tokens, docs)
    logits.backward(torch.randn_like(logits))
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_duplicate_ablation_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        ablations.register(ablations.get("wo_conv"))


@pytest.mark.slow
def test_every_ablation_trains_from_the_command_line(tmp_path):
    # One multirun process: `python -m platform.run -m ablation=a,b,...` runs each preset as a job.
    out = subprocess.run(
        [sys.executable, "-m", "platform.run", "-m", f"ablation={','.join(NAMES)}", "trainer.max_steps=3",
         "trainer.val_every=3", "trainer.val_batches=1", "trainer.progress_bar=false", "trainer.warmup_steps=1",
         "data.vocab_size=512", "data.batch_size=4", "mlflow.depth_heatmaps=false",
         f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db", f"hydra.sweep.dir={tmp_path}/multirun"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/m.db")
    runs = client.search_runs([client.get_experiment_by_name("residuals").experiment_id], max_results=1000)
    assert sorted(r.data.tags["ablation"] for r in runs) == sorted(NAMES)
    assert all(r.info.status == "FINISHED" for r in runs)
