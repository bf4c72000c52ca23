"""The LightningModule: the backbone, its loss, optimiser, schedule and training metrics.

Every run logs its speed through Lightning's callbacks (`configure_callbacks`): `LearningRateMonitor`
(`lr/decay`, `lr/no_decay`) and `MFUMonitor`, a `ThroughputMonitor` fed with the analytic training
FLOPs of `platform.accounting`. MFU is reported twice (docs/gpu.md): `perf/mfu` against the bf16
matmul rate measured on this GPU at fit start, `perf/mfu_datasheet` against the datasheet's dense
bf16 peak (H100/H200: 989 TFLOP/s). Neither counts recomputed activations as useful work.
"""

from __future__ import annotations

import math
import os
import random
import resource

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from torchmetrics.text import Perplexity

from . import accounting, graphs
from .env import GPU_SAFE_DEFAULTS
from .model import Backbone
from .moe import update_biases


# Multi-GPU runs keep NVLink multicast (NVLS) off unless the environment says otherwise: hosts whose
# GPUs are partitioned or virtualised lack it, and NCCL / symmetric memory then fail at start-up.
# Set here, at import, so Lightning's DDP launcher hands them to every rank it starts.
for _key, _value in GPU_SAFE_DEFAULTS.items():
    os.environ.setdefault(_key, _value)


class NonFiniteLossError(FloatingPointError):
    pass


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_in_fused_step(optimizer: torch.optim.Optimizer, parameters, max_norm: float) -> torch.Tensor:
    """Gradient-norm clipping folded into the next step of a fused optimizer; returns the total norm.

    ``clip_grad_norm_`` multiplies every gradient in place by min(max_norm / (‖g‖ + 1e-6), 1), one
    more pass over all gradients before the step reads them again (0.24 ms of an 18.5 ms `small` step
    on an H200). A fused Adam/AdamW step already divides every gradient it reads by ``grad_scale``
    when one is set (the hook loss scaling uses), so setting it to max((‖g‖ + 1e-6) / max_norm, 1)
    gives the same update, and leaves the same clipped gradients behind, up to one rounding.
    The norm is computed on the device; nothing waits for it. Refused for an optimizer that is not
    fused (it would ignore the scale).
    """
    opt = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
    if not (opt.defaults.get("fused") and getattr(opt, "_step_supports_amp_scaling", False)):
        raise ValueError(f"clip_in_fused_step needs a fused optimizer that takes a grad_scale; got "
                         f"{type(opt).__name__}(fused={opt.defaults.get('fused')})")
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    opt.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    return norm


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MFUMonitor(ThroughputMonitor):
    """Lightning's throughput metrics plus tokens/s and MFU against two ceilings, every `log_every` steps.

    Logged (per device): `perf/tokens_per_s`, `perf/tflops` (model FLOPs, analytic), `perf/mfu` (over
    the measured bf16 matmul rate) and `perf/mfu_datasheet` (over the datasheet dense bf16 peak);
    the MFU keys only where the ceiling is known (a CUDA device). Rates are over a window of
    `window` steps, so the first ones (compilation, warm-up) age out.
    """

    def __init__(self, window: int):
        super().__init__(batch_size_fn=lambda batch: batch["tokens"].shape[0],
                         length_fn=lambda batch: batch["tokens"][:, 1:].numel(), window_size=max(2, window))
        self.measured: float | None = None
        self.datasheet: float | None = None

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        device = trainer.strategy.root_device
        self.measured, self.datasheet = accounting.peak_rates(device)
        for throughput in self._throughputs.values():  # Lightning's own `device/mfu`: the datasheet one
            throughput.available_flops = self.datasheet

    def _compute(self, trainer, iter_num=None):
        if not trainer._logger_connector.should_update_logs:
            return
        stage = trainer.state.stage
        metrics = self._throughputs[stage].compute()
        out = {f"{stage.value}/{k}": v for k, v in metrics.items()}
        if stage == RunningStage.TRAINING:
            if "device/items_per_sec" in metrics:
                out["perf/tokens_per_s"] = metrics["device/items_per_sec"]
            flops = metrics.get("device/flops_per_sec")
            if flops is not None:
                out["perf/tflops"] = flops / 1e12
                if self.measured:
                    out["perf/mfu"] = flops / self.measured
                if self.datasheet:
                    out["perf/mfu_datasheet"] = flops / self.datasheet
        trainer._logger_connector.log_metrics(out, step=iter_num)


class LMModule(L.LightningModule):
    def __init__(self, model_cfg, trainer_cfg, residual_cfg, vocab_size: int):
        super().__init__()
        self.model_cfg, self.tcfg = model_cfg, trainer_cfg
        self.model = Backbone(model_cfg, vocab_size, residual_cfg)
        if trainer_cfg.compile:
            # Dynamo's per-frame graph limit counts the graphs of every model this process compiled: a process
            # that trains several runs (benchmarks.backend_training, an in-process sweep) ran the later runs'
            # residual frames eager once the earlier runs' graphs filled it. A run starts from an empty cache.
            torch._dynamo.reset()
            self.model.compile_as(trainer_cfg.compile_scope, dict(trainer_cfg.compile_options))
        self.val_ppl = Perplexity()
        self._graphed_loss = None  # trainer.cuda_graphs: the captured training loss (platform.graphs), built on first use
        self._last_loss: torch.Tensor | None = None
        self.last_val_step = -1  # global step of the latest validation
        # Model FLOPs per trained token (forward + backward = 3x forward), for MFU; set per batch below.
        self.train_flops_per_token = 3 * accounting.forward_flops_per_token(self.model, model_cfg, vocab_size)
        self.flops_per_batch = 0.0
        # Routing loads are per rank until the bias update all-reduces them: DDP must not overwrite
        # them with rank 0's copy at every forward (its default for buffers).
        self._ddp_params_and_buffers_to_ignore = [
            f"model.{name}" for name, _ in self.model.named_buffers() if name.endswith((".load", ".counts"))]

    @property
    def last_train_loss(self) -> float:
        """The latest training loss (read on demand, so the step itself never waits for it)."""
        return float("nan") if self._last_loss is None else float(self._last_loss)

    def forward(self, tokens, doc_ids, record: bool = False):
        return self.model(tokens, doc_ids, record=record)

    def _loss(self, batch):
        return graphs.next_token_loss(self.model, batch["tokens"], batch["doc_ids"])  # loss, logits, target

    def training_step(self, batch, batch_idx):
        if self.tcfg.cuda_graphs:
            loss = self._graphed(batch["tokens"], batch["doc_ids"])
        else:
            loss, _, _ = self._loss(batch)
        if not torch.isfinite(loss):
            ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none yet"
            raise NonFiniteLossError(f"loss is {loss.item()} at step {self.global_step}; stopping. "
                                     f"Last good checkpoint: {ckpt}")
        self.flops_per_batch = self.train_flops_per_token * batch["tokens"][:, 1:].numel()
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self._last_loss = loss.detach()
        return loss

    def _graphed(self, tokens, doc_ids):
        if self._graphed_loss is None:
            if self.trainer.accumulate_grad_batches > 1:
                # The graph hands autograd its own gradient buffers; with accumulation, keep `.grad`
                # allocated (zeroed in place, see optimizer_zero_grad) so each replay is added to it.
                for p in self.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
            self._graphed_loss = graphs.graphed_loss(self.model, tokens, doc_ids)
        return self._graphed_loss(tokens, doc_ids)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        # set_to_none=False only where the graph's gradient buffers would otherwise become `.grad` and be
        # overwritten by the next micro-batch's replay before it is accumulated (platform/graphs.py).
        optimizer.zero_grad(set_to_none=not (self.tcfg.cuda_graphs and self.trainer.accumulate_grad_batches > 1))

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        # Aux-loss-free balancing: one bias nudge per optimizer step (before any checkpoint is taken),
        # from the load of every rank (one all-reduce for all layers), so every rank keeps the same bias.
        update_biases([moe for _, moe in self.model.moe_layers()])

    def configure_callbacks(self):
        cbs = [MFUMonitor(window=self.tcfg.log_every + 1)]
        if self.trainer.loggers:  # LearningRateMonitor refuses a trainer without a logger
            cbs.append(LearningRateMonitor(logging_interval="step"))
        return cbs

    def on_train_batch_end(self, outputs, batch, batch_idx):
        step = self.global_step
        if step % self.tcfg.log_every == 0:
            self.log("perf/peak_mem_mb", peak_memory_mb(self.device))
            for i, moe in self.model.moe_layers():
                for k, v in moe.last_stats.items():
                    self.log(f"moe/layer{i}/{k}", v)

    def validation_step(self, batch, batch_idx):
        self.flops_per_batch = self.train_flops_per_token / 3 * batch["tokens"][:, 1:].numel()  # forward only
        loss, logits, target = self._loss(batch)
        self.val_ppl.update(logits.float(), target)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("val/ppl", self.val_ppl.compute(), sync_dist=True)  # torchmetrics already reduced it over ranks
        self.val_ppl.reset()
        self.last_val_step = self.global_step

    def configure_optimizers(self):
        # Weight decay on matrices only (not norms' gains, queries, biases).
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        t = self.tcfg
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay, "name": "decay"},
             {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}],
            lr=t.lr, betas=(t.beta1, t.beta2), fused=self._fused_adamw())
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_with_warmup(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "name": "lr"}}

    def _fused_adamw(self) -> bool:
        """One fused kernel for the whole AdamW update on CUDA, except with fp16's loss scaling (a fused
        optimizer unscales inside its step, after the point where gradients are clipped)."""
        return self.device.type == "cuda" and self.tcfg.precision != "16-mixed"

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # Lightning's mixed-precision plugin refuses to clip for any fused optimizer because of fp16
        # loss scaling; in bf16 and fp32 the gradients are not scaled, so clip them here directly.
        # The clipping itself is folded into the fused step (`clip_in_fused_step`): no pass of its own
        # over the gradients.
        if gradient_clip_val and getattr(optimizer, "defaults", {}).get("fused"):
            clip_in_fused_step(optimizer, self.parameters(), gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # Exact resume: carry every RNG the run might touch (the data order is a function of the step).
    def on_save_checkpoint(self, checkpoint):
        # Never write a checkpoint that cannot be resumed: a diverged update leaves non-finite weights.
        if not torch.stack([torch.isfinite(p).all() for p in self.parameters()]).all():  # one host sync
            ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none yet"
            raise NonFiniteLossError(f"parameters are not finite after step {self.global_step}; stopping "
                                     f"without writing a checkpoint. Last good checkpoint: {ckpt}")
        kind, keys, pos, has_gauss, gauss = np.random.get_state()  # plain types: loads with weights_only
        checkpoint["rng"] = {"torch": torch.get_rng_state(),
                             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
                             "python": random.getstate(),
                             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}

    def on_load_checkpoint(self, checkpoint):
        rng = checkpoint.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            kind, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
            random.setstate(rng["python"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
