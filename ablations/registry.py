"""The ablation registry: each ablation is one `Ablation(...)` entry, selectable as `ablation=<name>`.

An entry is data, not code: the question it answers, the baseline it is compared with, the residual
it runs and the fields it changes, and the paper's number where there is one (docs/method.md §5). It becomes
a `# @package _global_` preset in Hydra's ConfigStore (see `Ablation.preset`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_ABLATIONS: dict[str, "Ablation"] = {}


@dataclass(frozen=True)
class Ablation:
    name: str
    question: str  # what the comparison answers
    baseline: str  # the residual (or ablation) it is compared with
    residual: str  # the registered residual this ablation runs
    changes: dict[str, Any] = field(default_factory=dict)  # residual fields it sets
    paper: str = ""  # the paper's reported number(s), where there are some

    def describe_changes(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.changes.items())
        return f"residual={self.residual}" + (f" with {fields}" if fields else "")

    def preset(self) -> dict[str, Any]:
        """The Hydra preset: select the residual, set its fields, record what this ablation is."""
        return {
            "defaults": [{"override /residual": self.residual}, "_self_"],
            "residual": dict(self.changes),
            "ablation": {"name": self.name, "question": self.question, "baseline": self.baseline,
                         "changes": self.describe_changes(), "paper": self.paper},
        }


def register(ablation: Ablation) -> Ablation:
    if ablation.name in _ABLATIONS:
        raise ValueError(f"ablation {ablation.name!r} is already registered")
    _ABLATIONS[ablation.name] = ablation
    return ablation


def names() -> list[str]:
    return sorted(_ABLATIONS)


def get(name: str) -> Ablation:
    try:
        return _ABLATIONS[name]
    except KeyError:
        raise KeyError(f"unknown ablation {name!r}; registered ablations: "
                       f"{', '.join(names()) or '(none yet)'}") from None


def all_ablations() -> list[Ablation]:
    return [_ABLATIONS[n] for n in names()]
