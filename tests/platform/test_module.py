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


@pytest.mark.parametrize("max_norm", [0.3, 1e3])  # clipping active, and a norm under the limit
def test_clipping_folded_into_the_fused_step_equals_clip_then_step(max_norm):
    """clip_in_fused_step + a fused AdamW step against clip_grad_norm_ + the same step, over three steps
    of random gradients: the same weights, the same clipped gradients left behind, the same moments
    (the first moment is (1 - β1)·g after one step, so an unclipped gradient would show there)."""
    from platform.module import clip_in_fused_step

    g = torch.Generator().manual_seed(7)
    shapes = [(37, 5), (5,), (3, 4, 2)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    new = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt_new = torch.optim.AdamW(new, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for a, b in zip(ref, new):
            grad = torch.randn(a.shape, generator=g) * (step + 2)
            a.grad, b.grad = grad.clone(), grad.clone()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
        norm_new = clip_in_fused_step(opt_new, new, max_norm)
        torch.testing.assert_close(norm_new, norm_ref)
        assert (norm_ref > max_norm) == (max_norm < 1)  # the two cases are what they claim to be
        opt_ref.step()
        opt_new.step()
        for a, b in zip(ref, new):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt_new.state[b][key], opt_ref.state[a][key], rtol=1e-6, atol=1e-9)


def test_clipping_in_the_step_refuses_an_unfused_optimizer():
    from platform.module import clip_in_fused_step

    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match=r"fused optimizer.*AdamW\(fused=None\)"):
        clip_in_fused_step(torch.optim.AdamW([p]), [p], 1.0)


def test_module_clips_inside_its_fused_step(monkeypatch):
    """LMModule with a fused AdamW (forced on CPU) and an active clip trains to the weights of the same
    module clipping with clip_grad_norm_ before the step."""
    from platform.config import residual_config

    cfg = make_cfg("model=tiny", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.seq_len=24",
                   "residual=vanilla", "trainer.grad_clip=0.05", "trainer.max_steps=3")
    monkeypatch.setattr(LMModule, "_fused_adamw", lambda self: True)

    def fit(clip_before_step: bool):
        torch.manual_seed(0)
        module = LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=VOCAB)
        if clip_before_step:
            module.configure_gradient_clipping = lambda optimizer, gradient_clip_val=None, gradient_clip_algorithm=None: (
                torch.nn.utils.clip_grad_norm_(module.parameters(), gradient_clip_val, foreach=True))
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                            gradient_clip_val=cfg.trainer.grad_clip, enable_checkpointing=False,
                            enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=loader(3))
        opt = trainer.optimizers[0]
        assert opt.defaults["fused"]
        return module, opt

    ref, opt_ref = fit(clip_before_step=True)
    new, opt_new = fit(clip_before_step=False)
    assert getattr(opt_ref, "grad_scale", None) is None and float(opt_new.grad_scale) > 1  # clipping was active
    for (name, a), b in zip(ref.named_parameters(), new.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(opt_new.state[b]["exp_avg"], opt_ref.state[a]["exp_avg"], rtol=1e-5, atol=1e-8,
                                   msg=name)


@pytest.mark.parametrize("scope", ["model", "sublayers"])
def test_compile_options_reach_every_torch_compile(monkeypatch, scope):
    """trainer.compile_options are handed to every torch.compile the module makes (the trunk or each
    sublayer, and the loss) as Inductor's options, with static shapes kept; without them, no options."""
    from platform.config import residual_config

    calls = []

    def fake_compile(fn=None, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    base = ["model=tiny", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.seq_len=24",
            "residual=vanilla", "trainer.compile=true", "trainer.precision=bf16-mixed", f"trainer.compile_scope={scope}"]
    for extra, want in ([], None), (["+trainer.compile_options.combo_kernels=true",
                                     "+trainer.compile_options.max_autotune=false"],
                                    {"combo_kernels": True, "max_autotune": False}):
        calls.clear()
        cfg = make_cfg(*base, *extra)
        module = LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=VOCAB)
        expected = 2 if scope == "model" else len(module.model.sublayers) + 1
        assert len(calls) == expected
        for kwargs in calls:
            assert kwargs.get("dynamic") is False
            assert kwargs.get("options") == want


def test_a_compiled_run_starts_from_an_empty_dynamo_cache(monkeypatch):
    """Every compiled module resets Dynamo before it compiles: Dynamo's per-frame graph limit counts the
    graphs of every model of the process, so a process training several runs ran the later runs'
    residual frames eager. Without compilation nothing is reset (another run's graphs stay)."""
    from platform.config import residual_config

    events = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: events.append("compile") or fn)
    base = ["model=tiny", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.seq_len=24",
            "residual=attnres_block"]
    for compile_ in ("true", "false"):
        events.clear()
        cfg = make_cfg(*base, f"trainer.compile={compile_}")
        LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=VOCAB)
        if compile_ == "true":
            assert events[0] == "reset" and events.count("reset") == 1 and events.count("compile") >= 2
        else:
            assert events == []
