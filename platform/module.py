"""The LightningModule: the backbone, its loss, optimiser, schedule and training metrics."""

from __future__ import annotations

import math
import random
import resource
import time

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from .model import Backbone


class NonFiniteLossError(FloatingPointError):
    pass


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class LMModule(L.LightningModule):
    def __init__(self, model_cfg, trainer_cfg, residual_cfg, vocab_size: int):
        super().__init__()
        self.model_cfg, self.tcfg = model_cfg, trainer_cfg
        self.model = Backbone(model_cfg, vocab_size, residual_cfg)
        self.val_ppl = Perplexity()
        self._t_last: float | None = None
        self._tokens_since = 0
        self.last_train_loss = float("nan")
        self.last_val_step = -1  # global step of the latest validation

    def forward(self, tokens, doc_ids, record: bool = False):
        return self.model(tokens, doc_ids, record=record)

    def _loss(self, batch):
        tokens, doc_ids = batch["tokens"], batch["doc_ids"]
        logits = self(tokens[:, :-1], doc_ids[:, :-1])  # (B, T, V)
        target = tokens[:, 1:]
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        return loss, logits, target

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._loss(batch)
        if not torch.isfinite(loss):
            ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none yet"
            raise NonFiniteLossError(f"loss is {loss.item()} at step {self.global_step}; stopping. "
                                     f"Last good checkpoint: {ckpt}")
        self._tokens_since += batch["tokens"][:, 1:].numel()
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.last_train_loss = float(loss.detach())
        return loss

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        # Aux-loss-free balancing: one bias nudge per optimizer step (before any checkpoint is taken).
        for _, moe in self.model.moe_layers():
            moe.update_bias()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        step = self.global_step
        if step % self.tcfg.log_every == 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self._t_last is not None:
                self.log("perf/tokens_per_s", self._tokens_since / (now - self._t_last))
            self._t_last, self._tokens_since = now, 0
            self.log("perf/peak_mem_mb", peak_memory_mb(self.device))
            self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
            for i, moe in self.model.moe_layers():
                for k, v in moe.last_stats.items():
                    self.log(f"moe/layer{i}/{k}", v)

    def validation_step(self, batch, batch_idx):
        loss, logits, target = self._loss(batch)
        self.val_ppl.update(logits.float(), target)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("val/ppl", self.val_ppl.compute())
        self.val_ppl.reset()
        self.last_val_step = self.global_step

    def configure_optimizers(self):
        # Weight decay on matrices only (not norms' gains, queries, biases).
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        t = self.tcfg
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2),
            foreach=self.device.type == "cuda")  # not fused: Lightning clips gradients between unscale and step
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_with_warmup(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # Exact resume: carry every RNG the run might touch (the data order is a function of the step).
    def on_save_checkpoint(self, checkpoint):
        # Never write a checkpoint that cannot be resumed: a diverged update leaves non-finite weights.
        if not all(torch.isfinite(p).all() for p in self.parameters()):
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
