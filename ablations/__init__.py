"""Registered ablations: every module in this package registers its entries on import."""

import importlib
import pkgutil

from .registry import Ablation, all_ablations, get, names, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "registry":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Ablation", "all_ablations", "get", "names", "register"]
