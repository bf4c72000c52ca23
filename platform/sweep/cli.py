"""The command line of sweeps: `python -m platform.sweep sweep=<preset> [overrides]`."""

from __future__ import annotations

import os
from typing import Sequence

from ..env import REPO_ROOT, set_offline_defaults

set_offline_defaults()


def main(argv: Sequence[str] | None = None):
    from rich.console import Console

    from ..cli import start
    from ..config import compose
    from ..run import check_choices
    from . import __doc__ as sweep_doc
    from .study import WORKER_ENV, run_sweep

    argv = start(argv, sweep_doc)
    if argv is None:
        return None
    check_choices(argv)
    presets = sorted(p.stem for p in (REPO_ROOT / "conf" / "sweep").glob("*.yaml"))
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "sweep" and value not in presets:
            raise SystemExit(f"error: unknown sweep preset {value!r}; presets: {', '.join(presets)}")
    cfg = compose(*argv)
    if cfg.sweep is None:
        raise SystemExit(f"error: choose a sweep preset, sweep=<name>; presets: {', '.join(presets)}")
    worker = os.environ.get(WORKER_ENV) is not None
    try:
        study = run_sweep(cfg, argv, console=None if worker else Console())
        if worker and study is None:  # stopped after sweep.max_failures failures in a row
            raise SystemExit(1)
        return study
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    except KeyboardInterrupt:
        raise SystemExit(130) from None

