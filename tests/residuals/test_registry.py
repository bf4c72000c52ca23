"""Generic tests every registered residual gets for free (on the tiny backbone)."""

import dataclasses
import subprocess
import sys

import pytest
import torch

import residuals
from residuals import Residual, ResidualConfig, register
from tests.helpers import ROOT, build_backbone, packed_batch

NAMES = residuals.names()
VOCAB = 61


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    torch.manual_seed(0)
    m = build_backbone(request.param, vocab=VOCAB).eval()
    # Move every parameter off its (often zero or symmetric) init so the tests see a general point.
    with torch.no_grad():
        for p in m.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def test_forward_backward_finite_and_shaped(model):
    model.train()
    tokens, docs = packed_batch(2, 29, VOCAB, n_docs=3)
    logits = model(tokens, docs)
    assert logits.shape == (2, 29, VOCAB) and torch.isfinite(logits).all()
    logits.backward(torch.randn_like(logits))
    grads = [p.grad for p in model.residual.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if grads:  # the mechanism's own parameters learn
        assert any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()
    model.eval()


def test_causal_no_output_sees_a_later_token(model):
    tokens, docs = packed_batch(2, 29, VOCAB, n_docs=1, seed=3)
    base = model(tokens, docs)
    for t in (0, 13, 27):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.randint(0, VOCAB - 1, changed[:, t + 1:].shape)) % VOCAB
        out = model(changed, docs)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=2e-5)


def test_no_output_sees_another_document(model):
    tokens, docs = packed_batch(2, 31, VOCAB, n_docs=3, seed=5)
    base = model(tokens, docs)
    for b in range(2):
        for doc in docs[b].unique():
            inside = docs[b] == doc
            changed = tokens.clone()
            changed[b, inside] = (changed[b, inside] + 7) % VOCAB
            out = model(changed, docs)
            torch.testing.assert_close(out[b, ~inside], base[b, ~inside], rtol=0, atol=2e-5)
            other = 1 - b
            torch.testing.assert_close(out[other], base[other], rtol=0, atol=2e-5)


def test_accounting_is_reported(model):
    res = model.residual
    assert res.extra_flops_per_token() >= 0 and res.state_per_token() >= 1


def test_record_gives_finite_weights(model):
    tokens, docs = packed_batch(1, 17, VOCAB)
    model.residual.recorded = {}
    model(tokens, docs, record=True)
    for name, w in model.residual.recorded.items():
        assert torch.isfinite(w).all() and w.ndim == 2, name


def test_every_variant_has_matching_file_and_typed_config():
    for name in NAMES:
        cls = residuals.get(name)
        assert cls.__module__ in (f"residuals.{name}", "residuals.base"), (name, cls.__module__)
        assert dataclasses.is_dataclass(cls.Config) and issubclass(cls.Config, ResidualConfig)
        cfg = residuals.config_for(name)
        assert cfg.name == name


def test_duplicate_name_is_an_error():
    with pytest.raises(ValueError, match="'vanilla' is already registered"):
        @register("vanilla")
        class Again(Residual):
            @dataclasses.dataclass
            class Config(ResidualConfig):
                pass


def test_unknown_name_lists_registered():
    with pytest.raises(KeyError, match="registered residuals: .*vanilla"):
        residuals.get("no_such_residual")


def test_external_plugin_trains_from_the_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "platform.run", "plugins=[tests.residuals.example_plugin]", "residual=example_gated",
         "residual.gate_init=0.5", "trainer.max_steps=3", "trainer.val_every=3", "trainer.val_batches=1",
         "trainer.progress_bar=false", "data.vocab_size=512", f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final val/loss" in out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_checkpointed_reads_give_identical_loss_and_gradients(name):
    torch.manual_seed(1)
    plain = build_backbone(name, vocab=VOCAB).train()
    torch.manual_seed(1)
    ckpt = build_backbone(name, vocab=VOCAB, checkpoint_reads=True).train()
    tokens, docs = packed_batch(2, 19, VOCAB)
    out_a, out_b = plain(tokens, docs), ckpt(tokens, docs)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    g = torch.randn_like(out_a)
    out_a.backward(g)
    out_b.backward(g)
    for (n, pa), (_, pb) in zip(plain.named_parameters(), ckpt.named_parameters()):
        if pa.grad is None:
            assert pb.grad is None, n
        else:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-7, msg=n)


WITH_BACKEND = [n for n in NAMES if "backend" in {f.name for f in dataclasses.fields(residuals.get(n).Config)}]


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_reference_backend_asks_every_kernel_for_its_reference(name, monkeypatch):
    """With residual.backend=torch every kernel entry point the mechanism calls is asked for backend
    'torch' explicitly. A call that leaves it at 'auto' would run the fused kernel on a GPU (and fail
    where the fused op does not cover the call, as the heads-split reference path did), so the
    reference backend would not be the reference there."""
    import kernels.depth_attn
    import kernels.mhc
    import kernels.msar_attn

    asked = []
    for module in (kernels.depth_attn, kernels.mhc, kernels.msar_attn):
        original = module.resolve_backend

        def recording(backend, x, op, _original=original):
            asked.append((op, backend))
            return _original(backend, x, op)

        monkeypatch.setattr(module, "resolve_backend", recording)
    torch.manual_seed(0)
    m = build_backbone(name, vocab=VOCAB, residual_overrides=("residual.backend=torch",)).train()
    tokens, docs = packed_batch(2, 11, VOCAB, n_docs=2)
    m(tokens, docs).backward(torch.randn(2, 11, VOCAB))
    assert asked, f"{name}: no kernel entry point was called"
    assert {b for _, b in asked} == {"torch"}, f"{name}: kernels asked for {sorted(set(asked))}"
