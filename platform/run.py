"""Train the backbone with a residual mechanism: `python -m platform.run [overrides]`.

Examples (from the repo root):
    python -m platform.run                                   # tiny model, embedded corpus, CPU
    python -m platform.run ablation=wo_conv                  # a registered ablation of the paper
    python -m platform.run model=tiny trainer.max_steps=200 residual=vanilla seed=3
    python -m platform.run model=small trainer=gpu           # bf16 on a GPU
    python -m platform.run resume=last                       # continue the newest run exactly
    python -m platform.run plugins=[my_pkg.my_residual] residual=my_residual
    python -m platform.run debug=fast                        # a smaller-than-tiny run in seconds
`python -m platform.list` lists the registered residuals and ablations with their descriptions.
"""

from __future__ import annotations

import os
import sys
import textwrap

from .env import set_offline_defaults  # noqa: E402

set_offline_defaults()  # before MLflow, datasets or Lightning read the environment

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


def preload_plugins(argv: list[str]) -> None:
    """Import `plugins=[...]` modules before Hydra composes, so their residuals are valid options."""
    import residuals

    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "plugins" and value:
            mods = [m.strip().strip("'\"") for m in value.strip("[]").split(",") if m.strip()]
            residuals.load_plugins(mods)


RENAMED = {
    "residual.kernel": "renamed to residual.backend (auto | torch | triton); residual.kernels (the conv sizes) is unchanged",
    "data.val_batches": "renamed to data.val_windows (the size of the fixed validation set, in windows); "
                        "trainer.val_batches (batches per validation) is unchanged",
}
GROUPS = {  # group: what it chooses (the options come from conf/ and the registries)
    "model": "backbone size (d_model, blocks, experts, seq_len)",
    "data": "corpus source, tokenizer vocabulary, split and batching",
    "trainer": "hardware, precision, optimisation, schedule, validation and checkpoint cadence",
    "residual": "the residual mechanism (python -m platform.list for what each computes)",
    "ablation": "a registered ablation of a paper (sets residual and fields; default: none)",
    "debug": "a preset for quick checks (conf/debug/): a smaller-than-tiny model, few steps",
}


def check_choices(argv: list[str]) -> None:
    """Fail fast, before Hydra composes, on a renamed key or an unknown `residual=`/`ablation=` name
    (for the other entry points: one `error:` line through SystemExit)."""
    from .errors import ConfigError

    try:
        check_names(argv)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def check_names(argv: list[str]) -> None:
    """Raise ConfigError on a renamed key or an unknown `residual=`/`ablation=` name."""
    import ablations
    import residuals

    from .errors import ConfigError

    for arg in argv:
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if key in RENAMED:
            raise ConfigError(key, value, RENAMED[key], RENAMED[key].split("renamed to ")[1].split(" ")[0])
        if key not in ("residual", "ablation") or "(" in value:  # leave sweep functions to Hydra
            continue
        registry = residuals if key == "residual" else ablations
        for name in value.split(","):  # multirun: a,b,c
            if name in ("null", "") and key == "ablation":
                continue
            try:
                registry.get(name)
            except KeyError:
                raise ConfigError(key, name, f"no such {key}", registry.names()) from None


def preflight_cli(argv: list[str]) -> list[str]:
    """Compose the config as Hydra will and run every check before Hydra starts the job; return the
    argv for Hydra (a resumed run keeps its own run dir instead of a new one named after the default)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .config import compose
    from .errors import composition_error
    from .train import build_callbacks, preflight

    try:
        cfg = compose(*argv)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(composition_error(e, argv)) from e
    cfg, ckpt = preflight(cfg, cli_overrides=[a for a in argv if not a.startswith("hydra.")])
    build_callbacks(cfg)
    if ckpt is not None and not any(a.startswith("hydra.run.dir=") for a in argv):
        argv = [*argv, f"hydra.run.dir={ckpt.parent.parent}", "hydra.output_subdir=null"]
    return argv


def fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def usage() -> str:
    """`--help`: the config groups with what they choose and their options (from conf/ and the registries)."""
    from .config import REPO_ROOT

    lines = [__doc__.strip(), "", "Config groups (group=option; * = default):"]
    defaults = {}
    for entry in (REPO_ROOT / "conf" / "config.yaml").read_text().splitlines():
        k, _, v = entry.strip().lstrip("- ").partition(":")
        if k in GROUPS:
            defaults[k] = v.strip()
    import ablations
    import residuals

    for group, what in GROUPS.items():
        if group == "residual":
            options = residuals.names()
        elif group == "ablation":
            options = ablations.names()
        else:
            options = sorted(p.stem for p in (REPO_ROOT / "conf" / group).glob("*.yaml"))
        shown = ", ".join(o + ("*" if o == defaults.get(group) else "") for o in options)
        lines += [f"  {group + ':':<10} {what}",
                  *textwrap.wrap(shown or "-", 100, initial_indent=" " * 13, subsequent_indent=" " * 13)]
    lines += ["", "Keys: any field, e.g. trainer.max_steps=200 seed=3 model.seq_len=256 "
              "(show the composed config: python -m platform.run --cfg job [overrides])",
              "Bad input prints one line `error: <key>=<value>: <why>; valid: <...>` and exits 2;",
              "RESPLAT_DEBUG=1 (or HYDRA_FULL_ERROR=1) shows the full traceback. Hydra's own flags: --hydra-help.",
              "More: docs/running.md"]
    return "\n".join(lines)


# An absolute path: the same config folder whether run as `python -m platform.run` or called in-process.
@hydra.main(version_base="1.3", config_path=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         "conf"), config_name="config")
def _main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    from .errors import BAD_INPUT_EXIT, RUN_FAILED_EXIT, debug_errors, one_line
    from .train import quiet_lightning, train

    quiet_lightning()
    overrides = list(HydraConfig.get().overrides.task)
    try:
        result = train(cfg, cli_overrides=overrides if cfg.resume else None)
    except (ValueError, KeyError, FileNotFoundError) as e:  # bad input found once data is read
        if debug_errors():
            raise
        fail(one_line(e), BAD_INPUT_EXIT)
    except Exception as e:  # noqa: BLE001 - a failed run: one line, the traceback behind RESPLAT_DEBUG=1
        if debug_errors():
            raise
        fail(one_line(e), RUN_FAILED_EXIT)
    print(f"final val/loss {result.val_loss:.4f} after {result.steps} steps in {result.wall_s:.1f}s")
    print(where_results_are(cfg, result))
    return result.val_loss


def where_results_are(cfg: DictConfig, result) -> str:
    """Where the run's files are, and the one command that opens its MLflow run in the UI."""
    from .config import tracking_uri

    files = [name for name in ("config.yaml", "checkpoints/", "loss_curve.png", "depth_attention.png")
             if (result.run_dir / name).exists()]
    lines = [f"results: {result.run_dir} ({', '.join(files)})"]
    if result.mlflow_run_id:
        uri = tracking_uri(cfg)
        lines.append(f"MLflow run {result.mlflow_run_id} in experiment {cfg.mlflow.experiment!r}; open the UI with:")
        if uri.startswith(("http://", "https://")):
            lines.append(f"  open {uri.rstrip('/')}/#/experiments (the server is already running)")
        else:
            mlflow_cmd = _mlflow_command()
            lines.append(f"  {mlflow_cmd} ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000   "
                         "# then http://127.0.0.1:5000")
    return "\n".join(lines)


def _mlflow_command() -> str:
    """`mlflow` as this environment runs it: the script beside this Python (e.g. .venv/bin/mlflow)."""
    import shutil

    beside = os.path.join(os.path.dirname(sys.executable), "mlflow")
    if os.path.isfile(beside):
        rel = os.path.relpath(beside)
        return beside if rel.startswith("..") else rel
    return "mlflow" if shutil.which("mlflow") else f"{sys.executable} -m mlflow"


def main(argv: list[str] | None = None) -> None:
    from .config import register_configs
    from .errors import BAD_INPUT_EXIT, ConfigError, debug_errors, one_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    try:
        preload_plugins(argv)
        check_names(argv)
        for arg in argv:
            key, _, value = arg.partition("=")
            if key.lstrip("+~") == "sweep":
                raise ConfigError("sweep", value, "sweep presets run with python -m platform.sweep, not "
                                  "platform.run", f"python -m platform.sweep sweep={value}")
        register_configs()
        if not any(a.startswith("-") for a in argv):  # --cfg, --multirun, ...: Hydra's own path
            argv = preflight_cli(argv)
    except Exception as e:  # noqa: BLE001 - every bad input: one line, nothing ran
        if debug_errors():
            raise
        fail(one_line(e), BAD_INPUT_EXIT)
    sys.argv = [sys.argv[0], *argv]
    _main()


if __name__ == "__main__":
    main()
