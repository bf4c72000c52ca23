"""mHC (docs/method.md §2) and the attnres_mhc_sum ablation: invariants, driven through a fake stack.

The fake stack is L random per-token maps f_l(h) = tanh(W_l h + c_l) run through the residual
protocol exactly as the backbone does; upstream gradients are random (never ones_like).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import residuals
from residuals import Context, config_for, get
from residuals.mhc import MHC, OUTPUTS, mhc_coefficients, sinkhorn

D, L, B, T = 16, 4, 2, 7


class FakeStack(nn.Module):
    """L per-token sublayers f_l(h) = tanh(W_l h + c_l) around a residual mechanism."""

    def __init__(self, res: nn.Module, d: int = D, n_sublayers: int = L):
        super().__init__()
        self.res = res
        self.sublayers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_sublayers))
        for lin in self.sublayers:
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(d))
            nn.init.normal_(lin.bias, std=0.1)

    def forward(self, emb: torch.Tensor, record: bool = False, keep=None):
        ctx = Context(doc_ids=torch.zeros(emb.shape[:2], dtype=torch.long, device=emb.device), record=record)
        state = self.res.begin(emb, ctx)
        reads = []
        for layer, f in enumerate(self.sublayers):
            h = self.res.read(state, layer)
            reads.append(h)
            state = self.res.write(state, layer, torch.tanh(f(h)))
            if keep is not None:
                keep.append(state)
        return self.res.end(state), reads


def make_mhc(d: int = D, n_sublayers: int = L, **fields) -> MHC:
    return get("mhc")(config_for("mhc", **fields), d, n_sublayers)


def randomise(m: MHC, alpha=(0.3, 0.8), b_scale: float = 0.5) -> None:
    """Trained-looking parameters: z = x'φ ~ N(0, 1), α in `alpha`, biases N(0, b_scale²)."""
    nd = m.phi.shape[1]
    with torch.no_grad():
        m.phi.normal_(std=1.0 / math.sqrt(nd))
        m.alpha.uniform_(*alpha)
        for b in (m.b_pre, m.b_post, m.b_res):
            b.normal_(std=b_scale)


def random_streams(n: int, d: int = D) -> torch.Tensor:
    return torch.randn(B, T, n, d)


# --- Sinkhorn and the coefficients -----------------------------------------------------------------


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_matches_plain_loop(iters):
    torch.manual_seed(0)
    logits = 2.0 * torch.randn(5, 3, 4, 4, dtype=torch.float64)
    ref = logits.exp()
    for _ in range(iters):  # exp, then column / row normalisation, as written in the paper (Eq. 9)
        ref = ref / ref.sum(-2, keepdim=True)
        ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(sinkhorn(logits, iters), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_h_res_doubly_stochastic_for_random_parameters(n):
    torch.manual_seed(n)
    m = make_mhc(n=n)
    randomise(m)
    for layer in range(L):
        _, _, h_res = m.coefficients(random_streams(n), layer)
        assert h_res.dtype == torch.float32 and (h_res >= 0).all()
        assert (h_res.sum(-1) - 1).abs().max() < 1e-3  # rows
        assert (h_res.sum(-2) - 1).abs().max() < 1e-3  # columns
        assert h_res.std(dim=(0, 1)).max() > 1e-3  # input-dependent, not the static init


@pytest.mark.parametrize("n", [1, 2, 4])
def test_h_pre_h_post_ranges(n):
    torch.manual_seed(n)
    m = make_mhc(n=n)
    randomise(m, alpha=(1.0, 5.0), b_scale=3.0)  # wide logits, to reach the ends of the ranges
    h_pre, h_post, _ = m.coefficients(random_streams(n), 0)
    assert (h_pre >= 0).all() and (h_pre <= 1).all()
    assert (h_post >= 0).all() and (h_post <= 2).all()
    assert h_post.max() > 1.2 and h_post.min() < 0.8  # the ranges are actually exercised


def test_coefficients_gradcheck_fp64():
    torch.manual_seed(0)
    n, d = 2, 3
    k = n * n + 2 * n
    args = [
        torch.randn(2, 3, n, d, dtype=torch.float64),  # streams
        torch.randn(n * d, k, dtype=torch.float64) * 0.5,  # phi
        torch.rand(3, dtype=torch.float64) + 0.5,  # alpha
        torch.randn(n, dtype=torch.float64),  # b_pre
        torch.randn(n, dtype=torch.float64),  # b_post
        torch.randn(n, n, dtype=torch.float64),  # b_res
        torch.rand(n * d, dtype=torch.float64) + 0.5,  # norm gain
    ]
    args = [a.requires_grad_() for a in args]

    def fn(x, phi, alpha, b_pre, b_post, b_res, gain):
        return mhc_coefficients(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=5, norm_gain=gain)

    assert all(o.dtype == torch.float64 for o in fn(*args))
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)


def test_coefficients_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    m = make_mhc(n=4, stream_dtype="input")  # the default ("autocast") stores bf16 streams here: see below
    randomise(m, alpha=(1.0, 2.0))
    x = random_streams(4)
    ref = m.coefficients(x, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m.coefficients(x, 1)
        state = m.begin(x[:, :, 0], Context(doc_ids=torch.zeros(B, T, dtype=torch.long)))
        h = m.read(state, 0)
        out = nn.functional.linear(h, torch.randn(D, D))  # bf16 under autocast, like a sublayer
        state = m.write(state, 0, out)
    for r, g in zip(ref, got):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)  # a bf16 projection would miss this
    assert out.dtype == torch.bfloat16 and h.dtype == torch.float32 and state.streams.dtype == torch.float32
    bf16_state = m.begin(x[:, :, 0].bfloat16(), Context(doc_ids=torch.zeros(B, T, dtype=torch.long)))
    assert m.read(bf16_state, 0).dtype == torch.bfloat16


# --- exact properties at init ------------------------------------------------------------------------


@pytest.mark.parametrize("n,b_res_diag", [(2, 0.0), (4, 1.0), (4, 4.0), (3, -2.0)])
def test_phi_zero_is_exactly_the_plain_residual(n, b_res_diag):
    """φ = 0, b_pre = logit(1/n), b_post = 0, any b_res = c·I: every stream equals the plain
    residual stream at every depth (H^res X = X for identical streams since rows sum to 1,
    Σ H^pre = 1, H^post = 1), so each read is the vanilla read and the output is n × vanilla's."""
    torch.manual_seed(0)
    stack = FakeStack(make_mhc(n=n, phi_init_std=0.0, b_res_diag=b_res_diag))
    emb = torch.randn(B, T, D)
    states = []
    out, reads = stack(emb, keep=states)
    x = emb
    for layer, f in enumerate(stack.sublayers):
        torch.testing.assert_close(reads[layer], x, rtol=1e-5, atol=1e-5)
        x = x + torch.tanh(f(x))
        torch.testing.assert_close(states[layer].streams, x.unsqueeze(-2).expand(B, T, n, D), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, n * x, rtol=1e-5, atol=1e-5)


def test_n1_is_a_gated_residual_for_any_parameters():
    """n = 1: H^res is the 1×1 doubly stochastic matrix, exactly 1, whatever φ, α, b; so
    x_{l+1} = x_l + H^post f(H^pre x_l) with scalar per-token gates H^pre ∈ (0,1), H^post ∈ (0,2)."""
    torch.manual_seed(0)
    m = make_mhc(n=1)
    randomise(m, alpha=(1.0, 3.0), b_scale=2.0)
    stack = FakeStack(m)
    emb = torch.randn(B, T, D)
    states = []
    out, reads = stack(emb, keep=states)
    x = emb
    for layer, f in enumerate(stack.sublayers):
        h_pre, h_post, h_res = m.coefficients(x.unsqueeze(-2), layer)
        assert torch.equal(h_res, torch.ones_like(h_res))
        torch.testing.assert_close(reads[layer], h_pre * x)
        x = x + h_post * torch.tanh(f(h_pre * x))
        torch.testing.assert_close(states[layer].streams.squeeze(-2), x)
    torch.testing.assert_close(out, x)


def test_phi_zero_symmetric_init_never_splits_the_streams():
    """Why phi_init_std defaults to > 0: with φ = 0 and stream-symmetric biases, gradient descent
    keeps all streams identical (mHC stays a single-stream residual); the default init splits them."""

    def stream_spread(cfg_fields, steps):
        torch.manual_seed(1)
        stack = FakeStack(make_mhc(n=4, **cfg_fields))
        opt = torch.optim.SGD(stack.parameters(), lr=0.5)
        emb, grad = torch.randn(B, T, D), torch.randn(B, T, D)
        for _ in range(steps):
            opt.zero_grad()
            out, _ = stack(emb)
            out.backward(grad)
            opt.step()
        states = []
        stack(emb, keep=states)
        return max((s.streams - s.streams[..., :1, :]).abs().max().item() for s in states)

    assert stream_spread({"phi_init_std": 0.0}, steps=5) < 1e-4
    assert stream_spread({}, steps=0) > 1e-3
    assert stream_spread({}, steps=5) > 1e-1


# --- forward / backward, causality -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("output", ["sum", "head"])
def test_forward_backward_finite(n, output):
    torch.manual_seed(n)
    stack = FakeStack(make_mhc(n=n, output=output, norm_gain=True))
    emb = torch.randn(B, T, D, requires_grad=True)
    out, reads = stack(emb)
    assert out.shape == (B, T, D) and all(r.shape == (B, T, D) for r in reads)
    assert torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0
    for name, p in stack.res.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if name not in ("b_res", "alpha") or n > 1:  # n = 1: H^res ≡ 1 has no gradient
            assert p.grad.abs().sum() > 0, name


def test_per_token_causality():
    """mHC mixes streams, never tokens: perturbing token t changes nothing at any other token."""
    torch.manual_seed(0)
    m = make_mhc(n=4)
    randomise(m)
    stack = FakeStack(m)
    emb = torch.randn(B, T, D)
    t = 3
    emb2 = emb.clone()
    emb2[:, t] += torch.randn(B, D)
    out, reads = stack(emb)
    out2, reads2 = stack(emb2)
    others = [i for i in range(T) if i != t]
    for a, b in zip([out, *reads], [out2, *reads2]):
        torch.testing.assert_close(a[:, others], b[:, others], rtol=0, atol=1e-6)
    assert (out[:, t] - out2[:, t]).abs().max() > 1e-2


def test_read_write_end_match_the_update_rule_elementwise():
    """X_{l+1}[i] = Σ_j H^res[i, j] X_l[j] + H^post[i] v_l, h_l = Σ_j H^pre[j] X_l[j], written out per
    stream with random parameters and distinct streams (identical streams would hide a transpose)."""
    torch.manual_seed(0)
    n, layer = 3, 2
    m = make_mhc(n=n, output="head")
    randomise(m)
    with torch.no_grad():
        m.head.normal_()
    x = random_streams(n)
    out = torch.randn(B, T, D)
    state = m.begin(torch.zeros(B, T, D), Context(doc_ids=torch.zeros(B, T, dtype=torch.long)))
    state.streams = x
    h_pre, h_post, h_res = m.coefficients(x, layer)
    h = m.read(state, layer)
    new = m.write(state, layer, out).streams
    ref_h = sum(h_pre[..., j, None] * x[..., j, :] for j in range(n))
    torch.testing.assert_close(h, ref_h)
    for i in range(n):
        ref = sum(h_res[..., i, j, None] * x[..., j, :] for j in range(n)) + h_post[..., i, None] * out
        torch.testing.assert_close(new[..., i, :], ref)
    torch.testing.assert_close(m.end(m.write(state, layer, out)), sum(m.head[j] * new[..., j, :] for j in range(n)))


@pytest.mark.parametrize("output", OUTPUTS)
def test_bf16_streams_store_bf16_and_stay_close_to_fp32(output):
    """stream_dtype=bf16 under bf16 autocast (as in training): every state holds bf16 streams, end()
    returns fp32 (summed in fp32), and output and gradients stay within bf16 rounding of "input"
    (the embedding's fp32) streams, same parameters, random upstream."""
    torch.manual_seed(0)
    ref = make_mhc(n=3, output=output, stream_dtype="input")
    randomise(ref)
    low = make_mhc(n=3, output=output, stream_dtype="bf16")
    low.load_state_dict(ref.state_dict())
    stacks = [FakeStack(ref), FakeStack(low)]
    stacks[1].sublayers.load_state_dict(stacks[0].sublayers.state_dict())
    emb = torch.randn(B, T, D)
    keep = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, _ = stacks[0](emb)
        out_low, _ = stacks[1](emb, keep=keep)
    assert out_ref.dtype == torch.float32
    assert all(s.streams.dtype == torch.bfloat16 for s in keep) and out_low.dtype == torch.float32
    assert rel(out_low, out_ref) < 2e-2
    up = torch.randn_like(out_ref)
    out_ref.backward(up)
    out_low.backward(up)
    for (name, a), b in zip(ref.named_parameters(), low.parameters()):
        assert b.grad.dtype == torch.float32 and rel(b.grad, a.grad) < 5e-2, name


@pytest.mark.parametrize("setting", ["autocast", "input", "fp32", "bf16"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_stream_dtype_stores_what_it_says(setting, amp):
    """The default "autocast" stores bf16 streams only under bf16 autocast (trainer=gpu) and the embedding's fp32
    without (trainer=cpu: fp32 runs stay fp32, to the bit of "input"); "input" keeps the embedding's dtype, "fp32" and
    "bf16" store theirs either way. end() always returns fp32."""
    assert config_for("mhc").stream_dtype == "autocast"
    torch.manual_seed(0)
    ref = make_mhc(n=3, stream_dtype="input")
    randomise(ref)
    res = make_mhc(n=3, stream_dtype=setting)
    res.load_state_dict(ref.state_dict())
    stacks = [FakeStack(ref), FakeStack(res)]
    stacks[1].sublayers.load_state_dict(stacks[0].sublayers.state_dict())
    emb = torch.randn(B, T, D)
    keep = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out_ref, _ = stacks[0](emb)
        out, _ = stacks[1](emb, keep=keep)
    narrow = setting == "bf16" or (setting == "autocast" and amp)
    assert {s.streams.dtype for s in keep} == {torch.bfloat16 if narrow else torch.float32}
    assert out.dtype == torch.float32
    if not narrow:
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    else:
        assert 0 < rel(out, out_ref) < 2e-2


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1"))])
def test_bf16_streams_train_without_autocast(backend):
    """stream_dtype=bf16 in fp32 training without autocast (trainer=cpu): each read hands its sublayer h in the
    model's dtype (its fp32 weights would refuse a bf16 h), the streams stay bf16, and the loss and every gradient
    are finite and within bf16 rounding of fp32 streams (same parameters, random upstream)."""
    from tests.helpers import build_backbone, packed_batch, perturb_residual_params_alike

    models = {}
    for dtype in ("input", "bf16"):
        torch.manual_seed(0)
        models[dtype] = build_backbone("mhc", vocab=37, n_blocks=2, residual_overrides=(
            f"residual.stream_dtype={dtype}", f"residual.backend={backend}"))
    perturb_residual_params_alike(models["input"], models["bf16"])  # away from the init's symmetric streams
    grads, outs = {}, {}
    for dtype, model in models.items():
        tokens, docs = packed_batch(1, 11, 37, n_docs=2)
        out = model(tokens, docs)
        assert out.dtype == torch.float32
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        (out * up).sum().backward()
        outs[dtype], grads[dtype] = out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert rel(outs["bf16"], outs["input"]) < 2e-2
    assert grads["bf16"].keys() == grads["input"].keys()
    assert all(torch.isfinite(g).all() for g in grads["bf16"].values())
    flat = {k: torch.cat([g.flatten() for g in v.values()]) for k, v in grads.items()}
    assert rel(flat["bf16"], flat["input"]) < 5e-2
    for name, g in grads["bf16"].items():
        # the read's biases get sums over 11 tokens of small, cancelling terms: their error is the bf16 rounding of
        # the streams themselves (as in tests/kernels/test_mhc_fused.py's bf16 chain); the rest stays at 5e-2
        assert rel(g, grads["input"][name]) < (0.25 if name.startswith("residual.b_") else 5e-2), name


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_write_needs_read_of_the_same_layer():
    m = make_mhc(n=2)
    state = m.begin(torch.randn(B, T, D), Context(doc_ids=torch.zeros(B, T, dtype=torch.long)))
    m.read(state, 0)
    with pytest.raises(RuntimeError, match="read\\(layer=1\\)"):
        m.write(state, 1, torch.randn(B, T, D))


def test_recorded_heatmaps():
    torch.manual_seed(0)
    n = 3
    m = make_mhc(n=n)
    randomise(m)
    FakeStack(m)(torch.randn(B, T, D), record=True)
    rec = m.recorded
    assert rec["h_res"].shape == (L, n * n) and rec["h_res_composite"].shape == (L, n * n)
    assert rec["h_pre"].shape == (L, n) and rec["h_post"].shape == (L, n)
    h_res = rec["h_res"].view(L, n, n)
    torch.testing.assert_close(h_res.sum(-1), torch.ones(L, n), atol=1e-3, rtol=0)
    torch.testing.assert_close(h_res.sum(-2), torch.ones(L, n), atol=1e-3, rtol=0)
    torch.testing.assert_close(rec["h_res_composite"][-1], rec["h_res"][-1])  # last layer: itself
    assert all(torch.isfinite(v).all() for v in rec.values())


# --- config, validation, accounting ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"n": 0}, r"residual\.n=0 .*>= 1"),
        ({"sinkhorn_iters": 0}, r"residual\.sinkhorn_iters=0 .*>= 1"),
        ({"output": "mean"}, r"residual\.output='mean' .*sum, head"),
        ({"phi_init_std": -1.0}, r"residual\.phi_init_std=-1\.0"),
        ({"b_pre": float("inf")}, r"residual\.b_pre=inf"),
        ({"stream_dtype": "fp8"}, r"residual\.stream_dtype='fp8' .*input, fp32, bf16, autocast"),
    ],
)
def test_bad_config_names_value_and_choices(fields, match):
    cfg = config_for("mhc", **fields)
    with pytest.raises(ValueError, match=match):
        MHC.validate(cfg, d_model=D, n_sublayers=L)
    with pytest.raises(ValueError, match=match):
        MHC(cfg, D, L)


def test_typed_config_overrides():
    node = OmegaConf.structured(config_for("mhc"))
    cfg = OmegaConf.to_object(OmegaConf.merge(node, OmegaConf.from_dotlist(["n=2", "b_pre=0.5"])))
    assert isinstance(cfg, MHC.Config) and cfg.n == 2 and cfg.b_pre == 0.5
    assert OmegaConf.structured(config_for("mhc")).b_pre is None
    with pytest.raises(Exception):
        OmegaConf.merge(node, OmegaConf.from_dotlist(["n=two"]))


def test_b_pre_default_is_logit_one_over_n():
    for n in (2, 4, 8):
        m = make_mhc(n=n, phi_init_std=0.0)
        h_pre, _, _ = m.coefficients(random_streams(n), 0)
        torch.testing.assert_close(h_pre, torch.full_like(h_pre, 1.0 / n))


def test_accounting():
    def acc(n, d=64, n_sub=8, **kw):
        m = make_mhc(d=d, n_sublayers=n_sub, n=n, **kw)
        return m.extra_flops_per_token(), m.state_per_token(), m.io_per_sublayer(), m.io_per_sublayer(fused=True)

    flops = {n: acc(n) for n in (1, 2, 4, 8)}
    for n, (f, state, io, io_fused) in flops.items():
        assert f > 0 and state == n and io > io_fused > 3  # vanilla moves 3d per sublayer
    assert flops[1][0] < flops[2][0] < flops[4][0] < flops[8][0]
    # between the n² of H^res X and the n³ of the nd×(n²+2n) projection
    assert 4 < flops[8][0] / flops[4][0] < 8
    # docs/method.md §2 / paper Table 2: ≈ 34d for n = 4 (plus 2(n²+2n) coefficients)
    assert acc(4, d=1024)[2] == pytest.approx(34 + 48 / 1024)
    # linear in depth: every sublayer costs the same
    f8, f16, f24 = (acc(4, n_sub=s)[0] for s in (8, 16, 24))
    assert f24 - f16 == pytest.approx(f16 - f8) and f16 - f8 > 0
    # more Sinkhorn iterations cost 4n² per iteration per sublayer
    assert acc(4, sinkhorn_iters=21)[0] - acc(4)[0] == pytest.approx(8 * 4 * 16)


# --- attnres_mhc_sum -----------------------------------------------------------------------------------


def _attnres_mhc_sum():
    if "attnres" not in residuals.names():
        pytest.skip("residuals/attnres.py is not registered yet")
    return get("attnres_mhc_sum")


def test_attnres_mhc_sum_forward_backward_finite():
    cls = _attnres_mhc_sum()
    torch.manual_seed(0)
    cfg = config_for("attnres_mhc_sum")
    stack = FakeStack(cls(cfg, D, L))
    emb = torch.randn(B, T, D, requires_grad=True)
    out, reads = stack(emb, record=True)
    assert out.shape == (B, T, D) and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    assert torch.isfinite(emb.grad).all()
    for name, p in stack.res.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(k.startswith("mhc.") for k in stack.res.recorded)


def test_attnres_mhc_sum_read_is_the_sum_of_both_reads():
    cls = _attnres_mhc_sum()
    torch.manual_seed(0)
    cfg = config_for("attnres_mhc_sum")
    res = cls(cfg, D, L)
    with torch.no_grad():  # away from init, so neither read is trivial
        randomise(res.mhc)
        for p in res.attnres.parameters():
            p.normal_()
    subs = FakeStack(res).sublayers
    ctx = Context(doc_ids=torch.zeros(B, T, dtype=torch.long))
    state = res.begin(torch.randn(B, T, D), ctx)
    for layer, f in enumerate(subs):
        a_state, m_state = state
        expected = res.attnres.read(a_state, layer) + res.mhc.read(m_state, layer)
        h = res.read(state, layer)
        torch.testing.assert_close(h, expected)
        state = res.write(state, layer, torch.tanh(f(h)))
    a_state, m_state = state
    torch.testing.assert_close(res.end(state), res.attnres.end(a_state) + res.mhc.end(m_state))


def test_attnres_mhc_sum_nested_config_and_accounting():
    cls = _attnres_mhc_sum()
    node = OmegaConf.structured(config_for("attnres_mhc_sum"))
    cfg = OmegaConf.to_object(OmegaConf.merge(node, OmegaConf.from_dotlist(["mhc.n=2", "mhc.sinkhorn_iters=7"])))
    assert cfg.mhc.n == 2 and cfg.mhc.sinkhorn_iters == 7 and cfg.mhc.name == "mhc"
    res = cls(cfg, D, L)
    assert res.mhc.cfg.n == 2
    parts = (res.attnres, res.mhc)
    assert res.state_per_token() == sum(p.state_per_token() for p in parts)
    assert res.extra_flops_per_token() > sum(p.extra_flops_per_token() for p in parts)
    bad = config_for("attnres_mhc_sum")
    bad.mhc.n = 0
    with pytest.raises(ValueError, match=r"residual\.mhc\.n=0"):
        cls.validate(bad, d_model=D, n_sublayers=L)


# --- the fused kernels (kernels/mhc) -----------------------------------------------------------------

# backend=triton on CPU tensors runs only under Triton's interpreter (CPU CI), not on a GPU host
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")



@needs_interpreter
@pytest.mark.parametrize("checkpoint_reads", [False, True])
def test_fused_kernel_backend_matches_the_reference_in_the_backbone(checkpoint_reads):
    # The whole backbone with residual.backend=triton (under Triton's interpreter on CPU) against the
    # PyTorch reference: outputs and every gradient, random upstream gradient, parameters off init;
    # also with the reads recomputed in backward (model.checkpoint_reads, on in model=small / medium).
    from tests.helpers import backward_both_after_equal_outputs, build_backbone, packed_batch, perturb_residual_params_alike

    overrides = ("residual.norm_gain=true", "residual.output=head")
    torch.manual_seed(0)
    ref = build_backbone("mhc", vocab=37, n_blocks=2, residual_overrides=overrides, checkpoint_reads=checkpoint_reads)
    torch.manual_seed(0)
    fused = build_backbone("mhc", vocab=37, n_blocks=2, residual_overrides=(*overrides, "residual.backend=triton"),
                           checkpoint_reads=checkpoint_reads)
    assert fused.training and fused.cfg.checkpoint_reads is checkpoint_reads
    assert fused.residual.cfg.backend == "triton" and ref.residual.cfg.backend == "auto"  # auto: torch on CPU
    perturb_residual_params_alike(ref, fused)
    tokens, docs = packed_batch(1, 11, 37, n_docs=2)
    n_checked = 0
    for n, a, b in backward_both_after_equal_outputs(ref, fused, tokens, docs):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5, msg=n)
            n_checked += "residual" in n
    assert n_checked >= 5  # φ, α, b_pre, b_post, b_res (and the gain, the head) were compared


@pytest.mark.parametrize("checkpoint_reads", [False, True])
def test_reads_are_done_ahead_so_checkpointed_reads_recompute_nothing(monkeypatch, checkpoint_reads):
    """begin() does the first read and each write fuses the next read (mhc_post_pre), so read() computes
    nothing and model.checkpoint_reads reruns no mHC op in backward; gradients are unchanged by it."""
    import residuals.mhc as mhc_module
    from tests.helpers import build_backbone, packed_batch

    calls = []
    for name in ("mhc_pre", "mhc_post_pre", "mhc_post"):
        op = getattr(mhc_module, name)
        monkeypatch.setattr(mhc_module, name, lambda *a, _op=op, _name=name, **kw: calls.append(_name) or _op(*a, **kw))
    grads = {}
    for ckpt in (False, checkpoint_reads):
        torch.manual_seed(0)
        model = build_backbone("mhc", vocab=37, n_blocks=2, checkpoint_reads=ckpt)
        tokens, docs = packed_batch(1, 11, 37, n_docs=2)
        calls.clear()
        out = model(tokens, docs)
        assert calls == ["mhc_pre"] + ["mhc_post_pre"] * 3 + ["mhc_post"]  # 4 sublayers
        calls.clear()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        assert calls == []
        grads[ckpt] = [p.grad.clone() for p in model.residual.parameters()]
    for a, b in zip(grads[checkpoint_reads], grads[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend, every, once", [pytest.param("triton", 2, True, marks=needs_interpreter),
                                                  pytest.param("triton", 0, False, marks=needs_interpreter),
                                                  ("torch", 0, False)])
def test_layer_parameters_sliced_once_a_forward(backend, every, once, monkeypatch):
    """MHC.params_once: where the fused writes keep only some streams (recompute_every > 0, their ops graph breaks),
    every layer's φ, α, b_pre, b_post, b_res and norm gain are views made by one unbind of each parameter a forward,
    so that every read's and write's slice hangs off that parameter's one backward node (not a select per use, whose
    backward is a whole-parameter gradient of zeros); outputs and gradients equal to the bit. Elsewhere (the ops
    traced with their slices by a compile) each use slices its own, so that no break splits the compiled graph."""
    import residuals.mhc as mhc_module
    from tests.helpers import build_backbone, packed_batch, runs_on_and_off

    nodes = []
    for name, first in (("mhc_pre", 1), ("mhc_post_pre", 4)):  # φ's position among the op's arguments
        op = getattr(mhc_module, name)
        monkeypatch.setattr(mhc_module, name, lambda *a, _op=op, _i=first, **kw: nodes.append(
            [t.grad_fn for t in a[_i:_i + 6] if t is not None]) or _op(*a, **kw))

    def build():
        model = build_backbone("mhc", vocab=37, n_blocks=2, residual_overrides=(
            "residual.norm_gain=true", "residual.output=head", f"residual.backend={backend}",
            f"residual.recompute_every={every}"))
        randomise(model.residual)
        return model

    tokens, docs = packed_batch(2, 11, 37, n_docs=3)
    (out_1, grads_1, nodes_1), (out_r, grads_r, nodes_r) = runs_on_and_off(
        monkeypatch, MHC, "params_once", build, tokens, docs, nodes)
    assert len(nodes_1) == len(nodes_r) == 4 and all(len(x) == 6 for x in nodes_1 + nodes_r)  # 4 sublayers, 6 params
    assert {type(g).__name__ for x in nodes_1 for g in x} == {"UnbindBackward0" if once else "SelectBackward0"}
    # once: one node a parameter, shared by every layer; else a node of its own per layer and parameter
    assert len({id(g) for x in nodes_1 for g in x}) == (6 if once else 24)
    assert len({id(g) for x in nodes_r for g in x}) == 24
    assert torch.equal(out_1, out_r)
    assert {f"residual.{n}" for n in ("phi", "alpha", "b_pre", "b_post", "b_res", "norm_gain")} <= grads_1.keys()
    assert grads_1.keys() == grads_r.keys()
    for n in grads_1:
        assert torch.equal(grads_1[n], grads_r[n]), n


def test_bad_backend_names_value_and_choices():
    cfg = config_for("mhc", backend="cuda")
    with pytest.raises(ValueError, match=r"residual\.backend='cuda' .*auto, torch, triton"):
        MHC.validate(cfg, d_model=D, n_sublayers=L)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_interpreter),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_triton_backend_in_the_fake_stack_matches_torch(device, monkeypatch):
    """read/write with backend=triton against backend=torch, through the protocol, with recording;
    every write hands its stream gradient to its read's backward (no separate dX pass)."""
    from kernels.mhc import fused as fused_ops

    calls = []
    post_bwd = fused_ops.post_bwd
    monkeypatch.setattr(fused_ops, "post_bwd", lambda *a, **kw: calls.append(kw["store_dx"]) or post_bwd(*a, **kw))
    torch.manual_seed(0)
    ref = make_mhc(n=4, backend="torch")  # explicit: backend=auto is the fused op itself on CUDA tensors
    randomise(ref)
    fused = make_mhc(n=4, backend="triton")
    fused.load_state_dict(ref.state_dict())
    stacks = [FakeStack(ref).to(device), FakeStack(fused).to(device)]
    stacks[1].sublayers.load_state_dict(stacks[0].sublayers.state_dict())
    emb = torch.randn(B, T, D, device=device)
    (out_r, reads_r), (out_f, reads_f) = (s(emb, record=True) for s in stacks)
    torch.testing.assert_close(out_f, out_r, rtol=1e-4, atol=1e-5)
    for a, b in zip(reads_f, reads_r):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for key, value in ref.recorded.items():
        torch.testing.assert_close(fused.recorded[key], value, rtol=1e-4, atol=1e-6, msg=key)
    up = torch.randn_like(out_r)
    out_r.backward(up)
    assert calls == []  # the reference runs no fused kernel
    out_f.backward(up)
    assert calls == [False] * L
    for (name, a), b in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-4, msg=name)  # grads are O(10)


@needs_interpreter
@pytest.mark.parametrize("residual,every,sublayers", [("mhc", 2, "none"), ("mhc", 3, "none"), ("mhc", None, "none"),
                                                      ("mhc", None, "full"), ("attnres_mhc_sum", 2, "none"),
                                                      ("attnres_mhc_sum", None, "none")])
def test_recompute_every_trains_the_backbone_with_the_same_gradients(residual, every, sublayers, monkeypatch):
    """residual.recompute_every=L_r (the paper's §4.3 recomputation; residual.mhc.recompute_every inside
    attnres_mhc_sum): the fused writes keep the streams of one sublayer in L_r and backward rebuilds the others (one
    write kernel each); the logits and every gradient of the whole backbone equal those of the run that keeps every
    stream (recompute_every=0), to the bit. The default (None) on the fused writes is the paper's L_r* (2 for these
    6 sublayers); with the sublayers checkpointed too (model.recompute=full) the same holds. A forward without
    gradients keeps nothing to rebuild."""
    from kernels.mhc import fused
    from tests.helpers import build_backbone, packed_batch, perturb_residual_params_alike

    rebuilt = []
    post_fwd = fused.post_fwd
    monkeypatch.setattr(fused, "post_fwd", lambda *a: rebuilt.append(1) or post_fwd(*a))
    key = "residual." if residual == "mhc" else "residual.mhc."
    models = []
    for overrides in ((f"{key}recompute_every=0",), () if every is None else (f"{key}recompute_every={every}",)):
        torch.manual_seed(0)
        models.append(build_backbone(residual, vocab=37, n_blocks=3, residual_overrides=(f"{key}backend=triton",
                                                                                         *overrides),
                                     recompute=sublayers))
    keep_all, recomputed = models
    mhc = recomputed.residual if residual == "mhc" else recomputed.residual.mhc
    assert mhc.cfg.recompute_every == every
    if every is None:
        every = 2  # round(√(4·6/6))
    assert mhc.stream_recompute_every(torch.device("cpu")) == every
    perturb_residual_params_alike(keep_all, recomputed)
    recomputed.load_state_dict(keep_all.state_dict())
    tokens, docs = packed_batch(2, 9, 37, n_docs=2)
    outs = [m(tokens, docs) for m in models]
    assert torch.equal(outs[0], outs[1])
    up = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(3))
    rebuilt.clear()  # the last write's forward runs the write kernel too
    outs[0].backward(up)
    assert rebuilt == []
    outs[1].backward(up)
    layers = len(recomputed.sublayers)  # 6
    assert len(rebuilt) == sum(1 for layer in range(1, layers) if layer % every)
    for (name, a), b in zip(keep_all.named_parameters(), recomputed.parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name
    with torch.no_grad():
        one_doc = torch.zeros(1, 4, dtype=torch.long)
        state = mhc.begin(torch.randn(1, 4, recomputed.cfg.d_model), Context(doc_ids=one_doc))
    assert state.recompute is None


def test_recompute_every_defaults_to_the_papers_optimum_on_the_fused_writes():
    """recompute_every=None (the default): L_r* = √(nL/(n+2)) rounded where the writes are fused (backend triton,
    or auto on a CUDA device), 0 (keep every stream) on the reference and where L_r* rounds to 1; an explicit value
    is kept as given."""
    from kernels.mhc import optimal_every

    assert [optimal_every(4, L) for L in (2, 4, 16, 32, 64)] == [0, 2, 3, 5, 7]
    assert optimal_every(1, 32) == 3 and optimal_every(2, 32) == 4
    assert config_for("mhc").recompute_every is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # (only the device's type is read: no GPU needed)
    for backend, on_cpu, on_cuda in (("auto", 0, 5), ("triton", 5, 5), ("torch", 0, 0)):
        mhc = MHC(config_for("mhc", backend=backend), D, 32)
        assert (mhc.stream_recompute_every(cpu), mhc.stream_recompute_every(cuda)) == (on_cpu, on_cuda), backend
    for every in (0, 3):
        mhc = MHC(config_for("mhc", backend="auto", recompute_every=every), D, 32)
        assert mhc.stream_recompute_every(cuda) == mhc.stream_recompute_every(cpu) == every
    MHC.validate(config_for("mhc", backend="torch"), d_model=D, n_sublayers=L)  # the default is valid everywhere


def test_recompute_every_is_checked():
    for bad in (-1, 1.5, True):
        cfg = config_for("mhc", recompute_every=bad)
        with pytest.raises(ValueError, match=rf"residual\.recompute_every={bad!r} must be an integer >= 0"):
            MHC.validate(cfg, d_model=D, n_sublayers=L)
    cfg = config_for("mhc", recompute_every=2, backend="torch")
    with pytest.raises(ValueError, match=r"residual\.recompute_every=2: applies only to the fused writes .*'torch'"):
        MHC.validate(cfg, d_model=D, n_sublayers=L)
