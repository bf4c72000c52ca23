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
    (["model.d_model=66", "model.moe_impl=sliced"], r"model.n_heads=4: does not divide model.d_model=66"),
    (["model.top_k=9"], r"model.top_k=9: must be between 1 and model.n_experts=8"),
    (["model.n_kv_heads=3"], r"model.n_kv_heads=3: must divide model.n_heads=4 \(GQA\); valid: \[1, 2, 4\]"),
    (["model.moe_impl=loop"], r"model.moe_impl=loop: not a known choice; valid: \[grouped_mm, sliced\]"),
    (["model.moe_topk=sort"], r"model.moe_topk=sort: not a known choice; valid: \[argmax, topk\]"),
    (["model.expert_hidden=60"], r"multiple of 8"),
    (["trainer.precision=fp8"], r"trainer.precision=fp8: not a known choice; valid: \[32-true"),
    (["trainer.accelerator=tpu"], r"accelerator=tpu"),
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
    assert out.returncode == 2 and out.stderr.startswith("error: residual=nope: no such residual; valid: [")
    assert "vanilla" in out.stderr and not out.stdout


def test_debug_presets_compose_and_validate():
    from platform.config import REPO_ROOT

    presets = sorted(p.stem for p in (REPO_ROOT / "conf" / "debug").glob("*.yaml"))
    assert presets == ["fast", "smoke"]
    for name in presets:
        cfg = make_cfg(f"debug={name}")
        validate(cfg)
        assert cfg.model.d_model == 32 and cfg.trainer.max_steps <= 40
    assert make_cfg("debug=smoke").mlflow.enabled is False
    assert make_cfg("debug=fast", "model.d_model=48").model.d_model == 48  # the command line still wins


def test_help_lists_groups_with_descriptions_and_no_sweep(capsys):
    from platform.run import GROUPS, main

    main(["--help"])
    out = capsys.readouterr().out
    for group in GROUPS:
        assert f"  {group}: " in out
    assert "tiny*" in out and "msar_block*" in out and "fast, smoke" in out
    assert "sweep" not in out.split("Config groups")[1].split("Keys:")[0]


def test_config_callbacks_are_built_and_checked():
    from platform.train import build_callbacks

    cfg = make_cfg("callbacks=[{_target_:tests.platform.callbacks.CountSteps,label:x}]")
    (cb,) = build_callbacks(cfg)
    assert type(cb).__name__ == "CountSteps" and cb.label == "x"
    assert build_callbacks(make_cfg()) == []


def test_list_keeps_bracketed_text(capsys):
    from platform.list import main

    main(["residuals"])
    out = capsys.readouterr().out
    assert "MSAR over [b_0," in out  # Rich markup would drop "[b_0, ...]" silently


def test_storage_urls_with_a_unix_socket_folder_are_valid():
    from platform.config import check_tracking_uri
    from platform.errors import ConfigError

    check_tracking_uri("postgresql://postgres:@/optuna?host=/tmp/pg", "sweep.storage", storage=True)
    with pytest.raises(ConfigError, match="no host"):
        check_tracking_uri("postgresql://postgres:@/optuna?host=relative", "sweep.storage", storage=True)
