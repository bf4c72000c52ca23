"""Train the backbone with a residual mechanism: `python -m platform.run [overrides]`.

Examples (from the repo root):
    python -m platform.run                                   # tiny model, embedded corpus, CPU
    python -m platform.run ablation=wo_conv                  # a registered ablation of the paper
    python -m platform.run model=tiny trainer.max_steps=200 residual=vanilla seed=3
    python -m platform.run model=small trainer=gpu           # bf16 on a GPU
    python -m platform.run resume=last                       # continue the newest run exactly
    python -m platform.run plugins=[my_pkg.my_residual] residual=my_residual
`python -m platform.list` lists the registered residuals and ablations with their descriptions.
"""

from __future__ import annotations

import sys

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


def check_choices(argv: list[str]) -> None:
    """Fail fast, before Hydra composes, on an unknown `residual=` or `ablation=` name."""
    import ablations
    import residuals

    for arg in argv:
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if key == "residual.kernel":
            raise SystemExit(f"error: residual.kernel={value}: renamed to residual.backend "
                             "(auto | torch | triton); residual.kernels (the conv sizes) is unchanged")
        if key not in ("residual", "ablation") or "(" in value:  # leave sweep functions to Hydra
            continue
        registry = residuals if key == "residual" else ablations
        for name in value.split(","):  # multirun: a,b,c
            if name in ("null", "") and key == "ablation":
                continue
            try:
                registry.get(name)  # its KeyError names the value and lists the registered ones
            except KeyError as e:
                raise SystemExit(f"error: {e.args[0]}") from None


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    from .train import train

    overrides = list(HydraConfig.get().overrides.task)
    result = train(cfg, cli_overrides=overrides if cfg.resume else None)
    print(f"final val/loss {result.val_loss:.4f} after {result.steps} steps in {result.wall_s:.1f}s "
          f"(run dir {result.run_dir})")
    return result.val_loss


def main() -> None:
    from .config import register_configs

    preload_plugins(sys.argv[1:])
    check_choices(sys.argv[1:])
    register_configs()
    _main()


if __name__ == "__main__":
    main()
