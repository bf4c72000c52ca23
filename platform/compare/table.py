"""The comparison table: per variant the mean final loss with its Student-t interval, the difference
to each reference and to its own baseline paired by seed, tokens/s, peak memory, and the wall-clock
time to reach the target's final loss.

Time to the target's loss: the target is the final validation loss of the target variant's run with
the same seed (vanilla by default; its mean over seeds when that seed is missing). A run reaches it
at the first validation whose loss is at or below it; the time is interpolated linearly in
(wall time, loss) between that validation and the one before, the same for the step. The wall time
of a validation is its MLflow timestamp minus the run's start (model built, before the first step),
so validation time counts, the same for every variant on the same schedule. A run that never gets
there counts as not reached ("k/n reached"); the mean is over the runs that reached it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .. import stats
from .matching import RunRecord
from .plan import Variant


@dataclass
class Row:
    variant: Variant
    records: list[RunRecord]
    interval: stats.Interval
    delta: stats.Interval | None  # against its own baseline
    note: str = ""
    refs: dict[str, stats.Interval | None] = field(default_factory=dict)  # against each reference
    to_target: dict[int, tuple[float, float] | None] = field(default_factory=dict)  # seed -> (seconds, step)
    target_name: str | None = None


def time_to_loss(curve: Sequence[tuple[int, float]], wall: Sequence[float], target: float):
    """(seconds, step) at which a validation curve first reaches `target`, linearly interpolated between
    the validation that reaches it and the one before; None if it never does."""
    for i, ((step, loss), t) in enumerate(zip(curve, wall)):
        if loss <= target:
            if i == 0:
                return float(t), float(step)
            (s0, l0), t0 = curve[i - 1], wall[i - 1]
            frac = (l0 - target) / (l0 - loss) if l0 != loss else 1.0
            return t0 + frac * (t - t0), s0 + frac * (step - s0)
    return None


def _difference(by_seed: dict[int, float], other: dict[int, float], level: float) -> stats.Interval | None:
    return stats.difference_ci(by_seed, other, level) if by_seed and other else None


def build_rows(variants: list[Variant], records: dict[str, list[RunRecord]], level: float = 0.95,
               references: Sequence[str] = (), target: str | None = None) -> list[Row]:
    finals = {v.name: {r.seed: r.final_val_loss for r in records.get(v.name, [])} for v in variants}
    target = target or (references[0] if references else None)
    goal = finals.get(target, {}) if target else {}
    goal_mean = stats.mean_ci(list(goal.values())).estimate if goal else math.nan
    rows = []
    for v in variants:
        recs = sorted(records.get(v.name, []), key=lambda r: r.seed)
        by_seed = finals[v.name]
        iv = stats.mean_ci(list(by_seed.values()), level)
        delta, note = None, ""
        if v.baseline is not None:
            base = finals.get(v.baseline) or {r.seed: r.final_val_loss for r in records.get(v.baseline, [])}
            if base and by_seed:
                delta = stats.difference_ci(by_seed, base, level)
            else:
                note = f"baseline {v.baseline} not in the comparison" if not base else ""
        refs = {ref: (None if ref == v.name else _difference(by_seed, finals.get(ref, {}), level))
                for ref in references}
        to_target = {}
        if target and math.isfinite(goal_mean):
            for r in recs:
                to_target[r.seed] = time_to_loss(r.val_curve, r.val_wall_s, goal.get(r.seed, goal_mean))
        rows.append(Row(v, recs, iv, delta, note, refs, to_target, target))
    return rows


def reached_times(row: Row) -> list[float]:
    return [x[0] for x in row.to_target.values() if x is not None]


def _fmt_delta(iv: stats.Interval | None, same: bool = False) -> str:
    if same:
        return "— (reference)"
    if iv is None:
        return "n/a"
    mark = " *" if iv.excludes_zero() else ""
    return f"{stats.fmt_interval(iv, signed=True)} ({iv.method}){mark}"


def _fmt_time(row: Row, target_row: Row | None) -> str:
    if not row.to_target:
        return "n/a"
    times = reached_times(row)
    n, k = len(row.to_target), len(times)
    if not times:
        return f"not reached (0/{n})"
    iv = stats.mean_ci(times)
    steps = [x[1] for x in row.to_target.values() if x is not None]
    text = f"{stats.fmt(iv.estimate, 0)}" + (f" ± {stats.fmt(iv.half_width, 0)}" if k > 1 else "")
    text += f" at step {sum(steps) / len(steps):.0f}"  # the step does not depend on how fast the device was
    if k < n:
        text += f" ({k}/{n} reached)"
    if target_row is not None and target_row is not row and reached_times(target_row) and iv.estimate > 0:
        ratio = stats.mean_ci(reached_times(target_row)).estimate / iv.estimate
        text += f", {ratio:.2f}×"
    return text


def markdown(rows: list[Row], level: float = 0.95, references: Sequence[str] = ()) -> str:
    pct = f"{round(level * 100)}%"
    target = rows[0].target_name if rows else None
    target_row = next((r for r in rows if r.variant.name == target), None)
    headers = ["variant", "what", "n", "seeds", f"final val loss (mean ± {pct} CI)",
               *(f"Δ vs {ref} (± {pct} CI)" for ref in references),
               f"Δ vs its baseline (± {pct} CI)", "baseline", "paper", "tokens/s (median)", "peak mem MB (median)"]
    if target:
        headers.append(f"time to {target}'s loss (s, mean ± {pct} CI; mean step; speed-up)")
    table = []
    for r in rows:
        if r.delta is not None:
            delta = _fmt_delta(r.delta)
        else:
            delta = "— (reference)" if r.variant.baseline is None else f"n/a: {r.note}" if r.note else "n/a"
        row = [f"`{r.variant.name}`", r.variant.describe, len(r.records),
               ",".join(str(x.seed) for x in r.records) or "—", stats.fmt_interval(r.interval),
               *(_fmt_delta(r.refs.get(ref), same=ref == r.variant.name) for ref in references),
               delta, r.variant.baseline or "", r.variant.paper or "",
               stats.fmt(stats.median([x.tokens_per_s for x in r.records]), 0),
               stats.fmt(stats.median([x.peak_mem_mb for x in r.records]), 0)]
        if target:
            row.append(_fmt_time(r, target_row))
        table.append(row)
    align = "llrll" + "l" * len(references) + "llllrr" + ("l" if target else "")
    return stats.markdown_table(headers, table, align[:len(headers)])


def to_resolve_markdown(rows: list[Row], references: Sequence[str] = ()) -> str:
    """Unresolved paired differences to each reference and to each variant's own baseline, with the seeds
    that would resolve a real difference of that size at the observed spread (`stats.seeds_to_resolve`);
    "" when there are none."""
    lines = []
    for r in rows:
        pairs = [(ref, r.refs.get(ref)) for ref in references]
        if r.variant.baseline and r.variant.baseline not in references:
            pairs.append((r.variant.baseline, r.delta))
        for ref, iv in pairs:
            n = stats.seeds_to_resolve(iv) if iv is not None else None
            if n is None:
                continue
            need = f"more than {n - 1}" if n > 1000 else f"about {n}"
            lines.append(f"- `{r.variant.name}` − `{ref}` = {stats.fmt_interval(iv, signed=True)} with {iv.n} seeds: "
                         f"{need} seeds")
    if not lines:
        return ""
    return ("Unresolved paired differences, and how many seeds would resolve a real difference of the same size "
            "at the same seed-to-seed spread (a planning estimate for the next study, not a power "
            "calculation):\n\n" + "\n".join(lines) + "\n")


def runs_markdown(rows: list[Row]) -> str:
    target = rows[0].target_name if rows else None
    table = []
    for r in rows:
        for x in r.records:
            hit = r.to_target.get(x.seed)
            table.append([f"`{r.variant.name}`", x.seed, f"`{x.run_id}`", stats.fmt(x.final_val_loss),
                          stats.fmt(x.tokens_per_s, 0), stats.fmt(x.peak_mem_mb, 0), stats.fmt(x.wall_s, 0),
                          f"{hit[0]:.0f} s (step {hit[1]:.0f})" if hit else ("not reached" if target else "n/a"),
                          "trained now" if x.trained_now else "reused"])
    return stats.markdown_table(["variant", "seed", "MLflow run", "final val loss", "tokens/s", "peak mem MB",
                                 "wall s", f"to {target}'s loss" if target else "to target", ""],
                                table, "lrlrrrrll")


def summary(rows: list[Row]) -> dict:
    """The table as JSON (compare.json)."""
    def iv(x):
        return None if x is None else {"estimate": x.estimate, "ci": x.half_width, "method": x.method, "n": x.n}

    return {r.variant.name: {"n": len(r.records), "seeds": [x.seed for x in r.records],
                             "mean": r.interval.estimate, "ci": r.interval.half_width,
                             "delta": r.delta.estimate if r.delta else None,
                             "delta_ci": r.delta.half_width if r.delta else None,
                             "delta_method": r.delta.method if r.delta else None,
                             "baseline": r.variant.baseline, "vs": {k: iv(v) for k, v in r.refs.items()},
                             "tokens_per_s": stats.median([x.tokens_per_s for x in r.records]),
                             "peak_mem_mb": stats.median([x.peak_mem_mb for x in r.records]),
                             "target": r.target_name,
                             "time_to_target_s": {str(s): (None if h is None else h[0]) for s, h in r.to_target.items()},
                             "step_to_target": {str(s): (None if h is None else h[1]) for s, h in r.to_target.items()},
                             "runs": [x.run_id for x in r.records]}
            for r in rows}
