"""`train(cfg)`: the one training function behind `platform.run`, sweeps and comparisons.

Validates the whole config before any compute, builds data, model and trainer, logs to MLflow,
checkpoints into the run dir, resumes exactly (`resume=<ckpt|run dir|last>`), and always closes
its MLflow run as FINISHED, FAILED or KILLED.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from . import tracking
from .accounting import run_params
from .config import residual_config, validate
from .env import REPO_ROOT

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


def find_checkpoint(resume: str) -> Path:
    """`last` -> newest last.ckpt under outputs/; a run dir -> its checkpoints/last.ckpt; a file -> itself."""
    if resume == "last":
        found = sorted((REPO_ROOT / "outputs").glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"resume=last: no checkpoints/last.ckpt under {REPO_ROOT / 'outputs'}")
        return found[-1]
    p = Path(resume).expanduser()
    if p.is_dir():
        p = p / "checkpoints" / "last.ckpt"
    if not p.is_file():
        raise FileNotFoundError(f"resume={resume!r}: no checkpoint at {p}")
    return p.resolve()


def _resume_config(cfg: DictConfig, ckpt: Path, cli_overrides: list[str] | None) -> DictConfig:
    """The saved config of the run being resumed, plus the few overrides a resume may change."""
    saved_path = ckpt.parent.parent / "config.yaml"
    if not saved_path.is_file():
        raise FileNotFoundError(f"cannot resume: {saved_path} (the run's resolved config) is missing")
    saved = OmegaConf.load(saved_path)
    if cli_overrides is None:  # programmatic call: the given config must describe the same run
        now = OmegaConf.to_container(cfg, resolve=True)
        before = OmegaConf.to_container(saved, resolve=True)
        for key in ("model", "residual", "data", "seed"):
            if before[key] != now[key]:
                raise ValueError(f"cannot resume {ckpt}: config.{key} differs from the saved run's")
        merged = cfg.copy()
    else:
        merged = saved
        for ov in cli_overrides:
            key, _, value = ov.partition("=")
            if key in ("resume", "+resume"):
                continue
            if key not in RESUME_OVERRIDABLE:
                raise ValueError(f"resume: cannot change {key!r} of a run being resumed; "
                                 f"changeable: {', '.join(RESUME_OVERRIDABLE)}")
            OmegaConf.update(merged, key, yaml_value(value))
    merged.resume = str(ckpt)
    return merged


def yaml_value(text: str):
    import yaml

    return yaml.safe_load(text)


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


def train(cfg: DictConfig, *, callbacks: list | None = None, parent_run_id: str | None = None,
          run_dir: Path | None = None, cli_overrides: list[str] | None = None,
          extra_tags: dict | None = None) -> RunResult:
    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

    from data import CorpusDataModule

    from .module import LMModule

    ckpt_path = None
    if cfg.resume:
        ckpt_path = find_checkpoint(cfg.resume)
        cfg = _resume_config(cfg, ckpt_path, cli_overrides)
        run_dir = ckpt_path.parent.parent
    validate(cfg)  # everything that can be wrong with the config fails here, before any compute
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
    module = LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=dm.vocab_size)

    logger = None
    from lightning.pytorch.utilities import rank_zero_only

    if cfg.mlflow.enabled and rank_zero_only.rank == 0:  # other DDP ranks (started by Lightning) log nothing
        client, uri, exp_id = tracking.open_experiment(cfg)
        run_id_file = run_dir / "mlflow_run_id"
        run_id = run_id_file.read_text().strip() if (ckpt_path and run_id_file.is_file()) else None
        tags = {**tracking.run_tags(parent_run_id), **(extra_tags or {}),
                "residual": cfg.residual.name, "ablation": cfg.ablation.name if cfg.ablation else "none",
                "model": cfg.model.name, "run_dir": str(run_dir)}
        logger = tracking.make_logger(experiment_name=cfg.mlflow.experiment, run_name=run_name(cfg), tracking_uri=uri,
                              tags=tags if run_id is None else None, run_id=run_id, log_model=False)
        if run_id is not None:  # resumed: the same MLflow run goes on
            client.update_run(run_id, status="RUNNING")
            for k, v in tracking.run_tags(parent_run_id).items():
                client.set_tag(run_id, k, v)
        run_id_file.write_text(logger.run_id)
        if run_id is None:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
            logger.log_hyperparams(run_params(module.model, cfg.model, module.model.head.out_features))

    ckpt_cb = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step:06d}", auto_insert_metric_name=False,
                              every_n_train_steps=cfg.trainer.ckpt_every, save_last=True, save_top_k=1)
    cbs = [ckpt_cb, *(callbacks or [])]
    if cfg.trainer.progress_bar:
        cbs.append(RichProgressBar())
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, precision=t.precision,
        max_steps=t.max_steps,
        gradient_clip_val=t.grad_clip, accumulate_grad_batches=t.accumulate_grad_batches,
        val_check_interval=t.val_every * t.accumulate_grad_batches, check_val_every_n_epoch=None,
        limit_val_batches=t.val_batches, log_every_n_steps=t.log_every, num_sanity_val_steps=0,
        logger=logger if logger is not None else False, callbacks=cbs, default_root_dir=run_dir,
        enable_progress_bar=t.progress_bar, enable_model_summary=False, benchmark=False)
    start = time.perf_counter()
    status = "FINISHED"
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None)
        if trainer.global_step != module.last_val_step:
            trainer.validate(module, datamodule=dm, verbose=False)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        result = RunResult(val_loss=metrics.get("val/loss", float("nan")), train_loss=module.last_train_loss,
                           steps=trainer.global_step, run_dir=run_dir, wall_s=time.perf_counter() - start,
                           mlflow_run_id=logger.run_id if logger else None, metrics=metrics)
        if logger is not None:
            _log_end_of_run(logger, cfg, module, dm, run_dir, result, device=trainer.strategy.root_device)
        return result
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
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
    plot = tracking.plot_loss_curves(client, run_id, run_dir / "loss_curve.png")
    if plot:
        client.log_artifact(run_id, str(plot), artifact_path="plots")
    if cfg.mlflow.depth_heatmaps:
        recorded = record_depth_weights(module, dm, device)
        if recorded:
            title = f"depth attention: {run_name(cfg)}"
            heat = tracking.plot_depth_weights(recorded, run_dir / "depth_attention.png", title)
            client.log_artifact(run_id, str(heat), artifact_path="plots")
            (run_dir / "depth_attention.json").write_text(
                json.dumps({k: v.tolist() for k, v in recorded.items()}))
            client.log_artifact(run_id, str(run_dir / "depth_attention.json"), artifact_path="plots")


@torch.no_grad()
def record_depth_weights(module, dm, device: torch.device | str = "cpu") -> dict:
    """Run one validation batch with recording on, on ``device`` (where the run trained: Lightning
    moves the module to the CPU after fit, and a fused backend such as ``residual.backend=triton``
    runs on CUDA only); return the mechanism's depth-attention weights, on the CPU."""
    batch = next(iter(dm.val_dataloader()))
    home = module.device
    module.to(device).eval()
    try:
        res = module.model.residual if hasattr(module.model, "residual") else module.model._orig_mod.residual
        res.recorded = {}
        tokens, doc_ids = batch["tokens"].to(module.device), batch["doc_ids"].to(module.device)
        module(tokens[:, :-1], doc_ids[:, :-1], record=True)
        return {k: v.cpu() for k, v in res.recorded.items()}
    finally:
        module.to(home)
