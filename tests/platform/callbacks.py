"""Lightning callbacks that break a run on purpose, for tests (also usable from the `callbacks:` config)."""

from __future__ import annotations

import os
import signal

import lightning as L
import torch


class PoisonBefore(L.Callback):
    """NaN weights before the forward pass of the batch at `step`: the loss of that step is NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.model.head.weight.fill_(float("nan"))


class PoisonAfter(L.Callback):
    """NaN weights right after the update of `step` (a diverged step), before its checkpoint is taken."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.model.head.weight.fill_(float("nan"))


class SigtermAt(L.Callback):
    """The process sends itself SIGTERM (what a scheduler does) at `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class CountSteps(L.Callback):
    """Counts the optimizer steps it sees (a harmless callback for the `callbacks:` config)."""

    def __init__(self, label: str = ""):
        self.label, self.steps = label, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps += 1
