"""Config composition and every bad-value error (raised before any compute)."""

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from platform.config import validate
from tests.helpers import ROOT, make_cfg


def test_default_composes_and_validates():
    cfg = make_cfg()
    validate(cfg)
    assert cfg.model.name == "tiny" and cfg.trainer.accelerator == "cpu" and cfg.ablation is None


def test_misspelt_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException):
        make_cfg("model.d_modle=64")
    with pytest.raises(ConfigCompositionException):
        make_cfg("trainer.max_step=3")


def test_unknown_residual_lists_registered():
    with pytest.raises(MissingConfigException, match="vanilla"):
        make_cfg("residual=nope")


@pytest.mark.parametrize("overrides,match", [
    (["model.d_model=66", "model.moe_impl=sliced"], r"d_model=66 is not divisible by model.n_heads=4"),
    (["model.top_k=9"], r"top_k=9 must be between 1 and model.n_experts=8"),
    (["model.n_kv_heads=3"], r"n_kv_heads=3 must divide model.n_heads=4; valid: \[1, 2, 4\]"),
    (["model.moe_impl=loop"], r"moe_impl='loop' is not valid; choose one of: grouped_mm, sliced"),
    (["model.expert_hidden=60"], r"multiples of 8"),
    (["trainer.precision=fp8"], r"precision='fp8' is not valid; choose one of"),
    (["trainer.accelerator=tpu"], r"accelerator='tpu'"),
    (["trainer.warmup_steps=-1"], r"warmup_steps=-1"),
    (["trainer.max_steps=0"], r"max_steps=0"),
    (["data.source=web"], r"web"),
])
def test_bad_values_name_value_and_choices(overrides, match):
    cfg = make_cfg(*overrides)
    with pytest.raises(ValueError, match=match):
        validate(cfg)


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "platform.run", *args, "mlflow.enabled=false"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_unknown_names_fail_before_compute():
    out = _run_cli("residual=nope")
    assert out.returncode != 0 and "unknown residual 'nope'; registered residuals:" in out.stderr
    assert "vanilla" in out.stderr
    out = _run_cli("ablation=nope")
    assert out.returncode != 0 and "unknown ablation 'nope'; registered ablations:" in out.stderr
    out = _run_cli("model.top_k=99")
    assert out.returncode != 0 and "top_k=99" in out.stderr
    assert "Epoch" not in out.stdout  # nothing trained
