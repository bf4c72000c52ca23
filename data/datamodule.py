"""The Lightning data module and the resumable, step-indexed training sampler.

Training order is a function of ``(seed, step)`` alone: the windows are visited in an endless
sequence of permutations, epoch ``e`` shuffled with the seed ``(seed, e)``, and step ``s`` takes the
next ``batch_size`` indices of that sequence. The sampler starts at any step, so a run resumed from
a checkpoint at step ``k`` sees exactly the batches an uninterrupted run sees from step ``k`` on.
The module's ``state_dict`` (saved in Lightning checkpoints) is just that step.

Distributed runs: each rank takes its own ``batch_size`` slice of every step's ``world_size *
batch_size`` indices. The sampler does the sharding itself; it is a ``DistributedSampler``
subclass so that Lightning leaves it as it is instead of wrapping and sharding it a second time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from data.config import DataConfig, validate
from data.packing import PackedWindows, unigram_entropy
from data.pipeline import prepare_corpus
from data.store import PreparedCorpus


class StepSampler(DistributedSampler):
    """Window indices for the steps ``[start_step, max_steps)``, ``batch_size`` per step and rank.

    With ``world_size`` ranks, step ``s`` covers positions ``[s*B*W, (s+1)*B*W)`` of the permutation
    sequence and rank ``r`` yields the ``r``-th run of ``B`` of them. Only ``__iter__`` and
    ``__len__`` count; what ``DistributedSampler`` adds (``set_epoch``, ...) is unused.
    """

    def __init__(self, num_windows: int, batch_size: int, seed: int, max_steps: int, *,
                 start_step: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if num_windows < 1:
            raise ValueError(f"num_windows={num_windows!r}: there is nothing to sample")
        if not 0 <= start_step <= max_steps:
            raise ValueError(f"start_step={start_step!r} must lie in [0, max_steps={max_steps}]")
        # Given rank and world size explicitly, this needs no process group.
        super().__init__(range(num_windows), num_replicas=world_size, rank=rank, shuffle=False)
        self.num_windows = num_windows
        self.batch_size = batch_size
        self.seed = seed
        self.max_steps = max_steps
        self.start_step = start_step
        self.rank = rank
        self.world_size = world_size

    def permutation(self, epoch: int) -> np.ndarray:
        # A seed sequence of (seed, epoch): independent streams per epoch, no arithmetic on seeds.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.batch_size

    def __iter__(self) -> Iterator[int]:
        step_size = self.batch_size * self.world_size
        epoch, perm = -1, None
        for step in range(self.start_step, self.max_steps):
            first = step * step_size + self.rank * self.batch_size
            for position in range(first, first + self.batch_size):
                if position // self.num_windows != epoch:
                    epoch = position // self.num_windows
                    perm = self.permutation(epoch)
                yield int(perm[position % self.num_windows])


def val_window_indices(num_windows: int, limit: int | None) -> np.ndarray:
    """All validation windows in order, or ``limit`` of them spread evenly over the whole stream
    (so a capped validation still sees every part of the held-out text)."""
    if limit is None or limit >= num_windows:
        return np.arange(num_windows)
    return np.unique(np.linspace(0, num_windows - 1, limit).round().astype(np.int64))


class CorpusDataModule(L.LightningDataModule):
    """Packed windows of ``seq_len + 1`` tokens from the configured corpus, in a resumable order.

    After ``prepare_data()`` or ``setup()``: ``tokenizer`` (``None`` for shards without the
    ``tokenizers`` package), ``vocab_size``, ``eot_id``, ``train_set`` and ``val_set``.
    Batches are dicts of int64 tensors ``tokens`` and ``doc_ids``, both ``(batch_size, seq_len + 1)``.
    A step is one optimizer step: with ``accumulate_grad_batches = a`` it consumes ``a`` batches.
    """

    def __init__(self, cfg: DataConfig | Mapping, seq_len: int, seed: int, max_steps: int) -> None:
        super().__init__()
        self.cfg = validate(cfg)
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be an integer >= 1")
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps!r} must be an integer >= 1")
        self.seq_len = seq_len
        self.seed = seed
        self.max_steps = max_steps
        self.start_step = 0
        self.prepared: PreparedCorpus | None = None
        self.tokenizer = None
        self.vocab_size: int | None = None
        self.eot_id: int | None = None
        self.train_set: PackedWindows | None = None
        self.val_set: PackedWindows | None = None

    def _attach(self, prepared: PreparedCorpus) -> None:
        self.prepared = prepared
        self.tokenizer = prepared.tokenizer
        self.vocab_size = prepared.vocab_size
        self.eot_id = prepared.eot_id

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node: the slow build (tokenizer, packing) happens
        # once, and setup() on every rank then finds the cache entry.
        self._attach(prepare_corpus(self.cfg))

    def setup(self, stage: str | None = None) -> None:
        if self.prepared is None:
            self._attach(prepare_corpus(self.cfg))
        self.train_set = PackedWindows(self.prepared.train, self.seq_len)
        if len(self.train_set) == 0:
            raise ValueError(f"the training split has {len(self.prepared.train)} tokens: not one window "
                             f"of seq_len + 1 = {self.seq_len + 1}; use more documents or a shorter seq_len")
        val_total = len(PackedWindows(self.prepared.val, self.seq_len))
        self.val_set = PackedWindows(self.prepared.val, self.seq_len, val_window_indices(val_total, self.cfg.val_windows))

    def _loader(self, dataset: PackedWindows, sampler: Sampler | None) -> DataLoader:
        if self.cfg.num_workers > 0:
            # Tokenizing used the Rust thread pool; saying so before the fork silences its warning
            # (the workers only slice arrays, they never tokenize).
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return DataLoader(
            dataset,
            batch_size=self.cfg.batch_size,
            sampler=sampler,
            shuffle=False,
            num_workers=self.cfg.num_workers,
            persistent_workers=self.cfg.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_sampler(self) -> StepSampler:
        """The sampler for the rest of the run, from ``start_step`` (0, or the restored step)."""
        rank, world_size, accumulate = 0, 1, 1
        if self.trainer is not None:
            rank, world_size = self.trainer.global_rank, self.trainer.world_size
            accumulate = self.trainer.accumulate_grad_batches
        # The sampler counts batches; Lightning's global_step counts optimizer steps.
        return StepSampler(len(self.train_set), self.cfg.batch_size, self.seed, self.max_steps * accumulate,
                           start_step=self.start_step * accumulate, rank=rank, world_size=world_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.train_sampler())

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, None)

    def state_dict(self) -> dict[str, Any]:
        step = self.trainer.global_step if self.trainer is not None else self.start_step
        return {"step": int(step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.start_step = int(state_dict["step"])

    def val_unigram_entropy(self) -> float:
        """Entropy (nats/token) of the validation targets' unigram distribution: what a model that
        ignores context can at best reach on ``val_set``; a model that learns goes well below it."""
        if self.val_set is None:
            raise RuntimeError("call setup() first")
        targets = [self.val_set[i]["tokens"][1:].numpy() for i in range(len(self.val_set))]
        if not targets:
            raise ValueError("the validation split has no complete window")
        return unigram_entropy(np.concatenate(targets), self.vocab_size)
