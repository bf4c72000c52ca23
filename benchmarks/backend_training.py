"""Does training with a fused residual op follow the reference? Short runs per backend and seed.

    python -m benchmarks.backend_training                          # GPU: model=small, 60 steps, seeds 0 1
    python -m benchmarks.backend_training --residuals msar_block --steps 60 --seeds 0 1 2

For every residual, the same short training run (same seed, same data order) once with
``residual.backend=torch`` (the PyTorch reference) and once with ``residual.backend=triton`` (the fused
op), for each seed. The fused op passes when, at every logged step, the gap between the two backends'
training losses (averaged over the seeds) stays within the run-to-run spread of the reference (the
largest gap between two reference seeds at that step), plus 1% of the loss: bf16 rounding differs
between the two, so equality is not expected, only that the difference is smaller than what a new
seed does. Writes benchmarks/results/backend_training_<model>.md via `roofline.Table`, again after every
residual; a residual whose runs raise is a FAILED row (the others still run, the exit code is 1).

`--reference` and `--candidate` replace the two arms' overrides (default ``residual.backend=torch`` and
``residual.backend=triton``), so any setting can be held to the same test, e.g. mHC's streams in bf16 against its
default fp32 ones:

    python -m benchmarks.backend_training --residuals mhc --reference residual.backend=auto \
        --candidate residual.stream_dtype=bf16 --steps 200 --seeds 0 1 2 --name small_mhc_bf16_streams

An arm's item ``py:MODULE.NAME.ATTR=VALUE`` is a setting of the code (as in ``benchmarks.throughput``'s rows), held
for that arm's runs alone and restored after each, e.g. Block AttnRes's phase-1 outputs in bf16 (its default)
against fp32 ones:

    python -m benchmarks.backend_training --residuals attnres_block \
        --reference py:residuals.attnres_block.AttnResBlock.phase1_dtype=stream --candidate residual.backend=auto \
        --steps 300 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import lightning as L


class StepLosses(L.Callback):
    """The training loss of every optimizer step."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def run(residual: str, arm: list[str], seed: int, steps: int, overrides: list[str]) -> dict[int, float]:
    """One short training run of ``residual`` with the ``arm``'s overrides (e.g. ``["residual.backend=torch"]``;
    ``py:`` items are settings of the code, held for the run)."""
    from platform.config import compose
    from platform.train import train

    from benchmarks.roofline import held
    from benchmarks.throughput import code_settings

    settings = code_settings("@".join([residual, *(item for item in arm if item.startswith("py:"))]))
    config = [item for item in arm if not item.startswith("py:")]
    recorder = StepLosses()
    with tempfile.TemporaryDirectory() as tmp, held(settings):
        cfg = compose(f"residual={residual}", *config, f"seed={seed}",
                      f"trainer.max_steps={steps}", f"trainer.val_every={steps}", "trainer.progress_bar=false",
                      "mlflow.enabled=false", "mlflow.depth_heatmaps=false", *overrides)
        train(cfg, callbacks=[recorder], run_dir=Path(tmp) / "run")
    return recorder.losses


def verdict(reference: list[dict[int, float]], fused: list[dict[int, float]]) -> tuple[bool, float, float, int]:
    """(passes, worst gap between the backends' seed means, the reference spread there, at which step)."""
    steps = sorted(set.intersection(*(set(r) for r in reference + fused)))
    worst = (0.0, 0.0, steps[0] if steps else 0)
    ok = True
    for step in steps:
        ref = [r[step] for r in reference]
        gap = abs(statistics.fmean(f[step] for f in fused) - statistics.fmean(ref))
        spread = (max(ref) - min(ref)) + 0.01 * statistics.fmean(ref)
        ok &= gap <= spread
        if gap - spread > worst[0] - worst[1] or step == steps[0]:
            worst = (gap, spread, step)
    return ok, *worst


def main(argv=None) -> int:
    from benchmarks.roofline import Table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--residuals", nargs="+", default=["attnres_block", "msar_block", "mhc"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--set", nargs="*", default=["model=small", "trainer=gpu"],
                   help="config overrides of every run (default: model=small trainer=gpu)")
    p.add_argument("--name", default=None, help="results file suffix (default: the model preset)")
    p.add_argument("--reference", nargs="+", default=["residual.backend=torch"],
                   help="the reference arm's overrides (its seeds give the spread)")
    p.add_argument("--candidate", nargs="+", default=["residual.backend=triton"],
                   help="the arm held to the reference's spread")
    a = p.parse_args(argv)
    if len(a.seeds) < 2:
        raise SystemExit(f"error: --seeds={a.seeds}: the spread needs at least two seeds; valid: two or more")
    model = next((o.split("=", 1)[1] for o in a.set if o.startswith("model=")), "default")
    backends = a.reference == ["residual.backend=torch"] and a.candidate == ["residual.backend=triton"]
    ref_name, cand_name = ("reference", "fused") if backends else (" ".join(a.reference), " ".join(a.candidate))
    title = ("Training with the fused op vs the reference" if backends else
             f"Training with {cand_name} vs {ref_name}") + f" ({model}, {a.steps} steps, seeds {a.seeds})"
    table = Table(title, ["residual", f"final loss, {ref_name} (per seed)", f"final loss, {cand_name} (per seed)",
                          "worst |Δ mean| (step)", f"{'reference' if backends else ref_name} spread + 1% there",
                          "verdict"],
                  notes=[f"overrides: {' '.join(a.set)}", "loss: training loss of each optimizer step, same batches "
                         "for both arms of a seed"])
    failures = 0
    for residual in a.residuals:
        try:
            reference = [run(residual, a.reference, s, a.steps, a.set) for s in a.seeds]
            fused = [run(residual, a.candidate, s, a.steps, a.set) for s in a.seeds]
        except Exception as e:  # noqa: BLE001 - reported in its row; the other residuals still run
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            table.add(residual, "-", "-", "-", "-", f"FAILED ({error})")
            failures += 1
            print(f"{residual}: FAILED ({error})", flush=True)
        else:
            ok, gap, spread, step = verdict(reference, fused)
            last = max(reference[0])
            table.add(residual, ", ".join(f"{r[last]:.4f}" for r in reference),
                      ", ".join(f"{f[last]:.4f}" for f in fused), f"{gap:.4f} (step {step})", f"{spread:.4f}",
                      "ok" if ok else "OUTSIDE THE SPREAD")
            failures += not ok
            print(f"{residual}: {'ok' if ok else 'OUTSIDE THE SPREAD'} (worst gap {gap:.4f} at step {step}, "
                  f"allowed {spread:.4f})", flush=True)
        table.write(f"backend_training_{a.name or model}")  # after every residual: nothing measured is lost
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
