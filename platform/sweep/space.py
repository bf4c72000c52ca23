"""The search space of a sweep: `sweep.params` checked into Params, valid kernel sets, grids, and
one point sampled from an Optuna trial as config overrides.

Kernel sets (`type: kernel_set`) are valid by construction: the sampler draws m (the number of
streams, `streams: [lo, hi]`), then k1 < k2 < ... < k_{m-1} one at a time, each from the range that
still leaves room for the rest (`k_j` in [k_{j-1} + 1, high - (m - 1 - j)]). Optuna allows ranges
that depend on earlier draws, the parameters stay readable (m, k1 < k2 < ... are the kernel sizes,
smallest first, so the slice and contour plots mean something), and no trial is spent on a set the
model would reject. The price: drawn uniformly, later kernels crowd toward `high` (mean sets for
m = 4 in [2, 16]: 7.9 / 12.0 / 14.5, against 5 / 9 / 13 for a uniform draw over sets); with
`log: true` (the presets; kernel sizes are scales) they come out at 5.7 / 9.9 / 13.1, close to
uniform, and TPE learns around the rest. Rejection sampling would keep the plots but spend trials
on invalid sets (about half of the m = 6 draws); one categorical over all sets would lose the
ordering TPE exploits. With explicit `choices` (or `sampler=grid`) a kernel set is one categorical
parameter, encoded "4-8-12".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Sequence

import optuna
from omegaconf import DictConfig, OmegaConf


PARAM_TYPES = ("int", "float", "categorical", "kernel_set")

# Keys that set the token budget: the objective compares trials at one budget, so no trial may change them.
BUDGET_KEYS = ("trainer.max_steps", "data.batch_size", "model.seq_len", "trainer.accumulate_grad_batches",
               "trainer.devices")

GRID_LIMIT = 2000  # points; a grid beyond this is a mistake, not a plan


@dataclass(frozen=True)
class Param:
    """One entry of `sweep.params`, checked."""

    name: str  # the Optuna parameter name (kernel sets: "m" and "k1".. unless given as choices)
    key: str  # the config key it sets
    type: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple | None = None  # categorical values; kernel_set: tuples of kernel sizes
    streams: tuple[int, int] | None = None  # kernel_set: (min m, max m)


def check_kernel_set(kernels: Sequence[int], low: int = 2, high: int | None = None,
                     streams: Sequence[int] | None = None) -> list[int]:
    """A kernel set as the sweep accepts it: distinct integer sizes, sorted ascending, within
    [low, high] (low >= 2: view 0 is already the identity), m = 1 + len within `streams`.
    Returns it as a list; raises ValueError with the reason otherwise."""
    ks = list(kernels)
    if not ks:
        raise ValueError("kernel set [] is empty: m = 1 + len(kernels) must be >= 2")
    if any(isinstance(k, bool) or not isinstance(k, int) for k in ks):
        raise ValueError(f"kernel set {ks}: sizes must be integers")
    dup = sorted({k for k in ks if ks.count(k) > 1})
    if dup:
        raise ValueError(f"kernel set {ks}: sizes must be distinct, {dup} repeated")
    if ks != sorted(ks):
        raise ValueError(f"kernel set {ks}: sizes must be sorted ascending (use {sorted(ks)})")
    if ks[0] < max(2, low) or (high is not None and ks[-1] > high):
        raise ValueError(f"kernel set {ks}: sizes must lie in [{max(2, low)}, {high if high is not None else '∞'}]")
    if streams is not None and not streams[0] <= 1 + len(ks) <= streams[1]:
        raise ValueError(f"kernel set {ks}: m = 1 + {len(ks)} = {1 + len(ks)} streams, "
                         f"outside [{streams[0]}, {streams[1]}]")
    return ks


def kernel_sets(low: int, high: int, streams: Sequence[int]) -> list[tuple[int, ...]]:
    """Every valid kernel set, by m then lexicographically."""
    sizes = range(low, high + 1)
    return [c for m in range(streams[0], streams[1] + 1) for c in combinations(sizes, m - 1)]


def encode_kernels(kernels: Sequence[int]) -> str:
    return "-".join(str(k) for k in kernels)


def decode_kernels(text: str) -> list[int]:
    return [int(k) for k in str(text).split("-")]


def _primitive(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def parse_space(sweep: DictConfig, cfg: DictConfig | None = None) -> list[Param]:
    """Check `sweep.params` and return it as Params; every error names the entry and what is wrong."""
    params = OmegaConf.to_container(sweep.params, resolve=True) if sweep.params is not None else {}
    if not params:
        raise ValueError("sweep.params is empty: a preset must define the search space (see conf/sweep/)")
    space, seen_keys, kernel_entries = [], set(), 0
    from omegaconf.errors import OmegaConfBaseException

    from ..config import SweepParam

    for name, spec in params.items():
        where = f"sweep.params.{name}"
        try:  # the schema: unknown fields and wrong types fail here, naming the entry
            spec = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(SweepParam), spec or {}))
        except OmegaConfBaseException as e:
            raise ValueError(f"{where}: {str(e).splitlines()[0]}; fields: "
                             f"{', '.join(SweepParam.__dataclass_fields__)}") from None
        key, kind = spec.get("key"), spec.get("type")
        if kind not in PARAM_TYPES:
            raise ValueError(f"{where}.type={kind!r} is not valid; choose one of: {', '.join(PARAM_TYPES)}")
        if not key:
            raise ValueError(f"{where}.key is missing: the config key it sets, e.g. trainer.lr")
        if key in BUDGET_KEYS:
            raise ValueError(f"{where}.key={key}: trials are compared at a fixed token budget, so "
                             f"{', '.join(BUDGET_KEYS)} cannot be searched (set them on the command line)")
        if key in seen_keys:
            raise ValueError(f"{where}.key={key} is searched twice")
        seen_keys.add(key)
        if cfg is not None and OmegaConf.select(cfg, key, default="<absent>") == "<absent>":
            raise ValueError(f"{where}.key={key} is not a key of the config (for residual=" 
                             f"{cfg.residual.name})")
        low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), bool(spec.get("log"))
        choices, streams = spec.get("choices"), spec.get("streams")
        if kind in ("int", "float"):
            if low is None or high is None or not low <= high:
                raise ValueError(f"{where}: {kind} needs low <= high, got low={low}, high={high}")
            if log and low <= 0:
                raise ValueError(f"{where}: log=true needs low > 0, got low={low}")
            if log and step is not None:
                raise ValueError(f"{where}: step and log=true cannot be combined")
            if kind == "int" and any(v is not None and float(v) != int(v) for v in (low, high, step)):
                raise ValueError(f"{where}: int bounds and step must be integers")
            if step is not None and step <= 0:
                raise ValueError(f"{where}: step={step} must be > 0")
            space.append(Param(name, key, kind, low=low, high=high, step=step, log=log))
        elif kind == "categorical":
            if not choices or not all(_primitive(c) for c in choices):
                raise ValueError(f"{where}: categorical needs a non-empty list of choices, each a number, "
                                 f"string, bool or null; got {choices!r}")
            space.append(Param(name, key, kind, choices=tuple(choices)))
        else:  # kernel_set
            kernel_entries += 1
            low = int(low) if low is not None else 2
            if low < 2:
                raise ValueError(f"{where}.low={low}: kernel sizes start at 2 (view 0 is the identity, k = 1)")
            if streams is not None and (len(streams) != 2 or not 2 <= streams[0] <= streams[1]):
                raise ValueError(f"{where}.streams={streams}: give [min m, max m] with 2 <= min <= max "
                                 f"(m = 1 + len(kernels))")
            if choices:
                try:
                    sets = tuple(tuple(check_kernel_set(c, low, int(high) if high is not None else None, streams))
                                 for c in choices)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{where}.choices: {e}") from None
                space.append(Param(name, key, kind, low=low, high=high, choices=sets,
                                   streams=tuple(streams) if streams else None))
                continue
            if high is None or streams is None:
                raise ValueError(f"{where}: kernel_set needs high and streams (or explicit choices)")
            high = int(high)
            if streams[1] - 1 > high - low + 1:
                raise ValueError(f"{where}: m = {streams[1]} needs {streams[1] - 1} distinct sizes, but "
                                 f"[{low}, {high}] holds only {high - low + 1}")
            space.append(Param(name, key, kind, low=low, high=high, log=log,
                               streams=(int(streams[0]), int(streams[1]))))
    if kernel_entries > 1:
        raise ValueError("sweep.params: at most one kernel_set entry (its parameters are named m, k1, k2, ...)")
    hierarchical = [p for p in space if p.type == "kernel_set" and p.choices is None]
    if hierarchical:
        taken = {p.name for p in space if p is not hierarchical[0]}
        reserved = {"m", *(f"k{j}" for j in range(1, hierarchical[0].streams[1]))}
        if taken & reserved:
            raise ValueError(f"sweep.params: names {sorted(taken & reserved)} are used by the kernel set's m, k1, ...")
    return space


def grid_values(p: Param) -> list:
    if p.type == "int":
        return list(range(int(p.low), int(p.high) + 1, int(p.step or 1)))
    if p.type == "float":
        if p.step is None:
            raise ValueError(f"sweep.params.{p.name}: sampler=grid needs a step for a float parameter")
        n = int(math.floor((p.high - p.low) / p.step + 1e-9)) + 1
        return [round(p.low + i * p.step, 12) for i in range(n)]
    if p.type == "categorical":
        return list(p.choices)
    sets = p.choices if p.choices is not None else kernel_sets(int(p.low), int(p.high), p.streams)
    if len(sets) > GRID_LIMIT:
        raise ValueError(f"sweep.params.{p.name}: {len(sets)} kernel sets in [{p.low}, {p.high}] with m in "
                         f"{list(p.streams)}; for sampler=grid give explicit choices or narrow the bounds")
    return [encode_kernels(s) for s in sets]


def grid_space(space: list[Param]) -> dict[str, list]:
    grid = {p.name: grid_values(p) for p in space}
    size = math.prod(len(v) for v in grid.values())
    if size > GRID_LIMIT:
        raise ValueError(f"sampler=grid: {size} points (over {GRID_LIMIT}); narrow the space or use tpe/random")
    return grid


def suggest(trial: optuna.Trial, space: list[Param], grid: bool = False) -> dict[str, Any]:
    """Sample one point; returns {config key: value}. Kernel sets also go to user attrs m and kernels."""
    values: dict[str, Any] = {}
    for p in space:
        if p.type == "int":
            v = trial.suggest_int(p.name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        elif p.type == "float":
            v = trial.suggest_float(p.name, p.low, p.high, step=p.step, log=p.log)
        elif p.type == "categorical":
            v = trial.suggest_categorical(p.name, list(p.choices))
        elif p.choices is not None or grid:
            v = decode_kernels(trial.suggest_categorical(p.name, grid_values(p)))
        else:
            m = trial.suggest_int("m", p.streams[0], p.streams[1])
            v, prev = [], int(p.low) - 1
            for j in range(1, m):  # room for the m - 1 - j kernels still to come
                prev = trial.suggest_int(f"k{j}", prev + 1, int(p.high) - (m - 1 - j), log=p.log)
                v.append(prev)
        if p.type == "kernel_set":
            v = check_kernel_set(v, int(p.low), int(p.high) if p.high is not None else None, p.streams)
            trial.set_user_attr("m", 1 + len(v))
            trial.set_user_attr("kernels", v)
        values[p.key] = v
    return values


def hydra_value(v: Any) -> str:
    """A Python value as a Hydra override value (strings always quoted, so '1' stays a string)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"
