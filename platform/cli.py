"""The shared start of the platform's sub-commands (`platform.sweep`, `platform.compare`,
`platform.scaling`): read argv, answer `-h/--help` with the command's docstring, import the
`plugins=[...]` modules and store the configs before any override is parsed."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Sequence


def start(argv: Sequence[str] | None, doc: str | None) -> list[str] | None:
    """The command's arguments, ready to parse; None when `-h/--help` was asked (the doc is printed)."""
    from .config import register_configs
    from .run import preload_plugins

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        return None
    preload_plugins(argv)
    register_configs()
    return argv


def override_key(override: str) -> str:
    """The config key an override sets: `+a.b=1`, `~a.b` and `a.b=1` all give `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


@contextmanager
def one_line_errors(argv: Sequence[str]):
    """Bad input as one `error: ...` line and a non-zero exit: a Hydra composition error (a misspelt
    key, a wrong type) rewritten as `<key>=<value>: <why>; valid: <...>`, and the ValueErrors of the
    commands' own checks (which already name the value and the choices)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .errors import composition_error

    try:
        yield
    except (HydraException, OmegaConfBaseException) as e:
        raise SystemExit(f"error: {composition_error(e, list(argv))}") from None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
