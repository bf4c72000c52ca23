"""Loss versus training compute per residual, and the compute multiplier at which vanilla matches each variant.

    python -m platform.scaling [scaling.*] [overrides]              # e.g. trainer=gpu data=large
    python -m platform.scaling scaling.train=false                  # only fit what MLflow holds

Each variant is trained at every size (`scaling.sizes`: model presets, optionally followed by
overrides, quoted on the command line: `scaling.sizes=[tiny,'tiny model.d_model=32']`;
`scaling.steps`: trainer.max_steps per size) and seed,
in this process through `platform.train.train` (configs from Hydra's Compose API, as sweeps do), or
with `scaling.workers=N` as N processes at a time, worker i on GPU i (`scaling.workers=0`: one per
visible GPU; more workers than GPUs share them), each a `scaling.fit=false` command for one point.
A run already FINISHED in MLflow with the same config and seed is read instead of trained, so the
command resumes (a killed study loses only its unfinished runs). Runs are matched as
`platform.compare` matches them (`platform.compare.matching`: the logged model, data, trainer and
residual params without knobs that do not change the numbers, fields added since a run was stored
taken at their old behaviour, renamed residuals under their new names), so a run of the same config
made by `platform.run`, a comparison or another machine's store counts alike.

Compute of a run: training FLOPs = 3 x the analytic forward FLOPs per token (the backbone's,
`platform.accounting`, plus the residual's own extra) x the training tokens (backward ~ 2x forward).

The fit (pure functions, `fit_power_law`): L_v(C) = E + A_v (C / C0)^(-alpha) with one irreducible
loss E, one exponent alpha (or one per variant with `scaling.shared_alpha=false`) and one
coefficient A_v per variant, C0 = the geometric mean of the runs' compute. For a given E the model
is linear in log(L - E), so it is solved by least squares, and E is found by minimising the squared
error in loss (a grid, then golden-section refinement), or fixed with `scaling.E=<value>`. The
multiplier of variant v at compute C is C'/C where vanilla reaches L_v(C) at C'; with a shared
exponent it is (A_ref / A_v)^(1/alpha) at every C (> 1: vanilla needs more compute). Its interval
is a bootstrap percentile interval: seeds resampled within each (variant, size) when every cell has
two or more, else residuals resampled around the fit.

Writes `<report_dir>/<name>.md` (table), `.png` (points and curves), `.json`, and logs them to an
MLflow run tagged `platform.kind=scaling`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .env import machine_description, repo_path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAFE_NAME = re.compile(r"[^\w.-]+")  # what a size string may not keep in a file name
TRAINING_FLOPS_FACTOR = 3.0  # forward + backward ~ 3 forward passes

# --- the fit (pure) ---------------------------------------------------------------------------------------
@dataclass
class PowerLawFit:
    """L_g(C) = E + exp(log_A[g]) * (C / C0) ** -alpha[g] for every group g (variant)."""

    E: float
    alpha: dict[str, float]
    log_A: dict[str, float]
    C0: float
    reference: str
    sse: float  # squared error of the fit in loss units
    n: int  # points fitted

    def predict(self, group: str, compute) -> np.ndarray:
        x = np.log(np.asarray(compute, dtype=float) / self.C0)
        return self.E + np.exp(self.log_A[group] - self.alpha[group] * x)

    def multiplier(self, group: str, compute: float) -> float:
        """C'/C with L_reference(C') = L_group(C): the compute vanilla needs, relative to the variant's.

        NaN when the reference's fitted loss does not fall with compute (alpha <= 0): no such C'.
        """
        gap = float(self.predict(group, compute)) - self.E
        ref = self.reference
        if self.alpha[ref] <= 0:
            return math.nan
        log_c = math.log(self.C0) + (self.log_A[ref] - math.log(gap)) / self.alpha[ref]
        return math.exp(log_c - math.log(compute))


def _fit_given_E(x, loss, codes, n_groups, E, shared_alpha):
    """Least squares of log(L - E) = a_g - alpha_(g) x; returns (coefficients, squared error in loss)."""
    onehot = np.eye(n_groups)[codes]  # (n, G)
    slope = -x[:, None] if shared_alpha else -x[:, None] * onehot  # (n, 1) or (n, G)
    X = np.concatenate([onehot, slope], axis=1)
    coef, *_ = np.linalg.lstsq(X, np.log(loss - E), rcond=None)
    pred = E + np.exp(X @ coef)
    return coef, float(np.sum((loss - pred) ** 2))


def fit_power_law(compute, loss, groups: Sequence[str], reference: str, *, E: float | None = None,
                  shared_alpha: bool = True, grid: int = 64) -> PowerLawFit:
    """Fit L = E + A_g (C/C0)^-alpha to points (compute, loss, group); see the module docstring.

    Needs at least two distinct compute values per group; E, when fixed, must lie below every loss.
    """
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    names = list(dict.fromkeys(groups))
    if reference not in names:
        raise ValueError(f"reference={reference!r} has no points; groups: {names}")
    if not (len(compute) == len(loss) == len(groups)):
        raise ValueError(f"{len(compute)} compute values, {len(loss)} losses, {len(groups)} groups")
    if np.any(compute <= 0) or not np.all(np.isfinite(loss)):
        raise ValueError("compute must be > 0 and every loss finite")
    codes = np.array([names.index(g) for g in groups])
    for i, g in enumerate(names):
        if len(np.unique(compute[codes == i])) < 2:
            raise ValueError(f"group {g!r} needs points at two or more compute values to fit a slope")
    C0 = float(np.exp(np.mean(np.log(compute))))
    x = np.log(compute / C0)
    top = float(loss.min())
    if E is not None and not 0 <= E < top:
        raise ValueError(f"E={E} must be >= 0 and below the smallest loss {top:.4f}")

    def sse(e: float) -> float:
        return _fit_given_E(x, loss, codes, len(names), e, shared_alpha)[1]

    if E is None:
        hi = top * (1 - 1e-6)
        candidates = np.linspace(0.0, hi, grid)
        errors = [sse(e) for e in candidates]
        i = int(np.argmin(errors))
        a, b = candidates[max(i - 1, 0)], candidates[min(i + 1, grid - 1)]
        golden = (math.sqrt(5) - 1) / 2
        for _ in range(50):  # golden-section search inside the best grid bracket
            c, d = b - golden * (b - a), a + golden * (b - a)
            if sse(c) < sse(d):
                b = d
            else:
                a = c
        E = min((a + b) / 2, candidates[i], key=sse)
    coef, error = _fit_given_E(x, loss, codes, len(names), E, shared_alpha)
    G = len(names)
    alphas = [coef[G]] * G if shared_alpha else list(coef[G:])
    return PowerLawFit(E=float(E), alpha={g: float(alphas[i]) for i, g in enumerate(names)},
                       log_A={g: float(coef[i]) for i, g in enumerate(names)}, C0=C0, reference=reference,
                       sse=error, n=len(loss))


def bootstrap_multipliers(compute, loss, groups: Sequence[str], cells: Sequence, reference: str, at: float, *,
                          E: float | None = None, shared_alpha: bool = True, n_boot: int = 1000,
                          level: float = 0.95, seed: int = 0) -> dict[str, tuple[float, float, int]]:
    """Percentile interval of each group's multiplier at compute ``at``: ``{group: (low, high, n_ok)}``.

    ``cells`` labels each point's (group, size): when every cell has two or more points (seeds) they
    are resampled within their cell; otherwise residuals (inflated for the parameters fitted) are
    resampled around the full fit. Refits
    whose exponent is not positive (no decrease with compute) count as failures (``n_boot - n_ok``).
    """
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    groups = list(groups)
    rng = np.random.default_rng(seed)
    by_cell: dict = {}
    for i, c in enumerate(cells):
        by_cell.setdefault(c, []).append(i)
    resample_seeds = all(len(v) >= 2 for v in by_cell.values())
    full = fit_power_law(compute, loss, groups, reference, E=E, shared_alpha=shared_alpha)
    fitted = np.array([full.predict(g, c) for g, c in zip(groups, compute)])
    names = list(dict.fromkeys(groups))
    # Fitted residuals are smaller than the noise by the parameters the fit spent: inflate them by
    # sqrt(n / (n - p)), p = the A's, the exponent(s) and E when it is fitted.
    n_params = len(names) * (1 if shared_alpha else 2) + (1 if shared_alpha else 0) + (E is None)
    residuals = (loss - fitted) * math.sqrt(len(loss) / max(len(loss) - n_params, 1))
    draws: dict[str, list[float]] = {g: [] for g in names}
    for _ in range(n_boot):
        if resample_seeds:
            idx = np.concatenate([rng.choice(v, size=len(v), replace=True) for v in by_cell.values()])
            c, y, g = compute[idx], loss[idx], [groups[i] for i in idx]
        else:
            c, y, g = compute, fitted + rng.choice(residuals, size=len(loss), replace=True), groups
        try:
            fit = fit_power_law(c, y, g, reference, E=E, shared_alpha=shared_alpha)
        except (ValueError, np.linalg.LinAlgError):
            continue
        if min(fit.alpha.values()) <= 0:
            continue
        for name in names:
            draws[name].append(fit.multiplier(name, at))
    tail = 100 * (1 - level) / 2
    out = {}
    for name, values in draws.items():
        if values:
            low, high = np.percentile(values, [tail, 100 - tail])
            out[name] = (float(low), float(high), len(values))
        else:
            out[name] = (math.nan, math.nan, 0)
    return out


# --- configuration -----------------------------------------------------------------------------------------
@dataclass
class ScalingConfig:
    variants: list[str] = field(default_factory=lambda: ["vanilla", "attnres_block", "msar_block"])
    reference: str = "vanilla"  # the variant the multipliers are measured against
    # Model presets (conf/model/), each optionally followed by overrides ("tiny model.d_model=32").
    sizes: list[str] = field(default_factory=lambda: ["scale_xs", "scale_s", "small"])  # 11.6x in compute
    steps: list[int] = field(default_factory=lambda: [250, 350, 500])  # trainer.max_steps per size
    seeds: list[int] = field(default_factory=lambda: [0])
    train: bool = True  # train what MLflow lacks; false: fit only what it holds
    fit: bool = True  # false: only train the missing runs (pieces run side by side, one fit at the end)
    workers: int = 1  # runs trained at once as their own processes, one GPU each (0: one per visible GPU)
    E: Optional[float] = None  # fix the irreducible loss instead of fitting it
    shared_alpha: bool = True  # one exponent for all variants (a constant multiplier)
    n_boot: int = 1000  # bootstrap refits for the intervals
    level: float = 0.95
    name: str = "scaling"
    report_dir: str = "benchmarks/results"  # <name>.md, .png, .json go here
    out_dir: Optional[str] = None  # run dirs; default outputs/scaling/<name>
    log_mlflow: bool = True  # log the table and plot to an MLflow run tagged platform.kind=scaling


def parse_args(argv: Sequence[str]) -> tuple[ScalingConfig, list[str]]:
    """Split `scaling.*` options (typed) from the config overrides that every run shares."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    node = OmegaConf.structured(ScalingConfig)
    base = []
    for text, ov in zip(argv, OverridesParser.create().parse_overrides(list(argv))):
        key = ov.key_or_group
        if not key.startswith("scaling."):
            if key.lstrip("+~") in ("model", "residual", "ablation", "seed", "trainer.max_steps"):
                raise ValueError(f"{text!r}: sizes, variants, seeds and steps come from scaling.sizes, "
                                 "scaling.variants, scaling.seeds and scaling.steps")
            base.append(text)
            continue
        OmegaConf.update(node, key[len("scaling."):], ov.value(), merge=False)
    sc: ScalingConfig = OmegaConf.to_object(node)
    check(sc)
    return sc, base


def check(sc: ScalingConfig) -> None:
    """Every scaling.* value that can be wrong, before any training."""
    import ablations
    import residuals

    known = sorted({*residuals.names(), *ablations.names()})
    for v in sc.variants:
        if v not in known:
            raise ValueError(f"scaling.variants: {v!r} is not a residual or ablation; valid: {', '.join(known)}")
    if not (isinstance(sc.workers, int) and sc.workers >= 0):
        raise ValueError(f"scaling.workers={sc.workers!r} must be >= 0 (0: one per visible GPU)")
    if sc.fit and sc.reference not in sc.variants:  # a training-only piece may leave the reference out
        raise ValueError(f"scaling.reference={sc.reference!r} must be one of scaling.variants={sc.variants}")
    if len(sc.variants) != len(set(sc.variants)):
        raise ValueError(f"scaling.variants={sc.variants} has duplicates")
    if len(sc.sizes) < (2 if sc.fit else 1) or len(sc.steps) != len(sc.sizes):
        raise ValueError(f"scaling.sizes ({len(sc.sizes)}) needs two or more entries and scaling.steps "
                         f"({len(sc.steps)}) one per size")
    if any(s < 1 for s in sc.steps):
        raise ValueError(f"scaling.steps={sc.steps} must be positive")
    if not sc.seeds:
        raise ValueError("scaling.seeds is empty")
    if not 0 < sc.level < 1:
        raise ValueError(f"scaling.level={sc.level} must be in (0, 1)")
    if sc.n_boot < 0:
        raise ValueError(f"scaling.n_boot={sc.n_boot} must be >= 0")
    if sc.E is not None and sc.E < 0:
        raise ValueError(f"scaling.E={sc.E} must be >= 0 (or null to fit it)")


def size_overrides(size: str) -> list[str]:
    """"small" -> ["model=small"]; "tiny model.d_model=32" -> ["model=tiny", "model.d_model=32"]."""
    preset, *rest = size.split()
    return [f"model={preset}", *rest]


def variant_override(name: str) -> str:
    import ablations

    return f"ablation={name}" if name in ablations.names() else f"residual={name}"


def training_tokens(cfg) -> int:
    t = cfg.trainer
    return int(t.max_steps * t.accumulate_grad_batches * t.devices * cfg.data.batch_size * cfg.model.seq_len)


@dataclass
class Point:
    variant: str
    size: str
    seed: int
    steps: int
    tokens: int
    flops_per_token: float  # forward, backbone + residual
    compute: float  # training FLOPs
    loss: float  # final validation loss
    wall_s: float  # training wall-clock of the run
    run_id: str
    trained_now: bool


# --- training / reading runs ---------------------------------------------------------------------------
def plan(sc: ScalingConfig, base: Sequence[str]) -> list[tuple[str, str, int, int, object]]:
    """(variant, size, seed, steps, config) of every point, composed and validated before any training."""
    from .config import compose, validate

    cfgs = []
    for size, steps in zip(sc.sizes, sc.steps):
        for variant in sc.variants:
            for seed in sc.seeds:
                cfg = compose(*base, *size_overrides(size), variant_override(variant), f"seed={seed}",
                              f"trainer.max_steps={steps}")
                if not cfg.mlflow.enabled:
                    raise ValueError("mlflow.enabled=false: the scaling fit reads its runs from MLflow")
                validate(cfg)
                cfgs.append((variant, size, seed, steps, cfg))
    return cfgs


def finished_run(client, exp_id: str, cfg, index: dict | None = None) -> list:
    """The newest FINISHED run of this config and seed (matched as `platform.compare` matches runs), as
    a list of at most one. ``index``: a dict the caller keeps across points, so each residual's runs
    are searched once (residual -> `finished_runs_by_key`)."""
    from .compare.matching import config_key, finished_runs_by_key, flat_params

    index = {} if index is None else index
    name = cfg.residual.name
    if name not in index:
        index[name] = finished_runs_by_key(client, exp_id, name)
    return index[name].get((config_key(flat_params(cfg)), int(cfg.seed)), [])[:1]


def piece_command(sc: ScalingConfig, base: Sequence[str], variant: str, size: str, seed: int, steps: int) -> list[str]:
    """The `platform.scaling` command that trains one point and fits nothing (a worker's job)."""
    import sys

    return [sys.executable, "-m", "platform.scaling", *base, "scaling.fit=false", "scaling.workers=1",
            f"scaling.variants=[{variant}]", f"scaling.sizes=['{size}']", f"scaling.steps=[{steps}]",
            f"scaling.seeds=[{seed}]", f"scaling.name={sc.name}"] + (
                [f"scaling.out_dir={sc.out_dir}"] if sc.out_dir else [])


def train_pieces(sc: ScalingConfig, base: Sequence[str], jobs: list, workers: int, gpus: list[str]) -> list[int]:
    """Train the missing points as `workers` processes at a time, one GPU each (`env.run_in_slots`);
    each writes its output to <out_dir>/logs/<variant>_<size>_s<seed>.log. Returns the exit codes."""
    import subprocess

    from .env import REPO_ROOT, run_in_slots

    logs = repo_path(sc.out_dir or Path("outputs", "scaling", sc.name)) / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def launch(job, env, parallel):
        variant, size, seed, steps, _ = job
        log = logs / f"{variant}_{SAFE_NAME.sub('_', size)}_s{seed}.log"
        where = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in env else ""
        print(f"scaling: training {variant} @ {size} ({steps} steps), seed {seed}{where} > {log}", flush=True)
        with open(log, "w") as fh:
            return subprocess.run(piece_command(sc, base, variant, size, seed, steps), cwd=REPO_ROOT, env=env,
                                  stdout=fh, stderr=subprocess.STDOUT).returncode

    return run_in_slots(jobs, workers, gpus, launch)


def collect(sc: ScalingConfig, base: Sequence[str], client, exp_id: str,
            train: bool | None = None) -> tuple[list[Point], list[str]]:
    """Every (variant, size, seed) point: read from MLflow by key, trained here (in this process) when
    missing and ``train`` (default ``sc.train``)."""
    from .train import train as train_run

    train = sc.train if train is None else train
    out_dir = repo_path(sc.out_dir or Path("outputs", "scaling", sc.name))
    points, missing, index = [], [], {}
    for variant, size, seed, steps, cfg in plan(sc, base):
        found = finished_run(client, exp_id, cfg, index)
        trained_now = False
        if not found and train:
            cfg.mlflow.run_name = f"{sc.name}-{variant}-{size.split()[0]}-s{seed}"
            label = f"{variant} @ {size} ({steps} steps), seed {seed}"
            print(f"scaling: training {label}", flush=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            try:
                result = train_run(cfg, run_dir=out_dir / "runs" / f"{variant}_{size.split()[0]}_s{seed}_{stamp}",
                                   extra_tags={"platform.kind": "scaling-run", "scaling.size": size,
                                               "scaling.name": sc.name})
            except Exception as e:  # one failed run (NaN, out of memory) costs its point, not the study
                missing.append(f"{variant} @ {size}, seed {seed}: failed ({type(e).__name__}: {str(e)[:200]})")
                continue
            found = [client.get_run(result.mlflow_run_id)]
            trained_now = True
        if not found:
            from .compare.matching import flat_params, nearest_difference

            why = nearest_difference(client, exp_id, cfg.residual.name, flat_params(cfg))
            missing.append(f"{variant} @ {size}, seed {seed} ({why})")
            continue
        run = found[0]
        params, metrics = run.data.params, run.data.metrics
        fwd = float(params["flops/backbone_per_token"]) + float(params["flops/residual_extra_per_token"])
        tokens = training_tokens(cfg)
        points.append(Point(variant, size, seed, steps, tokens, fwd, TRAINING_FLOPS_FACTOR * fwd * tokens,
                            float(metrics.get("final/val_loss", math.nan)),
                            float(metrics.get("final/wall_s", math.nan)), run.info.run_id, trained_now))
    return points, missing


# --- report -----------------------------------------------------------------------------------------------
def analyse(points: list[Point], sc: ScalingConfig) -> dict:
    """The fit, the multipliers at the largest compute of the reference, and their intervals."""
    good = [p for p in points if math.isfinite(p.loss)]
    compute = [p.compute for p in good]
    loss = [p.loss for p in good]
    groups = [p.variant for p in good]
    fit = fit_power_law(compute, loss, groups, sc.reference, E=sc.E, shared_alpha=sc.shared_alpha)
    at = max(p.compute for p in good if p.variant == sc.reference)
    intervals = bootstrap_multipliers(compute, loss, groups, [(p.variant, p.size) for p in good], sc.reference, at,
                                      E=sc.E, shared_alpha=sc.shared_alpha, n_boot=sc.n_boot, level=sc.level)
    return {"fit": fit, "at": at, "intervals": intervals,
            "multipliers": {v: fit.multiplier(v, at) for v in fit.log_A}}


def markdown(points: list[Point], analysis: dict, sc: ScalingConfig, command: str, machine: str,
             base: Sequence[str]) -> str:
    from .stats import markdown_table

    fit, at, ivs = analysis["fit"], analysis["at"], analysis["intervals"]
    level = round(100 * sc.level)
    runs = []
    for size, steps in zip(sc.sizes, sc.steps):
        for v in sc.variants:
            cell = [p for p in points if p.variant == v and p.size == size]
            if not cell:
                runs.append([f"`{size}`", v, steps, "-", "-", "-", "missing", "-"])
                continue
            losses = ", ".join(f"{p.loss:.4f}" for p in sorted(cell, key=lambda p: p.seed))
            walls = ", ".join(f"{p.wall_s:.0f}" for p in sorted(cell, key=lambda p: p.seed))
            runs.append([f"`{size}`", v, steps, f"{cell[0].tokens:,}", f"{cell[0].flops_per_token / 1e6:.2f}",
                         f"{cell[0].compute:.3e}", losses, walls])
    fits = []
    for v in fit.log_A:
        low, high, ok = ivs.get(v, (math.nan, math.nan, 0))
        m = analysis["multipliers"][v]
        shown = "1 (reference)" if v == sc.reference else f"{m:.3f} [{low:.3f}, {high:.3f}]"
        fits.append([v, f"{math.exp(fit.log_A[v]):.4f}", f"{fit.alpha[v]:.4f}", shown,
                     "-" if v == sc.reference else f"{ok}/{sc.n_boot}"])
    return "\n".join([
        f"# Scaling fit `{sc.name}`",
        "",
        f"- command: `{command}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine}",
        f"- shared overrides: `{' '.join(base) or '(none)'}`; seeds {sc.seeds}",
        "- compute = 3 x analytic forward FLOPs per token (backbone + residual) x training tokens",
        f"- training wall-clock of these runs: {sum(p.wall_s for p in points if math.isfinite(p.wall_s)):.0f} s in all",
        "",
        markdown_table(["size", "variant", "steps", "tokens", "fwd MFLOP/token", "compute (FLOPs)",
                        "final val loss (per seed)", "wall (s, per seed)"], runs).rstrip(),
        "",
        f"Fit: L_v(C) = E + A_v (C / C0)^-alpha_v, E = {fit.E:.4f}"
        + (" (fixed)" if sc.E is not None else " (fitted)") + f", C0 = {fit.C0:.3e} FLOPs, "
        + ("one exponent for all variants" if sc.shared_alpha else "one exponent per variant")
        + f"; {fit.n} points, RMS error {math.sqrt(fit.sse / fit.n):.4f}.",
        "",
        markdown_table(["variant", "A_v", "alpha_v", f"compute multiplier [{level}% interval]", "bootstrap fits"],
                       fits).rstrip(),
        "",
        f"Multiplier: the compute vanilla needs to reach the variant's fitted loss, relative to the variant's "
        f"(> 1: the variant is better), at C = {at:.3e} FLOPs (the largest reference run)"
        + ("; with a shared exponent it is the same at every C" if sc.shared_alpha else "") + ". "
        f"Interval: bootstrap percentiles ({sc.n_boot} refits; seeds resampled within each size when there "
        "are two or more per cell, else residuals around the fit). "
        "Paper (MoE, from a scaling fit; full scale): MSAR 1.58x; mHC and AttnRes 1.30-1.35x; Block AttnRes "
        "1.25x in the AttnRes paper.",
        "",
    ])


def plot(points: list[Point], analysis: dict, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fit = analysis["fit"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lo, hi = min(p.compute for p in points), max(p.compute for p in points)
    grid = np.geomspace(lo / 1.5, hi * 1.5, 100)
    for i, v in enumerate(fit.log_A):
        color = f"C{i}"
        mine = [p for p in points if p.variant == v]
        ax.plot([p.compute for p in mine], [p.loss for p in mine], "o", color=color, alpha=0.8)
        label = v if v == fit.reference else f"{v} ({analysis['multipliers'][v]:.2f}x)"
        ax.plot(grid, fit.predict(v, grid), "-", color=color, label=label)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: no overlapping labels
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run_scaling(sc: ScalingConfig, base: Sequence[str], command: str) -> dict:
    from . import tracking
    from .config import compose

    cfg0 = compose(*base, *size_overrides(sc.sizes[0]), variant_override(sc.variants[0]))
    client, _, exp_id = tracking.open_experiment(cfg0)  # the store prepared under its lock, orphans reaped
    from .env import check_workers, visible_gpus

    gpus = visible_gpus()
    workers = sc.workers if sc.workers > 0 else max(1, len(gpus))
    if sc.train and workers > 1:  # the missing points as worker processes, then everything read back
        check_workers(workers, gpus, cfg0.trainer.devices, "scaling.workers")
        index = {}
        jobs = [job for job in plan(sc, base) if not finished_run(client, exp_id, job[4], index)]
        print(f"scaling: {len(jobs)} run(s) to train, {workers} at a time"
              + (f" on GPU(s) {','.join(gpus)}" if gpus else " on the CPU"), flush=True)
        train_pieces(sc, base, jobs, workers, gpus)
        points, missing = collect(sc, base, client, exp_id, train=False)
        for p in points:
            p.trained_now = any(p.variant == j[0] and p.size == j[1] and p.seed == j[2] for j in jobs)
    else:
        points, missing = collect(sc, base, client, exp_id)
    if not sc.fit:
        print(f"scaling: {len(points)} run(s) finished ({sum(p.trained_now for p in points)} trained now), "
              f"{len(missing)} missing; no fit (scaling.fit=false)", flush=True)
        return {"points": points, "missing": missing, "files": {}}
    if not any(math.isfinite(p.loss) for p in points):
        raise ValueError(f"no finished runs to fit: {len(missing)} missing, e.g. {missing[0] if missing else '-'}"
                         + ("; run with scaling.train=true to train them" if not sc.train else ""))
    report_dir = repo_path(sc.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    analysis = analyse(points, sc)
    text = markdown(points, analysis, sc, command, machine_description(), base)
    if missing:
        text += "\n## Missing\n\n" + "\n".join(f"- {m}" for m in missing) + "\n"
    files = {"md": report_dir / f"{sc.name}.md", "png": report_dir / f"{sc.name}.png",
             "json": report_dir / f"{sc.name}.json"}
    files["md"].write_text(text)
    plot(points, analysis, files["png"], f"{sc.name}: loss vs compute")
    fit = analysis["fit"]
    files["json"].write_text(json.dumps({
        "config": asdict(sc), "base_overrides": list(base), "points": [asdict(p) for p in points],
        "fit": asdict(fit), "at": analysis["at"], "multipliers": analysis["multipliers"],
        "intervals": {k: list(v) for k, v in analysis["intervals"].items()}}, indent=2))
    if sc.log_mlflow:
        _log(client, exp_id, sc, base, analysis, files)
    print(text)
    return {"points": points, "missing": missing, "files": files, **analysis}


def _log(client, exp_id: str, sc: ScalingConfig, base, analysis: dict, files: dict) -> str:
    from mlflow.entities import Metric, Param

    from . import tracking

    run_id = client.create_run(exp_id, tags={**tracking.run_tags(), "platform.kind": "scaling"},
                               run_name=f"scaling-{sc.name}"[:250]).info.run_id
    fit, now = analysis["fit"], int(time.time() * 1000)
    params = [Param("scaling/variants", ",".join(sc.variants)), Param("scaling/sizes", ",".join(sc.sizes)[:6000]),
              Param("scaling/steps", str(sc.steps)), Param("scaling/seeds", str(sc.seeds)),
              Param("scaling/base_overrides", " ".join(base)[:6000]),
              Param("scaling/shared_alpha", str(sc.shared_alpha))]
    metrics = [Metric("fit/E", fit.E, now, 0)]
    for v in fit.log_A:
        low, high, _ = analysis["intervals"][v]
        for k, value in (("alpha", fit.alpha[v]), ("A", math.exp(fit.log_A[v])),
                         ("multiplier", analysis["multipliers"][v]), ("multiplier_low", low),
                         ("multiplier_high", high)):
            if math.isfinite(value):
                metrics.append(Metric(f"{v}/{k}", float(value), now, 0))
    client.log_batch(run_id, metrics=metrics, params=params)
    for f in files.values():
        client.log_artifact(run_id, str(f))
    client.set_terminated(run_id, "FINISHED")
    return run_id


def main(argv: Sequence[str] | None = None):
    from .cli import one_line_errors, start

    argv = start(argv, __doc__)
    if argv is None:  # --help
        return None

    with one_line_errors(argv):
        sc, base = parse_args(argv)
        result = run_scaling(sc, base, command="python -m platform.scaling " + " ".join(argv))
    if result["missing"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
