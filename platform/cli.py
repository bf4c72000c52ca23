"""The shared start of the platform's sub-commands (`platform.sweep`, `platform.compare`,
`platform.scaling`): read argv, answer `-h/--help` with the command's docstring, import the
`plugins=[...]` modules and store the configs before any override is parsed."""

from __future__ import annotations

import sys
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
