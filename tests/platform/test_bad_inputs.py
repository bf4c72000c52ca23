"""Every bad input: one line `error: <key>=<value>: <why>; valid: <...>`, a non-zero exit, nothing run.

A table, one row per bad input a user can give (add a row with every new key). Each row runs the
command line's `main(argv)` in-process (SystemExit caught); a few rows also run as a subprocess to
prove the real CLI. For every row: exit code != 0, exactly one `error:` line, no traceback, no MLflow
run created or left RUNNING, and an earlier run (where the row sets one up) left as it was.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlflow
import pytest
import torch

from platform.errors import BAD_INPUT_EXIT, RUN_FAILED_EXIT
from tests.helpers import ROOT, make_cfg

HAS_CUDA = torch.cuda.is_available()
ONE_LINE = re.compile(r"^error: \S+=.*: .+")  # error: <key>=<value>: <why>[; valid: <...>]


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: str  # a regex the error line must match (after "error: ")
    setup: Callable[[Path], list[str]] | None = None  # writes files under tmp_path, returns extra argv
    env: dict[str, str | None] = field(default_factory=dict)
    code: int = BAD_INPUT_EXIT
    strict: bool = True  # no other output at all (rows that read data may print progress)
    valid: bool = True  # the line names the valid values ("; valid: ")
    skip: bool = False


def earlier_run(tmp_path: Path, ckpt_bytes: bytes) -> list[str]:
    """A FINISHED run with a run dir whose last.ckpt holds `ckpt_bytes`; returns the resume argv."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("residuals")
    run_id = client.create_run(exp).info.run_id
    client.set_terminated(run_id, "FINISHED")
    run_dir = tmp_path / "earlier"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(ckpt_bytes)
    (run_dir / "mlflow_run_id").write_text(run_id)
    from omegaconf import OmegaConf

    OmegaConf.save(make_cfg(), run_dir / "config.yaml", resolve=True)
    return [f"resume={run_dir}"]


def truncated_checkpoint(tmp_path: Path) -> list[str]:
    import io

    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(64, 64)}, "global_step": 8}, buf)
    return earlier_run(tmp_path, buf.getvalue()[: len(buf.getvalue()) // 2])


def garbage_checkpoint(tmp_path: Path) -> list[str]:
    import io
    import pickle

    buf = io.BytesIO()
    torch.save({"state_dict": {}, "global_step": 1, "obj": Path("x")}, buf)  # a pickled class: not weights-only
    data = buf.getvalue()
    return earlier_run(tmp_path, data if len(data) > 100 else pickle.dumps(object))


def short_documents(tmp_path: Path) -> list[str]:
    """A files corpus of many short documents: training packs into windows, validation gets none."""
    docs = tmp_path / "docs"
    docs.mkdir()
    words = "the quick brown fox jumps over the lazy dog and runs far away".split()
    for i in range(60):
        (docs / f"{i:03d}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(8)) + f" {i}")
    return ["data.source=files", f"data.path={docs}/*.txt", "data.vocab_size=300", f"data.cache_dir={tmp_path}/cache"]


def binary_file(tmp_path: Path) -> list[str]:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("fine text " * 50)
    (docs / "b.txt").write_bytes(bytes(range(256)) * 4)
    return ["data.source=files", f"data.path={docs}/*.txt", f"data.cache_dir={tmp_path}/cache"]


CASES = [
    # --- composition: keys, types, presets, names -------------------------------------------------
    Case("misspelt-key", ["model.d_modle=64"], r"model.d_modle=64: no such key; valid: \[.*d_model"),
    Case("wrong-type", ["trainer.max_steps=abc"], r"trainer.max_steps=abc: not a valid integer"),
    Case("unknown-model", ["model=huge"], r"model=huge: no such model preset; valid: \[medium, scale_m, scale_s, scale_xs, small, tiny\]"),
    Case("unknown-debug", ["debug=slow"], r"debug=slow: .*valid: \[fast, smoke\]"),
    Case("unknown-residual", ["residual=nope"], r"residual=nope: no such residual; valid: \[.*vanilla"),
    Case("unknown-ablation", ["ablation=nope"], r"ablation=nope: no such ablation; valid: "),
    Case("renamed-residual-kernel", ["residual.kernel=triton"], r"residual.kernel=triton: renamed to residual.backend"),
    Case("renamed-data-val-batches", ["data.val_batches=2"], r"data.val_batches=2: renamed to data.val_windows"),
    Case("sweep-group", ["sweep=msar_kernels"], r"sweep=msar_kernels: .*python -m platform.sweep"),
    # --- model --------------------------------------------------------------------------------------
    Case("n-heads-not-dividing", ["model.n_heads=3"], r"model.n_heads=3: does not divide model.d_model=64; "
                                                      r"valid: \[2, 4, 8, 16, 32\]"),
    Case("n-heads-not-gqa", ["model.d_model=96", "model.n_heads=5", "model.moe_impl=sliced"],
         r"model.n_heads=5: .*valid: \[2, 4, 6, 8, 12, 16, 24, 48\]"),
    Case("n-kv-heads", ["model.n_kv_heads=3"], r"model.n_kv_heads=3: must divide model.n_heads=4 \(GQA\); valid: \[1, 2, 4\]"),
    Case("top-k", ["model.top_k=99"], r"model.top_k=99: must be between 1 and model.n_experts=8; valid: 1..8"),
    Case("moe-impl", ["model.moe_impl=loop"], r"model.moe_impl=loop: not a known choice; valid: \[grouped_mm, sliced\]"),
    Case("grouped-mm-alignment", ["model.expert_hidden=60"], r"model.expert_hidden=60: .*multiple of 8"),
    Case("d-model-zero", ["model.d_model=0"], r"model.d_model=0: must be a positive integer"),
    # --- trainer --------------------------------------------------------------------------------------
    Case("accelerator-gpu-on-cpu", ["trainer.accelerator=gpu"], r"trainer.accelerator=gpu: no CUDA device",
         skip=HAS_CUDA),
    Case("accelerator-tpu", ["trainer.accelerator=tpu"], r"trainer.accelerator=tpu: not a known choice"),
    Case("devices-zero", ["trainer.devices=0"], r"trainer.devices=0: must be a positive integer; valid: >= 1"),
    Case("precision", ["trainer.precision=fp8"], r"trainer.precision=fp8: not a known choice; valid: \[32-true"),
    Case("fp16-on-cpu", ["trainer.precision=16-mixed"], r"trainer.precision=16-mixed: .*needs a GPU", skip=HAS_CUDA),
    Case("cuda-graphs-on-cpu", ["trainer.cuda_graphs=true"],
         r"trainer.cuda_graphs=True: CUDA graphs need a GPU, and trainer.accelerator=cpu; valid: false on a CPU"),
    Case("cuda-graphs-sliced-moe", ["trainer.cuda_graphs=true", "trainer.accelerator=auto", "model.moe_impl=sliced"],
         r"trainer.cuda_graphs=True: model.moe_impl=sliced reads the expert group sizes back to the host"),
    Case("cuda-graphs-fp32", ["trainer.cuda_graphs=true", "trainer.accelerator=auto"],
         r"trainer.cuda_graphs=True: trainer.precision=32-true: the grouped GEMM outside bf16 copies"),
    Case("compile-grouped-mm-fp32", ["trainer.compile=true"],
         r"trainer.compile=True: trainer.precision=32-true: torch.compile traces the grouped GEMM "
         r"\(model.moe_impl=grouped_mm\) in bf16 only; valid: false, trainer.precision=bf16-mixed / bf16-true, or "
         r"model.moe_impl=sliced"),
    Case("ddp-comm", ["trainer.ddp_comm=fp8"], r"trainer.ddp_comm=fp8: not a known choice; valid: \[fp32, bf16\]"),
    Case("grad-sync", ["trainer.grad_sync=nccl"], r"trainer.grad_sync=nccl: not a known choice; valid: \[auto, ddp, flat\]"),
    Case("flex-fwd-length", ["model.flex_fwd=[64,64,4]"],
         r"model.flex_fwd=\[64, 64, 4\]: needs 4 values; valid: \[\] \(PyTorch's tiles\) or \[BLOCK_M, BLOCK_N, num_warps, num_stages\]"),
    Case("flex-bwd-block", ["model.flex_bwd=[32,64,64,48,4,3]"],
         r"model.flex_bwd=\[32, 64, 64, 48, 4, 3\]: BLOCK_N2=48 is not valid; valid: BLOCK_N2 in 16, 32, 64 or 128"),
    Case("compile-scope", ["trainer.compile_scope=layers"],
         r"trainer.compile_scope=layers: not a known choice; valid: \[sublayers, model\]"),
    Case("compile-options", ["+trainer.compile_options.combo_kernel=true"],
         r"trainer.compile_options.combo_kernel=True: not an Inductor setting; valid: .*combo_kernels"),
    Case("weight-decay", ["trainer.weight_decay=-1"], r"trainer.weight_decay=-1.0: must be >= 0"),
    Case("grad-clip", ["trainer.grad_clip=-1"], r"trainer.grad_clip=-1.0: must be >= 0"),
    Case("threads", ["trainer.threads=-1"], r"trainer.threads=-1: must be >= 0"),
    Case("lr-inf", ["trainer.lr=inf"], r"trainer.lr=inf: must be a finite number"),
    Case("lr-nan", ["trainer.lr=nan"], r"trainer.lr=nan: must be a finite number"),
    Case("lr-zero", ["trainer.lr=0"], r"trainer.lr=0.0: must be > 0"),
    Case("beta1", ["trainer.beta1=1.5"], r"trainer.beta1=1.5: an Adam beta must lie in \[0, 1\); valid: \[0, 1\)"),
    Case("beta2", ["trainer.beta2=-0.1"], r"trainer.beta2=-0.1: an Adam beta"),
    Case("min-lr-ratio", ["trainer.min_lr_ratio=2"], r"trainer.min_lr_ratio=2.0: must lie in \[0, 1\]"),
    Case("warmup", ["trainer.warmup_steps=-1"], r"trainer.warmup_steps=-1: must be >= 0"),
    Case("max-steps", ["trainer.max_steps=0"], r"trainer.max_steps=0: must be a positive integer"),
    Case("val-batches", ["trainer.val_batches=0"], r"trainer.val_batches=0: must be a positive integer"),
    Case("seed", ["seed=-1"], r"seed=-1: must be a non-negative 32-bit integer; valid: 0\.\.4294967295"),
    # --- residual -------------------------------------------------------------------------------------
    Case("triton-on-cpu", ["residual.backend=triton"], r"residual.backend=triton: the Triton kernels need a CUDA device",
         env={"TRITON_INTERPRET": None}, skip=HAS_CUDA),
    Case("residual-field", ["residual=mhc", "residual.n=0"], r"residual.n=0 must be an integer >= 1", valid=False),
    Case("recompute-streams-reference", ["residual=msar_block", "residual.backend=torch",
                                         "residual.recompute_streams=true"],
         r"residual.recompute_streams=true: applies only to the fused read .*got backend='torch'", valid=False),
    Case("mhc-recompute-every", ["residual=mhc", "residual.recompute_every=-2"],
         r"residual.recompute_every=-2 must be an integer >= 0 \(0 keeps every sublayer's streams", valid=False),
    Case("mhc-recompute-reference", ["residual=mhc", "residual.backend=torch", "residual.recompute_every=3"],
         r"residual.recompute_every=3: applies only to the fused writes .*got backend='torch'", valid=False),
    Case("source-dtype", ["residual=attnres_block", "residual.source_dtype=fp16"],
         r"residual.source_dtype='fp16' is not valid for residual=attnres_block; choose one of: stream, bfloat16, autocast",
         valid=False),
    Case("source-dtype-msar", ["residual=msar_block", "residual.source_dtype=bf16"],
         r"residual.source_dtype='bf16' is not valid for residual=msar_block; choose one of: stream, bfloat16, autocast",
         valid=False),
    Case("merge-backend", ["residual=attnres_block", "residual.merge_backend=cuda"],
         r"residual.merge_backend='cuda' is not valid for residual=attnres_block; choose one of: auto, torch, triton",
         valid=False),
    # --- data -------------------------------------------------------------------------------------------
    Case("data-source", ["data.source=web"], r"data.source='web': not a known source; valid: embedded, files, hub"),
    Case("vocab-size", ["data.vocab_size=10"], r"data.vocab_size=10: is too small.*; valid: >= 259"),
    Case("val-windows", ["data.val_windows=0"], r"data.val_windows=0: must be positive; valid: None \(all\)"),
    Case("files-without-path", ["data.source=files"], r"data.path=None: data.source='files' needs data.path; valid: "),
    Case("batch-size", ["data.batch_size=0"], r"data.batch_size=0: must be positive; valid: an integer >= 1"),
    Case("short-documents", [], r"model.seq_len=128: the validation split .* holds no window",
         setup=short_documents, strict=False),
    Case("short-documents-heatmaps", ["mlflow.depth_heatmaps=true"], r"model.seq_len=128: the validation split",
         setup=short_documents, strict=False),
    Case("binary-corpus-file", [], r"data.path=.*b.txt is not UTF-8 text", setup=binary_file, strict=False),
    # --- MLflow -----------------------------------------------------------------------------------------
    Case("tracking-uri-scheme", ["mlflow.tracking_uri=foo://bar"], r"mlflow.tracking_uri=foo://bar: unknown scheme"),
    Case("tracking-uri-no-scheme", ["mlflow.tracking_uri=mlruns/db"], r"mlflow.tracking_uri=mlruns/db: no scheme"),
    Case("tracking-uri-sqlite", ["mlflow.tracking_uri=sqlite:/x.db"], r"mlflow.tracking_uri=sqlite:/x.db: a SQLite URL"),
    Case("tracking-uri-no-host", ["mlflow.tracking_uri=http://"], r"mlflow.tracking_uri=http://: no host"),
    # --- resume -----------------------------------------------------------------------------------------
    Case("resume-missing", ["resume=/nonexistent/run"], r"resume=/nonexistent/run: no checkpoint at"),
    Case("resume-truncated", [], r"resume=.*earlier/checkpoints/last.ckpt: truncated or not a checkpoint",
         setup=truncated_checkpoint),
    Case("resume-garbage", [], r"resume=.*earlier/checkpoints/last.ckpt: holds objects other than tensors",
         setup=garbage_checkpoint),
    # --- callbacks from config ---------------------------------------------------------------------------
    Case("callback-no-target", ["callbacks=[{step:3}]"], r"callbacks\[0\]=.*: needs a _target_"),
    Case("callback-import", ["callbacks=[{_target_:no.such.Callback}]"],
         r"callbacks\[0\]._target_=no.such.Callback: cannot be built"),
    Case("callback-not-a-callback", ["callbacks=[{_target_:collections.OrderedDict}]"],
         r"callbacks\[0\]._target_=collections.OrderedDict: built a OrderedDict, not a Lightning Callback"),
    # --- a run that fails: one line, exit 1, its MLflow run FAILED -----------------------------------------
    Case("nan-loss", ["debug=fast", "trainer.max_steps=8", "callbacks=[{_target_:tests.platform.callbacks.PoisonBefore,step:3}]"],
         r"NonFiniteLossError: loss is nan at step 3; stopping. Last good checkpoint: none yet",
         code=RUN_FAILED_EXIT, strict=False, valid=False),
]
SUBPROCESS = {"misspelt-key", "resume-truncated"}  # the real CLI; nan-loss runs in-process through Hydra too


def run_main(argv: list[str], capfd) -> tuple[int, str]:
    from platform.run import main

    capfd.readouterr()  # only what main prints
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capfd.readouterr()
    return code, out.out + out.err


def check_output(case: Case, code: int, output: str) -> None:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert code == case.code, (code, output)
    assert len(errors) == 1, output
    assert "Traceback" not in output and "weights_only=False" not in output, output
    if case.strict:
        assert lines == errors, output
    assert re.search(case.expect, errors[0]), errors[0]
    if case.code == BAD_INPUT_EXIT and case.valid:
        assert ONE_LINE.match(errors[0]) and "; valid: " in errors[0], errors[0]


def mlflow_runs(tmp_path: Path) -> dict[str, str]:
    db = tmp_path / "mlflow.db"
    if not db.exists():
        return {}
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    return {r.info.run_id: r.info.status for exp in client.search_experiments()
            for r in client.search_runs([exp.experiment_id])}


def prepare(case: Case, tmp_path: Path, monkeypatch) -> list[str]:
    if case.skip:
        pytest.skip("needs a machine without CUDA")
    for k, v in case.env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    extra = case.setup(tmp_path) if case.setup else []
    uri = [] if any(a.startswith("mlflow.tracking_uri=") for a in case.argv) else [
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    return [*case.argv, *extra, *uri, "trainer.progress_bar=false", f"hydra.run.dir={tmp_path}/run"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_in_process(case, tmp_path, monkeypatch, capfd):
    argv = prepare(case, tmp_path, monkeypatch)
    before = mlflow_runs(tmp_path)
    code, output = run_main(argv, capfd)
    check_output(case, code, output)
    after = mlflow_runs(tmp_path)
    assert "RUNNING" not in after.values(), after
    for run_id, status in before.items():  # an earlier run is left as it was
        assert after[run_id] == status, (run_id, status, after[run_id])
    new = set(after) - set(before)
    if case.code == BAD_INPUT_EXIT:
        assert not new, f"a bad input created MLflow run(s) {new}"
    else:
        assert [after[r] for r in new] == ["FAILED"], after


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS], ids=lambda c: c.id)
def test_bad_input_real_cli(case, tmp_path, monkeypatch):
    argv = prepare(case, tmp_path, monkeypatch)
    out = subprocess.run([sys.executable, "-m", "platform.run", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    check_output(case, out.returncode, out.stdout + out.stderr)
    assert "RUNNING" not in mlflow_runs(tmp_path).values()


def test_debug_switch_shows_the_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "platform.run", "trainer.lr=inf", "mlflow.enabled=false"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "RESPLAT_DEBUG": "1"})
    assert out.returncode != 0 and "Traceback" in out.stderr and "trainer.lr=inf" in out.stderr


def test_every_listed_n_heads_really_works():
    from platform.config import validate

    for d_model, n_kv in ((64, 2), (96, 2), (48, 3)):
        cfg = make_cfg(f"model.d_model={d_model}", f"model.n_kv_heads={n_kv}", "model.n_heads=5",
                       "model.moe_impl=sliced")
        with pytest.raises(ValueError) as err:
            validate(cfg)
        listed = [int(h) for h in re.search(r"valid: \[([^\]]*)\]", str(err.value)).group(1).split(", ")]
        assert listed
        for h in listed:
            validate(make_cfg(f"model.d_model={d_model}", f"model.n_kv_heads={n_kv}", f"model.n_heads={h}",
                              "model.moe_impl=sliced"))


SWEEP_CASES = [
    Case("sweep-storage-no-scheme", ["sweep.storage=notaurl"], r"sweep.storage=notaurl: no scheme; valid: sqlite:///"),
    Case("sweep-storage-no-host", ["sweep.storage=postgresql://"], r"sweep.storage=postgresql://: no host"),
    Case("sweep-storage-scheme", ["sweep.storage=http://host/db"], r"sweep.storage=http://host/db: unknown scheme"),
]


@pytest.mark.parametrize("case", SWEEP_CASES, ids=[c.id for c in SWEEP_CASES])
def test_bad_sweep_input(case, tmp_path, capfd):
    from platform.sweep import main as sweep_main

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(SystemExit) as exit_info:
        sweep_main(["sweep=msar_kernels", *case.argv, f"mlflow.tracking_uri={uri}", f"sweep.out_dir={tmp_path}/out"])
    message = str(exit_info.value.code)
    assert "\n" not in message and message.startswith("error: ") and re.search(case.expect, message), message
    assert "; valid: " in message
    assert mlflow_runs(tmp_path) == {} and not (tmp_path / "out").exists()
