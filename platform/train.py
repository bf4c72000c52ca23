"""`train(cfg)`: the one training function behind `platform.run`, sweeps and comparisons.

:func:`preflight` checks everything that can be wrong before any compute or MLflow run (the config,
this machine, the checkpoint to resume, the configured callbacks); then `train` builds data, model
and trainer, logs to MLflow, checkpoints into the run dir, resumes exactly
(`resume=<ckpt|run dir|last>`), and always closes its MLflow run as FINISHED, FAILED or KILLED.
See docs/running.md.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from . import plots, tracking
from .accounting import run_params
from .config import check_environment, residual_config, validate
from .env import REPO_ROOT
from .errors import ConfigError

log = logging.getLogger(__name__)
RESUME_OVERRIDABLE = ("trainer.max_steps", "trainer.progress_bar", "trainer.val_every", "trainer.ckpt_every")


@dataclass
class RunResult:
    val_loss: float
    train_loss: float
    steps: int
    run_dir: Path
    mlflow_run_id: str | None
    wall_s: float
    metrics: dict = field(default_factory=dict)


RESUME_VALID = "a run dir, its checkpoints/last.ckpt, or 'last' (the newest run under outputs/)"


def find_checkpoint(resume: str) -> Path:
    """`last` -> newest last.ckpt under outputs/; a run dir -> its checkpoints/last.ckpt; a file -> itself."""
    if resume == "last":
        found = sorted((REPO_ROOT / "outputs").glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError("resume", "last", f"no checkpoints/last.ckpt under {REPO_ROOT / 'outputs'}", RESUME_VALID)
        return found[-1]
    p = Path(resume).expanduser()
    if p.is_dir():
        p = p / "checkpoints" / "last.ckpt"
    if not p.is_file():
        raise ConfigError("resume", resume, f"no checkpoint at {p}", RESUME_VALID)
    return p.resolve()


def check_checkpoint(ckpt: Path) -> int:
    """Open the checkpoint the way Lightning will (tensors and plain types only); return its step.

    A truncated or foreign file fails here, naming the path, before any MLflow run is touched."""
    import pickle
    import zipfile

    if not zipfile.is_zipfile(ckpt):  # torch.save writes a zip archive; its index is at the end
        raise ConfigError("resume", ckpt, "truncated or not a checkpoint (not a complete zip archive)", RESUME_VALID)
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise ConfigError("resume", ckpt, "holds objects other than tensors and plain types: not written by "
                          "platform.run", RESUME_VALID) from e
    except Exception as e:  # noqa: BLE001 - a damaged archive: torch raises zip, OS and runtime errors alike
        raise ConfigError("resume", ckpt, f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:80]})",
                          RESUME_VALID) from e
    if not isinstance(state, dict) or "state_dict" not in state or "global_step" not in state:
        raise ConfigError("resume", ckpt, "not a Lightning checkpoint (no state_dict / global_step)", RESUME_VALID)
    return int(state["global_step"])


def build_callbacks(cfg: DictConfig) -> list:
    """The `callbacks:` config list: Hydra `_target_` nodes, each a Lightning Callback (docs/running.md)."""
    from hydra.utils import instantiate

    built = []
    for i, node in enumerate(cfg.get("callbacks") or []):
        key = f"callbacks[{i}]"
        target = node.get("_target_") if hasattr(node, "get") else None
        if not target:
            raise ConfigError(key, node, "needs a _target_ (the callback's import path)",
                              "{_target_: lightning.pytorch.callbacks.LearningRateMonitor, ...}")
        try:
            cb = instantiate(node)
        except Exception as e:  # noqa: BLE001 - an import or argument error of the user's callback
            cause = e.__cause__ or e
            raise ConfigError(f"{key}._target_", target, f"cannot be built: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}",
                              "an importable Lightning Callback class with valid arguments") from e
        if not isinstance(cb, L.Callback):
            raise ConfigError(f"{key}._target_", target, f"built a {type(cb).__name__}, not a Lightning Callback",
                              "a subclass of lightning.pytorch.Callback")
        built.append(cb)
    return built


def preflight(cfg: DictConfig, cli_overrides: list[str] | None = None) -> tuple[DictConfig, Path | None]:
    """Everything that can be wrong, checked before any compute: the checkpoint to resume and its saved
    config, the whole config, this machine. Returns the config to run and the checkpoint (or None).
    Raises ConfigError; touches no MLflow run."""
    ckpt_path = None
    if cfg.resume:
        ckpt_path = find_checkpoint(cfg.resume)
        check_checkpoint(ckpt_path)
        cfg = _resume_config(cfg, ckpt_path, cli_overrides)
    validate(cfg)
    check_environment(cfg)
    return cfg, ckpt_path


def _resume_config(cfg: DictConfig, ckpt: Path, cli_overrides: list[str] | None) -> DictConfig:
    """The saved config of the run being resumed, plus the few overrides a resume may change."""
    import yaml

    saved_path = ckpt.parent.parent / "config.yaml"
    if not saved_path.is_file():
        raise ConfigError("resume", ckpt, f"the run's resolved config {saved_path} is missing", RESUME_VALID)
    saved = OmegaConf.load(saved_path)
    if "val_batches" in saved.get("data", {}):  # saved before data.val_batches became data.val_windows
        old = saved.data.pop("val_batches")
        saved.data.val_windows = None if old is None else old * saved.data.batch_size
    if cli_overrides is None:  # programmatic call: the given config must describe the same run
        now = OmegaConf.to_container(cfg, resolve=True)
        before = OmegaConf.to_container(saved, resolve=True)
        for key in ("model", "residual", "data", "seed"):
            if before[key] != now[key]:
                raise ConfigError("resume", ckpt, f"config.{key} differs from the saved run's",
                                  "the same model, residual, data and seed as the run being resumed")
        merged = cfg.copy()
    else:
        merged = saved
        for ov in cli_overrides:
            key, _, value = ov.partition("=")
            if key in ("resume", "+resume") or key.startswith("hydra."):
                continue
            if key not in RESUME_OVERRIDABLE:
                raise ConfigError(key, value, "cannot be changed when resuming a run", RESUME_OVERRIDABLE)
            OmegaConf.update(merged, key, yaml.safe_load(value))
    merged.resume = str(ckpt)
    return merged


def _run_dir(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    d = REPO_ROOT / "outputs" / "runs" / time.strftime("%Y-%m-%d/%H-%M-%S") / f"{cfg.residual.name}_{time.time_ns() % 10**6}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def run_name(cfg: DictConfig) -> str:
    if cfg.mlflow.run_name:
        return cfg.mlflow.run_name
    name = cfg.name or (cfg.ablation.name if cfg.ablation else cfg.residual.name)
    return f"{name}-{cfg.model.name}-s{cfg.seed}"


class StepProgressBar:
    """Built lazily (Rich is imported with Lightning): a step-based run's bar reads "step N of M"."""

    @staticmethod
    def make():
        from lightning.pytorch.callbacks import RichProgressBar

        class _Bar(RichProgressBar):
            def _get_train_description(self, current_epoch: int) -> str:
                return f"train ({self.trainer.max_steps} steps)"

            def get_metrics(self, trainer, pl_module):
                items = super().get_metrics(trainer, pl_module)
                items.pop("v_num", None)  # the logger's run id tail means nothing here
                return items

        return _Bar()


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip")


def _bf16_all_reduce(process_group, bucket):
    """A DDP communication hook: the bucket's gradients averaged in bf16 (half the bytes of fp32), then
    written back in the bucket's dtype. PyTorch's own ``bf16_compress_hook`` does the same but refuses
    any backend other than NCCL, so the CPU tests (gloo) could not run it."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def write_back(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(write_back)


def ddp_comm_hook(name: str):
    """The DDP communication hook of ``trainer.ddp_comm``: None for fp32 (DDP's own all-reduce of the
    fp32 gradients), ``_bf16_all_reduce`` for bf16 (half the bytes, a relative rounding of 2^-8 on
    the averaged gradient)."""
    return {"fp32": None, "bf16": _bf16_all_reduce}[name]


def trainer_strategy(t) -> object:
    """Lightning's strategy: "auto" for one process; for several, DDP, with the communication hook of
    ``trainer.ddp_comm`` when one is asked for, or with ``trainer.grad_sync=flat`` (and ``auto`` with CUDA
    graphs) the gradients averaged after the backward in one all-reduce (`platform.parallel.FlatSyncDDP`)."""
    if t.devices * t.num_nodes == 1:
        return "auto"
    from platform.parallel import FlatSyncDDP, resolve

    if resolve(t.grad_sync, t.cuda_graphs) == "flat":  # two H200s at `small`, graphed: 0.850 -> 0.907 scaling
        return FlatSyncDDP(comm=t.ddp_comm)
    hook = ddp_comm_hook(t.ddp_comm)
    if hook is None:
        return "auto"
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(ddp_comm_hook=hook)


def quiet_lightning() -> None:
    """Print each Lightning INFO line once and drop its advertisements and a known FutureWarning.

    Lightning adds its own console handler when it is imported before logging is set up; under
    Hydra (whose handlers are on the root logger) that prints every line twice."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="lightning.pytorch.utilities._pytree")
    root = logging.getLogger()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lg = logging.getLogger(name)
        if root.handlers:
            for h in list(lg.handlers):
                lg.removeHandler(h)
            lg.propagate = True
        for h in lg.handlers:
            h.addFilter(_DropTips())
    for h in root.handlers:
        if not any(isinstance(f, _DropTips) for f in h.filters):
            h.addFilter(_DropTips())


def train(cfg: DictConfig, *, callbacks: list | None = None, parent_run_id: str | None = None,
          run_dir: Path | None = None, cli_overrides: list[str] | None = None,
          extra_tags: dict | None = None) -> RunResult:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from data import CorpusDataModule

    from .module import LMModule

    cfg, ckpt_path = preflight(cfg, cli_overrides)  # everything that can be wrong fails here, before compute
    config_callbacks = build_callbacks(cfg)
    if ckpt_path:
        run_dir = ckpt_path.parent.parent
    quiet_lightning()
    run_dir = Path(run_dir) if run_dir else _run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not ckpt_path:
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    dm = CorpusDataModule(cfg.data, seq_len=cfg.model.seq_len, seed=cfg.seed, max_steps=cfg.trainer.max_steps)
    dm.prepare_data()
    dm.setup("fit")
    if len(dm.val_set) == 0:
        raise ConfigError("model.seq_len", cfg.model.seq_len,
                          f"the validation split ({len(dm.prepared.val)} tokens) holds no window of seq_len + 1 "
                          "tokens (its documents are too short)",
                          "a shorter model.seq_len, longer documents, or a larger data.val_fraction")
    module = LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=dm.vocab_size)

    ckpt_cb = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step:06d}", auto_insert_metric_name=False,
                              every_n_train_steps=cfg.trainer.ckpt_every, save_last=True, save_top_k=1)
    cbs = [ckpt_cb, *config_callbacks, *(callbacks or [])]
    if cfg.trainer.progress_bar:
        cbs.append(StepProgressBar.make())

    logger = None
    from lightning.pytorch.utilities import rank_zero_only

    if cfg.mlflow.enabled and rank_zero_only.rank == 0:  # other DDP ranks (started by Lightning) log nothing
        client, uri, exp_id = tracking.open_experiment(cfg)
        run_id_file = run_dir / "mlflow_run_id"
        run_id = run_id_file.read_text().strip() if (ckpt_path and run_id_file.is_file()) else None
        tags = {**tracking.run_tags(parent_run_id), **(extra_tags or {}),
                "residual": cfg.residual.name, "ablation": cfg.ablation.name if cfg.ablation else "none",
                "model": cfg.model.name, "run_dir": str(run_dir)}
        logged = logged_steps(client, run_id) if run_id is not None else None
        logger = tracking.make_logger(experiment_name=cfg.mlflow.experiment, run_name=run_name(cfg), tracking_uri=uri,
                                      tags=tags if run_id is None else None, run_id=run_id, log_model=False)
        if logged:  # resumed: steps the killed process already logged are not logged a second time
            logger.logged_steps = logged
        if run_id is not None:  # resumed: the same MLflow run goes on
            client.update_run(run_id, status="RUNNING")
            for k, v in tracking.run_tags(parent_run_id).items():
                client.set_tag(run_id, k, v)
            if client.get_run(run_id).data.tags.get(tracking.NOTE_TAG) == tracking.REAPED_NOTE:
                client.delete_tag(run_id, tracking.NOTE_TAG)
        run_id_file.write_text(logger.run_id)
        if run_id is None:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
            logger.log_hyperparams(run_params(module.model, cfg.model, module.model.head.out_features))

    t = cfg.trainer
    start = time.perf_counter()
    status = "FINISHED"
    try:
        trainer = L.Trainer(
            accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, precision=t.precision,
            strategy=trainer_strategy(t),
            max_steps=t.max_steps,
            gradient_clip_val=t.grad_clip, accumulate_grad_batches=t.accumulate_grad_batches,
            val_check_interval=t.val_every * t.accumulate_grad_batches, check_val_every_n_epoch=None,
            limit_val_batches=t.val_batches, log_every_n_steps=t.log_every, num_sanity_val_steps=0,
            logger=logger if logger is not None else False, callbacks=cbs, default_root_dir=run_dir,
            enable_progress_bar=t.progress_bar, enable_model_summary=False, benchmark=False)
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None)
        if trainer.global_step != module.last_val_step:
            if logger is not None:  # a validation after fit is logged at the step it measures, not one later
                logger.step_offset = 0
            trainer.validate(module, datamodule=dm, verbose=False)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        result = RunResult(val_loss=metrics.get("val/loss", float("nan")), train_loss=module.last_train_loss,
                           steps=trainer.global_step, run_dir=run_dir, wall_s=time.perf_counter() - start,
                           mlflow_run_id=logger.run_id if logger else None, metrics=metrics)
        if logger is not None:
            _log_end_of_run(logger, cfg, module, dm, run_dir, result, device=trainer.strategy.root_device)
        return result
    except (KeyboardInterrupt, SystemExit) as e:
        status = "KILLED"
        if isinstance(e, SystemExit) and not e.code:  # Lightning's SIGTERM exit carries no code
            raise SystemExit(128 + signal.SIGTERM) from e
        raise
    except BaseException as e:
        status = "FAILED"
        if _is_pruned(e):  # stopped on purpose by a sweep's pruner: not a failure
            status = "KILLED"
            if logger is not None and logger._initialized:
                logger.experiment.set_tag(logger.run_id, "pruned", "true")
        raise
    finally:
        if logger is not None and logger._initialized:
            logger.experiment.set_terminated(logger.run_id, status)


def logged_steps(client, run_id: str) -> dict[str, int]:
    """The last step logged for each metric of a run (what a resumed run must not log again)."""
    run = client.get_run(run_id)
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}


def _is_pruned(e: BaseException) -> bool:
    """An `optuna.TrialPruned` raised by a sweep's pruning callback (optuna is only imported by sweeps)."""
    optuna = sys.modules.get("optuna")
    return optuna is not None and isinstance(e, optuna.TrialPruned)


def _log_end_of_run(logger, cfg, module, dm, run_dir: Path, result: RunResult, *, device: torch.device) -> None:
    client, run_id = logger.experiment, logger.run_id
    client.log_metric(run_id, "final/val_loss", result.val_loss, step=result.steps)
    client.log_metric(run_id, "final/wall_s", result.wall_s, step=result.steps)
    hydra_dir = run_dir / ".hydra"
    if hydra_dir.is_dir():
        client.log_artifacts(run_id, str(hydra_dir), artifact_path="hydra")
    client.log_artifact(run_id, str(run_dir / "config.yaml"), artifact_path="hydra")
    plot = plots.plot_loss_curves(client, run_id, run_dir / "loss_curve.png",
                                  title=f"loss: {run_name(cfg)} ({result.steps} steps)")
    if plot:
        client.log_artifact(run_id, str(plot), artifact_path="plots")
    if cfg.mlflow.depth_heatmaps:
        recorded = record_depth_weights(module, dm, device)
        if recorded:
            residual = _residual_of(module)
            kind = "depth attention" if hasattr(residual, "n_sources") else "residual coefficients"
            heat = plots.plot_depth_weights(recorded, run_dir / "depth_attention.png", f"{kind}: {run_name(cfg)}",
                                            residual=residual)
            client.log_artifact(run_id, str(heat), artifact_path="plots")
            (run_dir / "depth_attention.json").write_text(
                json.dumps({k: v.tolist() for k, v in recorded.items()}))
            client.log_artifact(run_id, str(run_dir / "depth_attention.json"), artifact_path="plots")


@torch.no_grad()
def record_depth_weights(module, dm, device: torch.device | str = "cpu") -> dict:
    """Run one validation batch with recording on, on ``device`` (where the run trained: Lightning
    moves the module to the CPU after fit, and a fused backend such as ``residual.backend=triton``
    runs on CUDA only); return the mechanism's depth-attention weights, on the CPU."""
    batch = next(iter(dm.val_dataloader()), None)
    if batch is None:  # preflight rejects an empty validation split; a caller's own dm may still be empty
        return {}
    home = module.device
    module.to(device).eval()
    try:
        res = _residual_of(module)
        res.recorded = {}
        tokens, doc_ids = batch["tokens"].to(module.device), batch["doc_ids"].to(module.device)
        module(tokens[:, :-1], doc_ids[:, :-1], record=True)
        return {k: v.cpu() for k, v in res.recorded.items()}
    finally:
        module.to(home)


def _residual_of(module):
    return module.model.residual if hasattr(module.model, "residual") else module.model._orig_mod.residual
