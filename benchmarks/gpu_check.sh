#!/usr/bin/env bash
# Check and time everything that needs a GPU, in one go, on a CUDA host without internet access.
#   bash benchmarks/gpu_check.sh [OUTDIR]
# Missing Python packages may be carried as wheels in .whl/ (see the README, "GPU").
# Writes logs and tables to OUTDIR (default benchmarks/results/gpu) and copies the tables to
# benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-benchmarks/results/gpu}
mkdir -p "$OUTDIR"
export MLFLOW_DISABLE_TELEMETRY=true HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
STEPS=${STEPS:-300}
run() { echo "### $*" | tee -a "$OUTDIR/summary.txt"; "$@" 2>&1 | tee "$OUTDIR/$LOG" | tail -n 25; }

LOG=doctor.txt run python3 -m platform.doctor
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUTDIR/nvidia_smi.txt"
if [ "${TESTS:-1}" = 1 ]; then
  LOG=gpu_tests.txt run python3 -m pytest -q -p no:cacheprovider -m gpu tests
  LOG=kernel_tests.txt run python3 -m pytest -q -p no:cacheprovider tests/kernels
fi
# Export pre-tokenized shards and train from them, as a machine without a package registry would.
LOG=export.txt run python3 -m data.export --out /tmp/shards
for res in vanilla msar_block; do
  LOG=train_${res}.txt run python3 -m platform.run model=small trainer=gpu residual=$res trainer.max_steps=$STEPS \
    trainer.val_every=100 trainer.progress_bar=false data.batch_size=16 data.source=shards data.path=/tmp/shards \
    mlflow.tracking_uri=sqlite:////tmp/mlflow.db
  grep -E "final val/loss" "$OUTDIR/train_${res}.txt" >> "$OUTDIR/summary.txt"
done
python3 - <<'PY' | tee -a "$OUTDIR/summary.txt"
import mlflow
c = mlflow.MlflowClient("sqlite:////tmp/mlflow.db")
for r in c.search_runs([e.experiment_id for e in c.search_experiments()]):
    tps = [m.value for m in c.get_metric_history(r.info.run_id, "perf/tokens_per_s")]
    mem = [m.value for m in c.get_metric_history(r.info.run_id, "perf/peak_mem_mb")]
    print(f"{r.data.tags.get('residual'):>12} {r.info.status}: median tokens/s {sorted(tps)[len(tps)//2]:,.0f}, "
          f"peak mem {max(mem)/1024:.2f} GiB, final val {r.data.metrics.get('final/val_loss'):.4f}")
PY
LOG=throughput.txt run python3 -m benchmarks.throughput --model small --batch 16 --steps 10 --warmup 3
cp benchmarks/results/*.md "$OUTDIR/" 2>/dev/null
cat "$OUTDIR/summary.txt"
# Everything in one archive when an outer harness collects a fixed number of files.
if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$OUTDIR" .; fi
