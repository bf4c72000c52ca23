"""FlexAttention with a document block mask equals the dense-mask SDPA reference.

PyTorch refuses FlexAttention backward on CPU in its public entry point (a device check); the
eager path behind it (unfused math with its own autograd, re-evaluating our mask_mod in backward)
is device-agnostic, so the CPU tests lift that one check to compare gradients too. The fused,
compiled kernel is compared with the reference on CUDA (`gpu` marker).
"""

import pytest
import torch

from platform.model import Attention, attention_backend, build_attention_mask
from tests.helpers import build_backbone, packed_batch, tiny_model_cfg

# Eager FlexAttention (the CPU path) warns that it is unfused: that is the point of the reference here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)


def odd_doc_ids(B: int, T: int, seed: int) -> torch.Tensor:
    """Documents of every length, including 1-token documents and a boundary at the last token."""
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, T, generator=g) < 0.15)
    starts[:, -1] = True  # a 1-token document at the end
    starts[:, 1] = True  # and one at position 1 (position 0 is a start anyway)
    return torch.cumsum(starts.long(), 1) + 100 * torch.arange(B)[:, None]


CASES = [  # (B, T, d_model, n_heads, n_kv_heads)
    pytest.param(2, 37, 64, 4, 2, id="T37-gqa2"),
    pytest.param(1, 130, 48, 6, 3, id="T130-gqa2-hd8"),
    pytest.param(3, 19, 32, 2, 2, id="T19-mha"),
    pytest.param(2, 41, 64, 8, 1, id="T41-mqa"),
]


@pytest.mark.parametrize("doc_mask", [True, False], ids=["docs", "causal"])
@pytest.mark.parametrize("B,T,d,H,Hkv", CASES)
def test_flex_equals_masked_sdpa_forward_and_gradients(flex_backward_on_cpu, B, T, d, H, Hkv, doc_mask):
    cfg = tiny_model_cfg(d_model=d, n_heads=H, n_kv_heads=Hkv, seq_len=T)
    torch.manual_seed(0)
    attn = Attention(cfg).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)  # scores far from uniform, so a wrong mask shows
    doc_ids = odd_doc_ids(B, T, seed=T)
    h = torch.randn(B, T, d, dtype=torch.float64)
    upstream = torch.randn(B, T, d, dtype=torch.float64)
    results = {}
    for backend in ("flex", "sdpa"):
        attn.zero_grad()
        x = h.clone().requires_grad_(True)
        y = attn(x, build_attention_mask(doc_ids, backend, doc_mask))
        y.backward(upstream)
        results[backend] = (y.detach(), x.grad, {n: p.grad.clone() for n, p in attn.named_parameters()})
    (y_f, dx_f, g_f), (y_s, dx_s, g_s) = results["flex"], results["sdpa"]
    torch.testing.assert_close(y_f, y_s, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dx_f, dx_s, rtol=1e-10, atol=1e-10)
    for name in g_s:
        torch.testing.assert_close(g_f[name], g_s[name], rtol=1e-10, atol=1e-10, msg=name)


def test_flex_backbone_equals_sdpa_backbone(flex_backward_on_cpu):
    """The whole model (MoE, residual, one mask shared by every layer) with either backend."""
    torch.manual_seed(0)
    flex = build_backbone("vanilla", vocab=97, attention="flex").train()
    sdpa = build_backbone("vanilla", vocab=97, attention="sdpa").train()
    sdpa.load_state_dict(flex.state_dict())
    tokens, docs = packed_batch(2, 45, 97, n_docs=4, seed=3)
    upstream = torch.randn(2, 45, 97)
    out = {}
    for name, model in (("flex", flex), ("sdpa", sdpa)):
        logits = model(tokens, docs)
        logits.backward(upstream)
        out[name] = logits.detach()
    torch.testing.assert_close(out["flex"], out["sdpa"], rtol=1e-5, atol=1e-5)
    for (n, p), (_, q) in zip(flex.named_parameters(), sdpa.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=n)  # grads reach ~50


def test_block_mask_skips_tiles_other_documents_own():
    """Two 128-token documents in a 256-token window: the cross-document tile is never visited."""
    doc_ids = torch.cat([torch.zeros(1, 128), torch.ones(1, 128)], 1).long()
    mask = build_attention_mask(doc_ids, "flex").block
    dense = mask.to_dense()[0, 0]  # (query tiles, key tiles): 1 where a tile is computed
    assert dense.tolist() == [[1, 0], [0, 1]]


def test_auto_dispatch_and_bad_names():
    assert attention_backend("auto", torch.device("cpu")) == "sdpa"
    assert attention_backend("auto", torch.device("cuda")) == "flex"
    assert attention_backend("sdpa", torch.device("cuda")) == "sdpa"
    with pytest.raises(ValueError, match="model.attention='flash'.*auto, flex, sdpa"):
        attention_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="model.recompute='some'"):
        build_backbone("vanilla", recompute="some")


def test_flex_on_a_cpu_trainer_is_refused_before_compute():
    from platform.config import compose, validate

    with pytest.raises(ValueError, match="model.attention=flex: FlexAttention has no backward on the CPU"):
        validate(compose("model=tiny", "model.attention=flex", "trainer=cpu"))


@pytest.mark.parametrize("recompute", ["attention", "mlp", "full"])
def test_recompute_changes_nothing_but_memory(recompute):
    """Same logits and gradients with sublayers re-run in backward; MoE load counted once."""
    torch.manual_seed(0)
    plain = build_backbone("vanilla", vocab=97).train()
    again = build_backbone("vanilla", vocab=97, recompute=recompute).train()
    again.load_state_dict(plain.state_dict())
    tokens, docs = packed_batch(2, 33, 97, seed=5)
    upstream = torch.randn(2, 33, 97)
    for model in (plain, again):
        model(tokens, docs).backward(upstream)
    for (n, p), (_, q) in zip(plain.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    for (_, a), (_, b) in zip(plain.moe_layers(), again.moe_layers()):
        assert a.load.sum() == 2 * 33 * a.top_k and torch.equal(a.load, b.load)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [([], []), ([64, 64, 4, 2], [32, 64, 64, 32, 4, 3])], ids=["default", "tuned"])
def test_compiled_flex_equals_sdpa_on_gpu(dtype, tiles):
    """FlexAttention compiled, with PyTorch's tiles and with model.flex_fwd / flex_bwd, against the dense mask."""
    torch._dynamo.reset()  # the tiles are part of the compiled kernel: no cached one from the other case
    cfg = tiny_model_cfg(d_model=256, n_heads=4, n_kv_heads=2, seq_len=1000, flex_fwd=tiles[0], flex_bwd=tiles[1])
    torch.manual_seed(0)
    attn = Attention(cfg).cuda()
    doc_ids = odd_doc_ids(2, 1000, seed=0).cuda()
    h = torch.randn(2, 1000, 256, device="cuda")
    upstream = torch.randn(2, 1000, 256, device="cuda")
    res = {}
    for backend in ("flex", "sdpa"):
        attn.zero_grad()
        x = h.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = attn(x, build_attention_mask(doc_ids, backend))
        y.float().backward(upstream)
        res[backend] = [y.float()] + [x.grad] + [p.grad for p in attn.parameters()]
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for a, b in zip(res["flex"], res["sdpa"]):
        assert (a - b).norm() / b.norm() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scope", ["sublayers", "model"])
def test_compiled_sublayers_equal_eager_on_gpu(scope):
    """Compiled sublayers, or the whole forward (trainer.compile_scope), in bf16 are as close to the fp32
    eager model as eager bf16 is (routing flips aside)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_backbone("vanilla", vocab=512, seq_len=256).cuda().train()
    tokens, docs = packed_batch(4, 256, 512, n_docs=3)
    tokens, docs = tokens.cuda(), docs.cuda()
    upstream = torch.randn(4, 256, 512, device="cuda")

    def grads(bf16: bool) -> dict:
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens, docs)
        logits.float().backward(upstream)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    exact, eager = grads(False), grads(True)
    model.compile_sublayers() if scope == "sublayers" else model.compile_model()
    compiled = grads(True)
    for n, g in exact.items():
        err_eager = (eager[n] - g).norm() / g.norm().clamp_min(1e-12)
        err_compiled = (compiled[n] - g).norm() / g.norm().clamp_min(1e-12)
        assert err_compiled <= 2 * err_eager + 2e-2, (n, float(err_compiled), float(err_eager))


@pytest.mark.parametrize("name", ["vanilla", "msar_block"])
def test_whole_backbone_traces_without_graph_breaks(name):
    """No config lookups or host syncs on the forward path: one graph (residual's torch backend, CPU)."""
    import torch._dynamo as dynamo

    dynamo.reset()
    model = build_backbone(name, vocab=97, checkpoint_reads=True, recompute="mlp").train()
    tokens, docs = packed_batch(2, 32, 97)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # grouped_mm's compiled form wants bf16 operands
        explained = dynamo.explain(model)(tokens, docs)
    dynamo.reset()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_a_model_with_bad_flex_tiles_is_refused_where_it_is_built():
    """model.flex_fwd / flex_bwd are checked when a model is built, not only by the run's config check:
    three values for four fields would otherwise pass as a partial kernel_options."""
    from platform.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.flex_fwd=\[64, 64, 4\]: needs 4 values"):
        build_backbone("vanilla", flex_fwd=[64, 64, 4])
    with pytest.raises(ConfigError, match=r"model.flex_bwd=.*num_warps=3 is not valid"):
        build_backbone("vanilla", flex_bwd=[32, 64, 64, 32, 3, 3])
