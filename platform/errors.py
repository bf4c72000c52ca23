"""Bad input as one line: `error: <key>=<value>: <why>; valid: <...>`.

Every check that runs before compute raises :class:`ConfigError` (a ``ValueError``) naming the key,
its value, why it is wrong and what would be valid. The command-line entry points print it as one
line and exit with status 2; errors during a run (a non-finite loss, a dead data file) print one
line and exit with status 1. ``RESPLAT_DEBUG=1`` (or Hydra's own ``HYDRA_FULL_ERROR=1``) re-raises
instead, with the full traceback. See docs/running.md.
"""

from __future__ import annotations

import os
import re
from typing import Any

BAD_INPUT_EXIT = 2  # the value was wrong: nothing ran
RUN_FAILED_EXIT = 1  # the run started and failed (non-finite loss, ...)


class ConfigError(ValueError):
    """A bad value, found before any compute."""

    def __init__(self, key: str, value: Any, why: str, valid: Any = None):
        self.key, self.value, self.why, self.valid = key, value, why, valid
        text = f"{key}={_show(value)}: {why}"
        if valid is not None:
            text += f"; valid: {_show(valid)}"
        super().__init__(text)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else ", ".join(map(str, value))
    return str(value)


def debug_errors() -> bool:
    """Full tracebacks instead of one line: RESPLAT_DEBUG=1 or HYDRA_FULL_ERROR=1."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("RESPLAT_DEBUG", "HYDRA_FULL_ERROR"))


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (its own lines joined by '; ')."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    parts = [p.strip() for p in text.strip().splitlines() if p.strip()]
    msg = "; ".join(parts) or type(exc).__name__
    return msg if isinstance(exc, (ValueError, KeyError, FileNotFoundError)) else f"{type(exc).__name__}: {msg}"


def composition_error(exc: BaseException, overrides: list[str]) -> str:
    """Hydra's multi-line composition errors as `<key>=<value>: <why>; valid: <...>`."""
    from omegaconf import OmegaConf

    cause = str(exc.__cause__ or "")
    text = f"{exc}\n{cause}"
    by_key = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in overrides}
    full_key = re.search(r"full_key: (\S+)", cause)
    m = re.search(r"Could not find '([^']+)/([^']+)'\s*\n\s*Available options in '[^']+':\s*\n((?:\t.*\n?)+)", text)
    if m:  # unknown option of a config group: model=huge
        group, name = m.group(1), m.group(2)
        options = [o.strip() for o in m.group(3).splitlines() if o.strip() and not o.strip().startswith("base_")]
        return str(ConfigError(group, name, f"no such {group} preset", options))
    m = re.search(r"Key '([^']+)' not in '([^']+)'", cause)
    if m and full_key:  # a misspelt key: model.d_modle=64
        key = full_key.group(1)
        parent = key.rpartition(".")[0]
        valid = None
        try:
            from .config import compose

            node = OmegaConf.select(compose(), parent) if parent else compose()
            valid = sorted(node.keys()) if node is not None else None
        except Exception:  # noqa: BLE001 - the listing is a courtesy; the key is still named
            pass
        return str(ConfigError(key, by_key.get(key, "?"), "no such key", valid))
    m = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", cause)
    if m and full_key:  # a value of the wrong type: trainer.max_steps=abc
        key = full_key.group(1)
        return str(ConfigError(key, m.group(1), f"not a valid {m.group(2).lower()}", ("an " if m.group(2)[0] in "AEIOUaeiou" else "a ") + m.group(2).lower()))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(
        ("full_key", "reference_type", "object_type", "Config search path", "provider="))]
    return "; ".join(dict.fromkeys(lines))
