"""The step sampler (deterministic, resumable, rank-sharded) and the Lightning data module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data.config import DataConfig
from data.datamodule import CorpusDataModule, StepSampler, val_window_indices

SEQ_LEN = 32


def test_sampler_is_deterministic_and_seeded():
    full = list(StepSampler(50, 4, seed=7, max_steps=30))
    assert len(full) == 120 and full == list(StepSampler(50, 4, seed=7, max_steps=30))
    assert full != list(StepSampler(50, 4, seed=8, max_steps=30))


def test_sampler_walks_through_whole_permutations():
    indices = list(StepSampler(10, 3, seed=0, max_steps=10))  # 30 positions = 3 epochs of 10
    epochs = [indices[i : i + 10] for i in range(0, 30, 10)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(10))
    assert epochs[0] != epochs[1]  # a fresh permutation per epoch


@pytest.mark.parametrize("start", [0, 1, 3, 7, 12, 13])
def test_sampler_resume_yields_exactly_the_tail(start):
    full = list(StepSampler(13, 5, seed=3, max_steps=13))
    resumed = StepSampler(13, 5, seed=3, max_steps=13, start_step=start)
    assert list(resumed) == full[start * 5 :]
    assert len(resumed) == len(full[start * 5 :])


def test_sampler_ranks_split_each_global_batch():
    world = 3
    global_batches = list(StepSampler(40, 2 * world, seed=1, max_steps=9))
    per_rank = [list(StepSampler(40, 2, seed=1, max_steps=9, rank=r, world_size=world)) for r in range(world)]
    for step in range(9):
        together = sum((per_rank[r][step * 2 : step * 2 + 2] for r in range(world)), [])
        assert together == global_batches[step * 2 * world : (step + 1) * 2 * world]


def test_val_window_indices_spread_evenly():
    assert val_window_indices(10, None).tolist() == list(range(10))
    assert val_window_indices(10, 50).tolist() == list(range(10))
    capped = val_window_indices(100, 5)
    assert capped.tolist() == [0, 25, 50, 74, 99]


@pytest.fixture(scope="module")
def datamodule(small_cfg):
    dm = CorpusDataModule(small_cfg, seq_len=SEQ_LEN, seed=5, max_steps=12)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _batches(loader) -> list[torch.Tensor]:
    return [batch["tokens"] for batch in loader]


def test_datamodule_exposes_vocab_and_batches(datamodule, small_cfg, small_prepared):
    assert datamodule.vocab_size == small_prepared.vocab_size <= small_cfg.vocab_size
    assert datamodule.tokenizer.get_vocab_size() == datamodule.vocab_size
    assert datamodule.eot_id == 0
    batches = list(datamodule.train_dataloader())
    assert len(batches) == 12
    for batch in batches:
        assert batch["tokens"].shape == batch["doc_ids"].shape == (small_cfg.batch_size, SEQ_LEN + 1)
        assert batch["tokens"].dtype == batch["doc_ids"].dtype == torch.int64
        assert int(batch["tokens"].max()) < datamodule.vocab_size
    # The same run always sees the same batches.
    again = _batches(datamodule.train_dataloader())
    assert torch.equal(torch.stack(again), torch.stack([b["tokens"] for b in batches]))


def test_datamodule_resumes_from_its_state(small_cfg, datamodule):
    full = _batches(datamodule.train_dataloader())
    resumed = CorpusDataModule(small_cfg, seq_len=SEQ_LEN, seed=5, max_steps=12)
    resumed.setup("fit")
    assert resumed.state_dict() == {"step": 0}
    resumed.load_state_dict({"step": 5})
    assert resumed.state_dict() == {"step": 5}
    tail = _batches(resumed.train_dataloader())
    assert len(tail) == 7 and all(torch.equal(a, b) for a, b in zip(tail, full[5:]))


def test_validation_is_fixed_and_capped(small_cfg, datamodule):
    first = _batches(datamodule.val_dataloader())
    assert torch.equal(torch.cat(first), torch.cat(_batches(datamodule.val_dataloader())))
    total = len(datamodule.val_set)
    capped = CorpusDataModule(DataConfig(**{**vars(small_cfg), "val_windows": 8}), SEQ_LEN, seed=5, max_steps=12)
    capped.setup("validate")
    assert total > 8 and len(capped.val_set) == 8 and len(_batches(capped.val_dataloader())) == 2
    assert capped.val_set.windows[0] == 0 and capped.val_set.windows[-1] == total - 1


def test_val_unigram_entropy(datamodule):
    entropy = datamodule.val_unigram_entropy()
    targets = np.concatenate([datamodule.val_set[i]["tokens"][1:].numpy() for i in range(len(datamodule.val_set))])
    assert 3.0 < entropy < np.log(len(np.unique(targets)))  # English is far from uniform over tokens


def test_too_short_corpus_for_seq_len_is_an_error(small_cfg):
    dm = CorpusDataModule(small_cfg, seq_len=10_000_000, seed=0, max_steps=1)
    with pytest.raises(ValueError, match="not one window"):
        dm.setup("fit")


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_lightning_resume_replays_the_same_batches(small_cfg, datamodule, tmp_path: Path):
    """A run checkpointed at step 3 and resumed trains on exactly the batches of an uninterrupted run."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["tokens"].clone())
            return self.layer(batch["tokens"][:, :1].float()).mean()

        def validation_step(self, batch, batch_idx):
            pass  # validation is switched off below; defined so Lightning does not warn

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def trainer(max_steps: int, checkpoint: ModelCheckpoint | None = None) -> L.Trainer:
        return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=tmp_path, enable_checkpointing=checkpoint is not None,
                         callbacks=[checkpoint] if checkpoint else None)

    def module(max_steps: int) -> CorpusDataModule:
        return CorpusDataModule(small_cfg, seq_len=SEQ_LEN, seed=5, max_steps=max_steps)

    straight = Recorder()
    trainer(6).fit(straight, datamodule=module(6))

    def checkpoint(name: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=3, save_top_k=-1)

    first = Recorder()
    trainer(3, checkpoint("first")).fit(first, datamodule=module(6))
    (path,) = (tmp_path / "first").glob("*.ckpt")
    assert torch.load(path, weights_only=True)["CorpusDataModule"] == {"step": 3}

    second = Recorder()
    trainer(6, checkpoint("second")).fit(second, datamodule=module(6), ckpt_path=path)
    assert len(straight.seen) == 6 and len(first.seen) == 3 and len(second.seen) == 3
    for a, b in zip(first.seen + second.seen, straight.seen):
        assert torch.equal(a, b)


def test_sampler_is_left_alone_by_lightning_in_distributed_runs():
    # Lightning replaces any sampler that is not a DistributedSampler when it runs on several devices.
    from torch.utils.data.distributed import DistributedSampler

    assert isinstance(StepSampler(10, 2, seed=0, max_steps=3, rank=1, world_size=2), DistributedSampler)
    with pytest.raises(ValueError):
        StepSampler(10, 2, seed=0, max_steps=3, rank=2, world_size=2)
