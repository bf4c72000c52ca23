"""Residual mechanisms: every module in this package registers its variants on import."""

import importlib
import pkgutil

from .base import Context, Residual, ResidualConfig, rms_norm
from .registry import config_for, get, load_plugins, names, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Context", "Residual", "ResidualConfig", "config_for", "get", "load_plugins", "names",
           "register", "rms_norm"]
