#!/usr/bin/env bash
# Check and time everything that needs a GPU, in one go, on a CUDA host without internet access.
#   bash benchmarks/gpu_check.sh [OUTDIR]
# Prepare the host here first with `make gpu-bundle`: wheels the host lacks in .whl/ (installed with
# --no-index into /tmp/site, put on PYTHONPATH) and pre-tokenized shards in .shards/english.
# Every stage logs to OUTDIR/<stage>.txt (default OUTDIR: benchmarks/results/gpu); a failing stage
# does not stop the later ones; a summary (stage, exit code, seconds) ends the output and
# OUTDIR/summary.txt. The exit code is the number of failed stages.
# Knobs (environment):
#   STAGES     stages to run, in order (default: all of "setup doctor gpu_tests kernel_tests train ddp
#              report throughput profile host_sync ops backend_training"); about 30 minutes in all on
#              one H200, so on a host that limits a command to 10 minutes run a few stages per call
#   STEPS      training steps of the short runs (default 100)
#   MODELS     model sizes of the throughput table (default "small medium")
#   RESIDUALS  residuals of the throughput table (default "vanilla attnres_block msar_block mhc msar")
#   ARCHIVE    also pack OUTDIR into this .tar.gz
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-benchmarks/results/gpu}
mkdir -p "$OUTDIR"
: > "$OUTDIR/summary.txt"
touch "$OUTDIR/.started"
STAGES=${STAGES:-setup doctor gpu_tests kernel_tests train ddp report throughput profile host_sync ops backend_training}
STEPS=${STEPS:-100}
MODELS=${MODELS:-small medium}
RESIDUALS=${RESIDUALS:-vanilla attnres_block msar_block mhc msar}
export MLFLOW_DISABLE_TELEMETRY=true HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# NVLink multicast stays off (hosts with partitioned or virtualised GPUs lack it; NCCL fails at init).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
if ls .whl/*.whl >/dev/null 2>&1; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
FAILED=0

# stage NAME CMD...: run CMD, its output to OUTDIR/NAME.txt (last lines to the terminal), record the result.
stage() {
  local name=$1; shift
  case " $STAGES " in *" ${name%%.*} "*) ;; *) return 0 ;; esac
  echo "### $name: $*"
  local t0=$SECONDS
  { echo "# \`$*\` ($(date -u +%FT%TZ))"; "$@"; } > "$OUTDIR/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$OUTDIR/$name.txt"
  printf '%-28s rc=%-3s %5ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >> "$OUTDIR/summary.txt"
  [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
  return 0
}

install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && python3 -m pip check
}

if ls .whl/*.whl >/dev/null 2>&1; then stage setup install_wheels; fi
# The shards of `make gpu-bundle`, else exported here (needs `datasets`/`tokenizers` from the wheels).
SHARDS=.shards/english
if [ ! -f "$SHARDS/manifest.json" ]; then
  SHARDS=/tmp/shards
  stage setup.export python3 -m data.export --out "$SHARDS"
fi
stage doctor python3 -m platform.doctor
stage doctor.nvidia_smi nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
stage gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests
stage kernel_tests python3 -m pytest -q -p no:cacheprovider tests/kernels

TRAIN=(python3 -m platform.run model=small trainer=gpu trainer.max_steps="$STEPS" trainer.val_every=50
       trainer.log_every=10 trainer.progress_bar=false data.source=shards data.path="$SHARDS"
       mlflow.tracking_uri=sqlite:////tmp/mlflow.db mlflow.experiment=gpu_check)
for res in vanilla msar_block; do
  stage train.$res "${TRAIN[@]}" residual=$res
done
# One short 2-GPU run: the same command with trainer.devices=2 (DDP).
if [ "$GPUS" -ge 2 ]; then
  stage ddp.train "${TRAIN[@]}" residual=vanilla trainer.devices=2 mlflow.run_name=vanilla-small-ddp2
fi
report_runs() {
  python3 - <<'PY'
import mlflow
c = mlflow.MlflowClient("sqlite:////tmp/mlflow.db")
exp = c.get_experiment_by_name("gpu_check")
for r in c.search_runs([exp.experiment_id]) if exp else []:
    def med(key):
        v = sorted(m.value for m in c.get_metric_history(r.info.run_id, key))
        return v[len(v) // 2] if v else float("nan")
    mem = [m.value for m in c.get_metric_history(r.info.run_id, "perf/peak_mem_mb")]
    print(f"{r.info.run_name:>28} {r.info.status}: median tokens/s {med('perf/tokens_per_s'):,.0f}, "
          f"MFU {100 * med('perf/mfu'):.1f}% (datasheet {100 * med('perf/mfu_datasheet'):.1f}%), "
          f"peak mem {max(mem or [float('nan')]) / 1024:.2f} GiB, final val {r.data.metrics.get('final/val_loss', float('nan')):.4f}")
PY
}
stage report report_runs

# shellcheck disable=SC2086
# as trainer=gpu trains: the whole forward compiled, forward and backward replayed as CUDA graphs
stage throughput python3 -m benchmarks.throughput --models $MODELS --residuals $RESIDUALS --compile model --graphs on \
  --steps 10 --warmup 3
if [ "$GPUS" -ge 2 ]; then
  # shellcheck disable=SC2086
  stage ddp.scaling python3 -m benchmarks.throughput --models $MODELS --residuals vanilla --compile model --graphs on \
    --steps 10 --warmup 3 --ddp 2
fi
# Where the time goes, per residual (kernels vs host), and the host synchronisations of a step.
# shellcheck disable=SC2086
stage profile python3 -m benchmarks.profile_step --model small --residuals $RESIDUALS --compile model --graphs on
# shellcheck disable=SC2086
stage host_sync python3 -m benchmarks.host_sync --model small --residuals $RESIDUALS
# The fused ops: parity of every gradient first, then time against the reference and the roofline.
stage ops.attnres python3 -m benchmarks.ops_attnres --quick --shapes small medium
stage ops.msar python3 -m benchmarks.msar_attn --shapes small medium --no-compile
stage ops.mhc python3 -m benchmarks.ops_mhc --shapes small medium
# Training with each fused op follows the reference within the seed-to-seed spread (60 steps, 2 seeds).
stage backend_training python3 -m benchmarks.backend_training --residuals attnres_block msar_block mhc --steps 60
find benchmarks/results -maxdepth 1 -name '*.md' -newer "$OUTDIR/.started" -exec cp {} "$OUTDIR/" \;
echo "### summary: $FAILED failed; GPUs: $GPUS" >> "$OUTDIR/summary.txt"
cat "$OUTDIR/summary.txt"
# Everything in one archive when an outer harness collects a fixed number of files.
if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$OUTDIR" .; fi
exit "$FAILED"
