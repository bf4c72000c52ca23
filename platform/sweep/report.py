"""What a study shows: the console lines while it runs, the markdown report, Optuna's plots plus a
loss-versus-cost plot, and the study's parent MLflow run (one per study, found again on resume, every
trial's run nested under it) with the best trial so far.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from .. import tracking
from ..accounting import token_budget
from ..env import machine_description, repo_path
from .space import encode_kernels
from .storage import (STATE_NAMES, _close_trial_run, _quiet_experimental, default_storage, storage_label,
                      sync_trial_states)

if TYPE_CHECKING:
    from .objective import SweepContext

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def find_or_create_parent(client, experiment_id: str, study_name: str, storage: str, params: dict,
                          artifacts: dict[str, Path]) -> str:
    """The study's parent run: found by its study-name and storage tags (a resumed study reuses it)."""
    flt = (f"tags.`optuna.study` = '{study_name}' and tags.`sweep.role` = 'parent' "
           f"and tags.`optuna.storage` = '{storage}'")
    found = client.search_runs([experiment_id], filter_string=flt, order_by=["attributes.start_time ASC"],
                               max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        if "platform.note" in found[0].data.tags:  # a note from reaping the killed invocation: resumed now
            client.delete_tag(run_id, "platform.note")
        for k, v in tracking.run_tags().items():
            client.set_tag(run_id, k, v)
        return run_id
    from mlflow.entities import Param as MlflowParam

    tags = {**tracking.run_tags(), "optuna.study": study_name, "sweep.role": "parent", "optuna.storage": storage,
            "mlflow.runName": f"study-{study_name}"}
    run_id = client.create_run(experiment_id, tags=tags, run_name=f"study-{study_name}").info.run_id
    client.log_batch(run_id, params=[MlflowParam(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()])
    for sub, path in artifacts.items():
        client.log_artifact(run_id, str(path), artifact_path=sub)
    return run_id


def _best(study: optuna.Study):
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return min(complete, key=lambda t: t.value) if complete else None


def _shown_params(t) -> dict[str, Any]:
    """Parameters as a researcher reads them: m and the kernel set as a list first (instead of m, k1, k2,
    ... or the encoded "4-8-12"), then the rest."""
    out, ks = {}, t.user_attrs.get("kernels")
    if ks is not None:
        out["m"], out["kernels"] = t.user_attrs["m"], ks
    for k, v in t.params.items():
        if ks is not None and (k == "m" or re.fullmatch(r"k\d+", k) or v == encode_kernels(ks)):
            continue
        out[k] = v
    return out


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def study_report(study: optuna.Study, ctx: SweepContext, command: str) -> str:
    from ..stats import markdown_table

    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    best = _best(study)
    cfg = ctx.cfg
    names = []
    for t in trials:
        for k in _shown_params(t):
            if k not in names:
                names.append(k)
    rows = []
    for t in trials:
        shown = _shown_params(t)
        ua = t.user_attrs
        if t.state == TrialState.COMPLETE:
            value = f"**{t.value:.4f}**" if best is not None and t.number == best.number else f"{t.value:.4f}"
        elif t.state == TrialState.PRUNED and t.intermediate_values:
            step = max(t.intermediate_values)
            value = f"({t.intermediate_values[step]:.4f} at step {step})"
        else:
            value = "—"
        note = ua.get("fail_reason") or ua.get("invalid_reason") or ""
        if "duplicate_of" in ua:
            note = f"same parameters as trial {ua['duplicate_of']}: its value, not trained again"
        cost_f = f"{ua['extra_flops']:,.0f} ({ua['extra_flops_pct']:.2f}%)" if "extra_flops" in ua else "—"
        cost_p = f"{ua['extra_params']:,.0f} ({ua['extra_params_pct']:.2f}%)" if "extra_params" in ua else "—"
        if "wall_s" in ua:
            wall = f"{ua['wall_s']:.0f}"
        elif t.datetime_complete and t.datetime_start:
            wall = f"{(t.datetime_complete - t.datetime_start).total_seconds():.0f}"
        else:
            wall = "—"
        rows.append([t.number, STATE_NAMES[t.state], *(_fmt_value(shown[k]) if k in shown else "" for k in names),
                     value, cost_f, cost_p, wall, (ua.get("mlflow_run_id") or "")[:8], note[:80]])
    headers = ["trial", "state", *names, "val loss", "extra FLOPs/token (%)", "extra params (%)", "wall s",
               "MLflow run", "note"]
    table = markdown_table(headers, rows, "rl" + "l" * len(names) + "rrrrll")
    counts = {s: sum(t.state == st for t in trials) for st, s in STATE_NAMES.items()}
    t = cfg.trainer
    lines = [
        f"# Optuna study `{ctx.study_name}`",
        "",
        f"- command: `{command}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine_description()}",
        f"- model `{cfg.model.name}`, residual `{cfg.residual.name}`, objective: final `val/loss` "
        f"(nats/token, {t.val_batches} validation batches) after {t.max_steps} steps = "
        f"{token_budget(cfg):,} training tokens per trial",
        f"- sampler `{cfg.sweep.sampler}`, pruner `{cfg.sweep.pruner}`, "
        f"storage `{storage_label(cfg.sweep.storage or default_storage())}`",
        f"- trials: {counts['complete']} complete, {counts['pruned']} pruned, {counts['fail']} failed, "
        f"{counts['running']} running (target {cfg.sweep.n_trials})",
        "",
        table,
    ]
    if best is not None:
        lines.append(f"Best: trial {best.number}, val loss {best.value:.4f}, "
                     + ", ".join(f"{k}={_fmt_value(v)}" for k, v in _shown_params(best).items()) + ".")
    lines.append("Extra FLOPs/params are over vanilla (platform.accounting; % of the backbone's). A pruned "
                 "trial's loss is its last intermediate value, not comparable with the final ones.")
    return "\n".join(lines) + "\n"


def _figure(ax):
    import numpy as np

    return (ax.flat[0] if isinstance(ax, np.ndarray) else ax).figure


def study_plots(study: optuna.Study, out_dir: Path) -> dict[str, Path | str]:
    """Optuna's matplotlib plots as PNGs; {name: path, or the reason it was skipped}."""
    from ..plots import _pyplot

    plt = _pyplot()  # the Agg backend before Optuna's plots import pyplot
    import optuna.visualization.matplotlib as ovm

    out_dir.mkdir(parents=True, exist_ok=True)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    common = set.intersection(*(set(t.params) for t in complete)) if complete else set()
    varying = sorted(p for p in common if len({repr(t.params[p]) for t in complete}) > 1)
    order = {"m": 0, **{f"k{j}": j for j in range(1, 20)}}
    all_params = sorted({p for t in complete for p in t.params}, key=lambda p: (order.get(p, 100), p))
    contour = sorted(varying, key=lambda p: (order.get(p, 100), p))[:3]
    plan = {
        "optimization_history": (len(complete) >= 1, "no complete trial", lambda: ovm.plot_optimization_history(study)),
        "param_importances": (len(complete) >= 2 and len(varying) >= 2,
                              f"needs >= 2 complete trials and >= 2 varying parameters ({len(complete)}, {varying})",
                              lambda: ovm.plot_param_importances(study, params=varying)),
        "slice": (len(complete) >= 1 and bool(all_params), "no complete trial",
                  lambda: ovm.plot_slice(study, params=all_params)),
        "contour": (len(complete) >= 2 and len(contour) >= 2,
                    f"needs >= 2 complete trials over >= 2 varying parameters ({varying})",
                    lambda: ovm.plot_contour(study, params=contour)),
    }
    made: dict[str, Path | str] = {}
    for name, (ok, why, draw) in plan.items():
        if not ok:
            made[name] = f"skipped: {why}"
            continue
        try:
            with _quiet_experimental(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fig = _figure(draw())
                _tidy_log_axes(fig)
                path = out_dir / f"{name}.png"
                fig.savefig(path, dpi=110, bbox_inches="tight")
            made[name] = path
        except Exception as e:  # a plot must never cost the study
            made[name] = f"skipped: {type(e).__name__}: {e}"
        finally:
            plt.close("all")
    made["loss_vs_cost"] = _plot_loss_vs_cost(complete, out_dir) or "skipped: no complete trial with a cost"
    return made


def _tidy_log_axes(fig) -> None:
    """Log-scaled parameters (kernel sizes, lr) over short ranges get no or cluttered labels from
    matplotlib's defaults: label a few round numbers (1, 1.2, 1.5, 2, ... 8 x 10^e) in plain notation."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale != "log":
                continue
            lo, hi = sorted(axis.get_view_interval())
            if not (lo > 0 and hi > lo):
                continue
            exps = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
            marks = (m * 10.0**e for e in exps for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8))
            nice = sorted(v for v in marks if lo <= v <= hi)
            if len(nice) > 6:  # about six, evenly spread on the log axis
                nice = [nice[round(i * (len(nice) - 1) / 5)] for i in range(6)]
            axis.set_major_locator(FixedLocator(nice))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
            axis.set_minor_formatter(NullFormatter())


def _plot_loss_vs_cost(complete, out_dir: Path) -> Path | None:
    """Compute-matched view: each complete trial's loss against its extra FLOPs per token."""
    pts = [(t.user_attrs["extra_flops_pct"], t.value, t) for t in complete
           if "extra_flops_pct" in t.user_attrs and "duplicate_of" not in t.user_attrs]
    if not pts:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, t in pts:
        label = encode_kernels(t.user_attrs["kernels"]) if "kernels" in t.user_attrs else str(t.number)
        ax.annotate(f"#{t.number} {label}", (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("extra forward FLOPs per token over vanilla (% of backbone)")
    ax.set_ylabel("final val/loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "loss_vs_cost.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finalize(study: optuna.Study, ctx: SweepContext, command: str, status: str) -> str:
    """Report, plots and the parent run's best-trial record; safe to call after any invocation."""
    report = study_report(study, ctx, command)
    ctx.study_dir.mkdir(parents=True, exist_ok=True)
    (ctx.study_dir / "study.md").write_text(report)
    if ctx.cfg.sweep.report:
        out = repo_path(ctx.cfg.sweep.report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    plots = study_plots(study, ctx.study_dir / "plots")
    csv = None
    try:
        csv = ctx.study_dir / "trials.csv"
        study.trials_dataframe().to_csv(csv, index=False)
    except Exception:  # pandas missing: the markdown report has the same table
        csv = None
    client, run_id = ctx.client, ctx.parent_run_id
    if client is not None and run_id:
        sync_trial_states(study, client)
        trials = study.get_trials(deepcopy=False)
        n_done = sum(t.state.is_finished() for t in trials)
        for st in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            client.log_metric(run_id, f"trials/{STATE_NAMES[st]}", sum(t.state == st for t in trials), step=n_done)
        best = _best(study)
        if best is not None:
            # Metrics, not params: a resumed study may find a better trial, and MLflow params never change.
            client.log_metric(run_id, "best/value", best.value, step=n_done)
            client.log_metric(run_id, "best/trial", best.number, step=n_done)
            for k, v in best.params.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    client.log_metric(run_id, f"best/{k}", v, step=n_done)
            for k in ("extra_flops_pct", "extra_params_pct"):
                if k in best.user_attrs:
                    client.log_metric(run_id, f"best/{k}", best.user_attrs[k], step=n_done)
            shown = _shown_params(best)
            client.set_tag(run_id, "best.params", json.dumps(shown))
            if "kernels" in shown:
                client.set_tag(run_id, "best.kernels", encode_kernels(shown["kernels"]))
            if best.user_attrs.get("mlflow_run_id"):
                client.set_tag(run_id, "best.run_id", best.user_attrs["mlflow_run_id"])
        client.log_artifact(run_id, str(ctx.study_dir / "study.md"), artifact_path="study")
        if csv is not None:
            client.log_artifact(run_id, str(csv), artifact_path="study")
        for name, path in plots.items():
            if isinstance(path, Path):
                client.log_artifact(run_id, str(path), artifact_path="plots")
        skipped = {k: v for k, v in plots.items() if isinstance(v, str)}
        client.set_tag(run_id, "plots.skipped", json.dumps(skipped)[:MAX_PARAM_CHARS] if skipped else "none")
        client.set_terminated(run_id, status)
    return report


def _announce(ctx: SweepContext, trial: optuna.Trial) -> None:
    study = trial.study
    done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    best = _best(study)
    best_txt = f"best so far {best.value:.4f} (trial {best.number})" if best else "no complete trial yet"
    elapsed = time.time() - ctx.started
    msg = (f"{ctx.study_name} · trial {trial.number} · {done + 1}/{ctx.n_trials} · {best_txt} · "
           f"{elapsed / 60:.1f} min")
    if ctx.console is not None:
        ctx.console.rule(f"[bold]{msg}")
    else:
        print(f"--- {msg}", flush=True)


def _after_trial(ctx: SweepContext):
    def callback(study: optuna.Study, t) -> None:
        state = STATE_NAMES[t.state]
        ctx.consecutive_failures = ctx.consecutive_failures + 1 if t.state == TrialState.FAIL else 0
        _close_trial_run(ctx.client, t.user_attrs.get("mlflow_run_id"), state)
        shown = ", ".join(f"{k}={_fmt_value(v)}" for k, v in _shown_params(t).items())
        value = f"{t.value:.4f}" if t.value is not None else ""
        why = t.user_attrs.get("fail_reason") or t.user_attrs.get("invalid_reason") or ""
        if t.state == TrialState.PRUNED:
            why = f"at step {t.user_attrs.get('pruned_at_step')}"
        if "duplicate_of" in t.user_attrs:
            why = f"(same parameters as trial {t.user_attrs['duplicate_of']}: not trained again)"
        style = {"complete": "green", "pruned": "yellow", "fail": "red"}.get(state, "white")
        line = f"trial {t.number} [{style}]{state}[/{style}] {value} {shown} {why}".rstrip()
        if ctx.console is not None:
            ctx.console.print(line)
        else:
            print(re.sub(r"\[/?\w+\]", "", line), flush=True)

    return callback


def _summary_table(study: optuna.Study, console) -> None:
    from rich.table import Table

    best = _best(study)
    table = Table(title=f"study {study.study_name}")
    for col in ("trial", "state", "params", "val loss", "extra FLOPs %"):
        table.add_column(col, justify="right" if col in ("trial", "val loss", "extra FLOPs %") else "left")
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        value = f"{t.value:.4f}" if t.value is not None else ""
        if t.state == TrialState.PRUNED and value:
            value = f"({value})"  # the last intermediate value
        if best is not None and t.number == best.number:
            value = f"[bold green]{value}"
        table.add_row(str(t.number), STATE_NAMES[t.state],
                      ", ".join(f"{k}={_fmt_value(v)}" for k, v in _shown_params(t).items()), value,
                      f"{t.user_attrs['extra_flops_pct']:.2f}" if "extra_flops_pct" in t.user_attrs else "")
    console.print(table)


def _say(ctx: SweepContext, msg: str) -> None:
    if ctx.console is not None:
        ctx.console.print(msg)
    else:
        print(msg, flush=True)
