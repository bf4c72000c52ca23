"""The residual-mechanism registry: ``@register("name")`` on a :class:`~residuals.base.Residual`.

A variant is one file in ``residuals/`` (imported automatically) or in an external module listed in
the ``plugins=[...]`` config option. The registry name, the file name and the config option
(``residual=<name>``) match. Duplicate names are an error.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from .base import Residual, ResidualConfig

_REGISTRY: dict[str, type["Residual"]] = {}
T = TypeVar("T", bound=type)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: register a Residual subclass (with a nested ``Config`` dataclass) as ``name``."""
    from .base import Residual, ResidualConfig

    def deco(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Residual)):
            raise TypeError(f"@register({name!r}) expects a Residual subclass, got {cls!r}")
        if name in _REGISTRY:
            prev = _REGISTRY[name]
            raise ValueError(
                f"residual {name!r} is already registered by {prev.__module__}.{prev.__qualname__}; "
                f"cannot register {cls.__module__}.{cls.__qualname__} under the same name"
            )
        config = getattr(cls, "Config", None)
        if not (dataclasses.is_dataclass(config) and issubclass(config, ResidualConfig)):
            raise TypeError(f"residual {name!r} needs a nested `Config` dataclass derived from ResidualConfig")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type["Residual"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown residual {name!r}; registered residuals: {', '.join(names())}") from None


def config_for(name: str, **fields) -> "ResidualConfig":
    """The typed default config of a registered residual, with ``fields`` replaced."""
    return get(name).Config(name=name, **fields)


def load_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import external modules that register residual variants (the ``plugins=[...]`` option)."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ImportError(f"cannot import plugin module {mod!r} (from plugins=[...]): {e}") from e
