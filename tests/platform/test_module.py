"""The LightningModule's speed metrics: MFU from the analytic FLOPs, the learning rate from its monitor."""

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

from platform import accounting
from platform.module import LMModule, cosine_with_warmup
from tests.helpers import make_cfg, packed_batch

VOCAB = 61


class Recorder(Logger):
    name, version = "recorder", 0

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass

    def values(self, key):
        return [m[key] for _, m in self.rows if key in m]


def loader(n_batches: int, B: int = 4, T: int = 24):
    batches = []
    for i in range(n_batches):
        tokens, docs = packed_batch(B, T + 1, VOCAB, seed=i)
        batches.append({"tokens": tokens, "doc_ids": docs})
    return torch.utils.data.DataLoader(batches, batch_size=None)  # already batched


def test_mfu_and_lr_are_logged_from_the_analytic_flops(monkeypatch):
    measured, datasheet = 4e9, 1e10  # made-up ceilings: the CPU has neither
    monkeypatch.setattr(accounting, "peak_rates", lambda device: (measured, datasheet))
    cfg = make_cfg("model=tiny", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.seq_len=24",
                   "residual=vanilla", "trainer.log_every=2", "trainer.warmup_steps=3", "trainer.max_steps=8")
    torch.manual_seed(0)
    from platform.config import residual_config

    module = LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=VOCAB)
    forward = accounting.backbone_flops_per_token(cfg.model, VOCAB) + module.model.residual.extra_flops_per_token()
    per_token = 3 * forward
    assert module.train_flops_per_token == pytest.approx(per_token)
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=rec, log_every_n_steps=2, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader(8))
    assert module.flops_per_batch == pytest.approx(per_token * 4 * 24)
    tokens_s, tflops = rec.values("perf/tokens_per_s"), rec.values("perf/tflops")
    mfu, mfu_sheet = rec.values("perf/mfu"), rec.values("perf/mfu_datasheet")
    assert len(tokens_s) >= 2 and len(tflops) == len(mfu) == len(mfu_sheet) == len(tokens_s)
    for t, f, m, s in zip(tokens_s, tflops, mfu, mfu_sheet):
        assert f * 1e12 == pytest.approx(t * per_token, rel=1e-6)  # model FLOPs = tokens/s x FLOPs/token
        assert m == pytest.approx(f * 1e12 / measured) and s == pytest.approx(f * 1e12 / datasheet)
    lrs = rec.values("lr/decay")  # logged before the optimizer steps 1, 3, 5, 7 (every log_every=2)
    t = cfg.trainer
    assert lrs == pytest.approx([t.lr * cosine_with_warmup(s, 3, 8, t.min_lr_ratio) for s in (1, 3, 5, 7)])
    assert rec.values("lr/no_decay") == pytest.approx(lrs)
    assert not trainer.optimizers[0].defaults["fused"]  # fused AdamW is for CUDA only


def test_peak_rates_are_unknown_off_cuda():
    assert accounting.peak_rates(torch.device("cpu")) == (None, None)
