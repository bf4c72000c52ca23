"""MSAR and Block MSAR (docs/method.md §4): views, their ablations, block equivalence, state, causality."""

from __future__ import annotations

import pytest
import torch

from kernels.causal_conv import causal_conv
from residuals import Context, config_for, get
from residuals.base import rms_norm
from tests.residuals.test_attnres import (
    B, D, DOC_IDS, L, T, FakeStack, assert_block_size_one_is_full, assert_block_state_is_single_stream, assert_causal,
    assert_backends_agree, assert_same_grads, block_sources, embedding, grads_through_stack, make, randomize,
)

KERNELS = [4, 8, 12]
M = 1 + len(KERNELS)


def box_views(x, kernels=KERNELS):
    """E_j(x) at the default init (causal box 1/k_j), written from docs/method.md §4: list of m tensors."""
    return [x] + [causal_conv(x, torch.full((k, x.shape[-1]), 1.0 / k), DOC_IDS) for k in kernels]


def init_oracle(sources, fields):
    """h at init: g = 1/m, zero queries -> every stream is the mean of its (expanded) sources."""
    x = torch.stack(sources)  # (S, B, T, d)
    if fields.get("conv_init") == "dirac":  # noise-free Dirac taps: every view is the identity
        return x.mean(0)
    if fields.get("placement") == "post":
        return torch.stack(box_views(x.mean(0))).mean(0)
    if fields.get("expand_values", True):
        return torch.stack([v.mean(0) for v in box_views(x)]).mean(0)
    return x.mean(0)


INIT_CASES = [
    ("msar", {}),
    ("msar", {"conv_init": "dirac"}),
    ("msar_block", {"conv_init": "dirac"}),
    ("msar", {"fusion": "softmax"}),
    ("msar", {"expand_values": False}),
    ("msar", {"placement": "post"}),
    ("msar", {"taps": "shared", "key_norm": False}),
    ("msar", {"query": "input"}),
    ("msar_block", {}),
    ("msar_block", {"block_size": 2, "taps": "per_block"}),
]


def _id(name, fields):
    return f"{name}-{'-'.join(f'{k}={v}' for k, v in fields.items()) or 'default'}"


@pytest.mark.parametrize("name, fields", INIT_CASES, ids=[_id(*c) for c in INIT_CASES])
def test_init_reads_the_mean_of_the_views(name, fields):
    fields = {"conv_init": "box", **fields, "conv_init_noise": 0.0}  # box unless the case says otherwise
    res, emb = make(name, **fields), embedding()
    _, reads, outs, _ = FakeStack()(res, emb, Context(DOC_IDS))
    size = fields.get("block_size", 4) if name == "msar_block" else 1
    for consumer, h in enumerate(reads):
        expected = init_oracle(block_sources(emb, outs, consumer, size), fields)
        torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-5, msg=f"consumer {consumer}")


@pytest.mark.parametrize("expand_values", [True, False])
def test_dirac_taps_equal_identity_views(expand_values):
    """Dirac taps make every conv view the identity: MSAR becomes wo_conv exactly."""
    dirac = make("msar", conv_init="dirac", expand_values=expand_values)
    randomize(dirac)
    with torch.no_grad():
        for taps in dirac.conv_taps:
            taps.zero_()[:, 0] = 1.0
    identity = make("msar", view="identity", expand_values=expand_values)
    missing, unexpected = identity.load_state_dict(dirac.state_dict(), strict=False)
    assert not missing and all(k.startswith("conv_taps.") for k in unexpected)
    stack = FakeStack()
    out_dirac, grads_dirac = grads_through_stack(dirac, stack)
    out_identity, grads_identity = grads_through_stack(identity, stack)
    torch.testing.assert_close(out_dirac, out_identity, rtol=1e-6, atol=1e-6)
    assert set(grads_dirac) - set(grads_identity) == {f"res.conv_taps.{j}" for j in range(M - 1)}
    assert_same_grads(grads_dirac, grads_identity, sorted(grads_identity))


def test_dirac_init_with_noise():
    taps = make("msar", conv_init="dirac", conv_init_noise=0.0).conv_taps[0]
    assert (taps[:, 0] == 1).all() and (taps[:, 1:] == 0).all()
    noisy = make("msar", conv_init="dirac", conv_init_noise=0.1).conv_taps[0]
    assert 0.05 < (noisy - taps).std() < 0.2


def _sources():
    return torch.randn(5, B, T, D, generator=torch.Generator().manual_seed(7)) * 2


def test_wo_conv_views_are_identical():
    res = randomize(make("msar", view="identity"))
    x = _sources()
    views = res.expand(x, consumer=3, doc_ids=DOC_IDS)  # (m, S, B, T, d)
    assert views.shape == (M, *x.shape)
    assert all(torch.equal(v, x) for v in views)


def test_scalar_write_back_keys_collapse_after_rmsnorm():
    """The paper's failure mode of H^post-style streams: β·v normalises to the same key for every view."""
    res = randomize(make("msar", view="scalar"), seed=5)  # write-back scalars β = 2σ(·) away from 1
    x = _sources()
    views = res.expand(x, consumer=3, doc_ids=DOC_IDS)
    keys = rms_norm(views)
    assert (views[1:] - views[0]).abs().max() > 0.1  # the values differ ...
    assert (keys[1:] - keys[0]).abs().max() < 1e-5  # ... the keys do not (up to RMSNorm eps)
    conv = randomize(make("msar"))  # contrast: conv views give different keys
    assert (rms_norm(conv.expand(x, 3, DOC_IDS))[1:] - keys[0]).abs().max() > 0.1


@pytest.mark.parametrize("fields", [{}, {"view": "scalar"}, {"taps": "shared", "expand_values": False},
                                    {"placement": "post", "fusion": "softmax"}, {"view": "identity", "query": "input"}],
                         ids=["default", "scalar", "shared-keys-only", "post-softmax", "identity-input"])
def test_block_size_one_is_full_msar(fields):
    assert_block_size_one_is_full("msar", "msar_block", fields)


@pytest.mark.parametrize("block_size", [2, 4])
def test_block_state_is_single_stream(block_size):
    assert_block_state_is_single_stream("msar_block", block_size)  # views are never stored


VARIANTS = [
    ("msar", {}),
    ("msar", {"view": "identity"}),
    ("msar", {"view": "scalar"}),
    ("msar", {"expand_values": False}),
    ("msar", {"taps": "per_block"}),
    ("msar", {"taps": "shared"}),
    ("msar", {"conv_init": "dirac", "conv_init_noise": 0.1}),
    ("msar", {"fusion": "softmax"}),
    ("msar", {"placement": "post"}),
    ("msar", {"query": "input", "key_norm": False}),
    ("msar", {"kernels": [2, 13]}),
    ("msar_block", {}),
    ("msar_block", {"block_size": 2, "view": "scalar"}),
    ("msar_block", {"taps": "per_block", "placement": "post"}),
]


@pytest.mark.parametrize("name, fields", VARIANTS, ids=[_id(*c) for c in VARIANTS])
def test_causal_across_packed_documents(name, fields):
    assert_causal(randomize(make(name, **fields)))


@pytest.mark.parametrize("placement, views, backend", [("streams", M, "torch"), ("post", 1, "torch"),
                                                       ("streams", 3, "triton")])
def test_recorded_weights_per_view(placement, views, backend):
    # the fused op (under the interpreter on CPU) with two small kernels: it costs ~1 ms per tap and op
    kernels = KERNELS if backend == "torch" else [2, 3]
    res = make("msar", placement=placement, backend=backend, kernels=kernels)
    FakeStack()(res, embedding(), Context(DOC_IDS, record=True))
    assert sorted(res.recorded) == [f"view{j}" for j in range(views)]
    for table in res.recorded.values():
        assert table.shape == (L + 1, L + 1)
        torch.testing.assert_close(table.sum(0), torch.ones(L + 1))
        assert (table.tril(-1) == 0).all()  # consumer l (column) sees sources (rows) 0..l only


def test_low_precision_in_same_dtype_out():
    res = randomize(make("msar_block"))
    stack = FakeStack().to(torch.bfloat16)
    final, reads, _, _ = stack(res, embedding(dtype=torch.bfloat16), Context(DOC_IDS))
    assert final.dtype == torch.bfloat16 and all(h.dtype == torch.bfloat16 for h in reads)
    assert torch.isfinite(final.float()).all()


def test_accounting():
    msar, block, attnres = make("msar"), make("msar_block", block_size=4), make("attnres")
    per_consumer = (2 * D * M  # m queries, m key gains
                    + sum(KERNELS) * D  # conv taps of views 1..m-1
                    + M * D * M + 1 + M)  # φ, α, b
    assert sum(p.numel() for p in msar.parameters()) == (L + 1) * per_consumer
    assert msar.state_per_token() == L + 1 and block.state_per_token() == L // 4 + 1
    assert msar.extra_flops_per_token() > block.extra_flops_per_token() > attnres.extra_flops_per_token() / 2
    assert make("msar", view="identity").extra_flops_per_token() < msar.extra_flops_per_token()
    # Block MSAR, N/S = 0.5: phase 1 0.5, m phase-1 results, partial+output+partial write 3,
    # write m streams, read them twice, write h: 0.5 + 4m + 4
    assert block.io_per_sublayer() == 0.5 + 4 * M + 4
    assert make("msar_block", placement="post").io_per_sublayer() == make("attnres_block").io_per_sublayer() + 3


BAD = [
    ("msar", {"view": "streams"}, r"residual.view='streams' is not valid for residual=msar; "
                                  r"choose one of: conv, identity, scalar$"),
    ("msar", {"taps": "per_layer"}, r"residual.taps='per_layer' .*choose one of: per_sublayer, per_block, shared$"),
    ("msar", {"conv_init": "normal"}, r"residual.conv_init='normal' .*choose one of: box, dirac$"),
    ("msar", {"fusion": "tanh"}, r"residual.fusion='tanh' .*choose one of: sigmoid, softmax$"),
    ("msar", {"placement": "pre"}, r"residual.placement='pre' .*choose one of: streams, post$"),
    ("msar", {"query": "token"}, r"residual.query='token' .*choose one of: static, input$"),
    ("msar", {"kernels": []}, r"residual.kernels=\[\] leaves one view"),
    ("msar", {"kernels": [4, 0]}, r"residual.kernels=\[4, 0\] must be distinct integers >= 2"),
    ("msar", {"kernels": [1, 4]}, r"residual.kernels=\[1, 4\] must be distinct integers >= 2"),
    ("msar", {"kernels": [4, 4]}, r"residual.kernels=\[4, 4\] must be distinct"),
    ("msar", {"conv_init_noise": -0.1}, r"residual.conv_init_noise=-0.1 must be >= 0"),
    ("msar", {"placement": "post", "view": "scalar"}, r"residual.placement='post' .* view='scalar'"),
    ("msar_block", {"block_size": 3}, r"residual.block_size=3 .* choose one of: 1, 2, 4, 8$"),
    ("msar_block", {"block_size": 6}, r"residual.block_size=6 .*divide n_sublayers=8"),
    ("msar_block", {"fusion": "relu"}, r"residual.fusion='relu' is not valid for residual=msar_block"),
]


@pytest.mark.parametrize("name, fields, match", BAD, ids=[_id(n, f) for n, f, _ in BAD])
def test_bad_config_values(name, fields, match):
    cfg = config_for(name, **fields)
    with pytest.raises(ValueError, match=match):
        get(name)(cfg, D, L)


FUSED_BACKBONE = [
    ("msar", ()),
    ("msar_block", ()),
    ("msar", ("residual.view=identity", "residual.fusion=softmax")),
    ("msar_block", ("residual.taps=per_block", "residual.key_norm=false")),
    ("msar_block", ("residual.recompute_streams=true",)),  # the fused reads keep no streams (the reference: auto)
]


@pytest.mark.parametrize("name, extra", FUSED_BACKBONE,
                         ids=[f"{n}-{'-'.join(e) or 'default'}" for n, e in FUSED_BACKBONE])
def test_fused_kernel_backend_matches_the_reference_in_the_backbone(name, extra):
    # The whole backbone with residual.backend=triton (the fused op, mixer included, under Triton's
    # interpreter on CPU) against the PyTorch reference: outputs and every gradient, random upstream
    # gradient, packed documents.
    from tests.helpers import backward_both_after_equal_outputs, build_backbone, packed_batch, perturb_residual_params_alike

    torch.manual_seed(0)
    ref = build_backbone(name, vocab=37, n_blocks=2, residual_overrides=("residual.kernels=[2,3]", *extra))
    torch.manual_seed(0)
    fused = build_backbone(name, vocab=37, n_blocks=2,
                           residual_overrides=("residual.kernels=[2,3]", "residual.backend=triton", *extra))
    perturb_residual_params_alike(ref, fused)
    tokens, docs = packed_batch(1, 11, 37, n_docs=2)
    for n, a, b in backward_both_after_equal_outputs(ref, fused, tokens, docs):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", ["msar", "msar_block"])
def test_fused_reads_take_their_sources_in_place(name, monkeypatch):
    # The fused read (residual.backend=triton, under the interpreter) hands the op its sources as a SourceBuffer's
    # rows plus, in an open block, the partial (BufferedSources): every read, as many sources as the variant attends
    # over, and nothing stacked per read (the op reads the rows in place: tests/kernels/test_msar_attn.py).
    from kernels.msar_attn import BufferedSources, fused
    from tests.helpers import build_backbone, packed_batch

    from kernels.depth_attn.buffer import RowGradients

    seen, taken = [], []
    inner, inner_take = fused.msar, RowGradients.take

    def spy(x, *args, **kwargs):
        seen.append(x)
        return inner(x, *args, **kwargs)

    def spy_take(self, row, grad):
        out = inner_take(self, row, grad)
        taken.append((row, grad is None, out is not None))
        return out

    monkeypatch.setattr(fused, "msar", spy)
    monkeypatch.setattr(RowGradients, "take", spy_take)
    model = build_backbone(name, vocab=37, n_blocks=2, residual_overrides=("residual.kernels=[2,3]",
                                                                        "residual.backend=triton"))
    tokens, docs = packed_batch(1, 9, 37, n_docs=2)
    model(tokens, docs).float().square().mean().backward()
    res = model.residual
    assert [type(x) for x in seen] == [BufferedSources] * (res.n_sublayers + 1)
    assert [len(x) for x in seen] == [res.n_sources(c) for c in range(res.n_sublayers + 1)]
    assert all(x.buffer is seen[0].buffer for x in seen)  # one buffer per forward
    # every row's gradient arrives summed in the buffer's RowGradients, none through autograd (no sum per reader)
    rows = len(seen[-1].rows)
    assert sorted(row for row, _, _ in taken) == list(range(rows))
    assert all(from_autograd_none and summed for _, from_autograd_none, summed in taken), taken


def fused_backbone(name: str, *overrides: str):
    """A 2-block backbone whose MSAR read is the fused op (kernels [2, 3], the interpreter on the CPU), its residual's
    parameters off their init."""
    from tests.helpers import build_backbone

    model = build_backbone(name, vocab=37, n_blocks=2,
                           residual_overrides=("residual.kernels=[2,3]", "residual.backend=triton", *overrides))
    randomize(model.residual)
    return model


def test_block_msar_casts_its_partial_where_it_sums_it(monkeypatch):
    # msar_block's fused read over a bf16 buffer (residual.source_dtype=bfloat16, fp32 stream) takes the open block's
    # partial in bf16: cast by the write that sums it (BlockSummaries.cast_partial_in_write, a candidate; a compiled
    # graph fuses the cast with the sum) or by each read (the default). Either way the op gets the same values: the
    # outputs and every gradient are equal to the bit; cast by the write, the partial reaches the op already in bf16.
    from kernels.msar_attn import fused
    from residuals.attnres_block import BlockSummaries
    from tests.helpers import packed_batch, runs_on_and_off

    inner, dtypes = fused.msar, []

    def spy(x, *args, **kwargs):
        dtypes.append(None if x.partial is None else x.partial.dtype)
        return inner(x, *args, **kwargs)

    def build():
        return fused_backbone("msar_block", "residual.source_dtype=bfloat16", "residual.block_size=4")

    monkeypatch.setattr(fused, "msar", spy)
    tokens, docs = packed_batch(1, 9, 37, n_docs=2)
    (out_w, grads_w, seen_w), (out_r, grads_r, seen_r) = runs_on_and_off(
        monkeypatch, BlockSummaries, "cast_partial_in_write", build, tokens, docs, dtypes)
    assert torch.bfloat16 in seen_w and torch.float32 not in seen_w, seen_w  # partials arrive cast by the write
    assert torch.float32 in seen_r and torch.bfloat16 not in seen_r, seen_r  # ... or as the stream holds them
    assert [d is None for d in seen_w] == [d is None for d in seen_r]  # the same reads with and without a partial
    assert torch.equal(out_w, out_r)
    assert grads_w.keys() == grads_r.keys() and any(n.startswith("residual.") for n in grads_w)
    for n in grads_w:
        assert torch.equal(grads_w[n], grads_r[n]), n


@pytest.mark.parametrize("name, taps, view", [("msar", "per_sublayer", "conv"), ("msar_block", "per_block", "conv"),
                                              ("msar_block", "shared", "conv"),
                                              ("msar_block", "per_sublayer", "identity")])
def test_fused_reads_take_their_parameters_sliced_once_a_forward(name, taps, view, monkeypatch):
    # Msar.params_once: the fused read's per-consumer parameters (query, key gain, taps, φ, α, b) are views made by one
    # unbind of each parameter a forward, so that every read's slice of a parameter hangs off that parameter's one
    # backward node (not a select per read, whose backward is a whole-parameter gradient of zeros per read). The same
    # outputs and gradients to the bit as the reads slicing their own, shared taps (per_block, shared) included.
    from kernels.msar_attn import fused
    from residuals.msar import Msar
    from tests.helpers import packed_batch, runs_on_and_off

    inner, nodes = fused.msar, []

    def spy(x, taps_, queries, gain, doc_ids, phi, alpha, bias, **kwargs):
        nodes.append([t.grad_fn for t in (queries, gain, phi, alpha, bias, *taps_) if t.grad_fn is not None])
        return inner(x, taps_, queries, gain, doc_ids, phi, alpha, bias, **kwargs)

    def build():
        return fused_backbone(name, f"residual.taps={taps}", f"residual.view={view}")

    monkeypatch.setattr(fused, "msar", spy)
    tokens, docs = packed_batch(2, 11, 37, n_docs=3)
    (out_1, grads_1, nodes_1), (out_r, grads_r, nodes_r) = runs_on_and_off(
        monkeypatch, Msar, "params_once", build, tokens, docs, nodes)
    n_reads = 4 + 1  # 2 Transformer blocks: 4 sublayers and the final output
    assert len(nodes_1) == len(nodes_r) == n_reads
    # once a forward: one unbind node a parameter, shared by every read; per read: a select of its own each read
    assert {type(g).__name__ for x in nodes_1 for g in x} == {"UnbindBackward0"}, nodes_1[0]
    assert len({id(g) for x in nodes_1 for g in x}) == len(nodes_1[0])  # the same nodes in every read
    assert {type(g).__name__ for x in nodes_r for g in x} == {"SelectBackward0"}, nodes_r[0]
    assert len({id(g) for x in nodes_r for g in x}) == sum(map(len, nodes_r))
    assert torch.equal(out_1, out_r)
    assert grads_1.keys() == grads_r.keys() and any(".conv_taps." in n for n in grads_1) == (view == "conv")
    assert any(n.endswith("fusion_proj") for n in grads_1)
    for n in grads_1:
        assert torch.equal(grads_1[n], grads_r[n]), n


@pytest.mark.parametrize("name, taps", [("msar", "per_sublayer"), ("msar_block", "per_block"),
                                         ("msar_block", "shared")])
def test_fused_reads_take_what_the_step_packed(name, taps, monkeypatch):
    # Msar.pack_step (the default since 2026-12-07): every fused read's packed taps, folded queries, φᵀ and document
    # window are made once a step at ``begin`` for every consumer (kernels.msar_attn.pack_reads), shared taps
    # gathered by consumer, and no read makes its own; the outputs and every gradient equal the reads packing their
    # own, to the bit.
    from kernels.msar_attn import fused
    from residuals.msar import Msar
    from tests.helpers import packed_batch, runs_on_and_off

    calls = []
    for fn in ("pack_taps", "folded_queries", "_mixer_params", "doc_window"):
        inner = getattr(fused, fn)
        monkeypatch.setattr(fused, fn, lambda *a, _f=inner, _n=fn, **k: calls.append(_n) or _f(*a, **k))

    def build():
        return fused_backbone(name, f"residual.taps={taps}")

    tokens, docs = packed_batch(2, 11, 37, n_docs=3)
    (out_1, grads_1, calls_1), (out_0, grads_0, calls_0) = runs_on_and_off(
        monkeypatch, Msar, "pack_step", build, tokens, docs, calls)
    n_reads = 4 + 1  # 2 Transformer blocks: 4 sublayers and the final output
    # each once a step, at begin (pack_reads over every consumer), none by a read
    assert sorted(calls_1) == sorted(["pack_taps", "folded_queries", "_mixer_params", "doc_window"]), calls_1
    assert sorted(calls_0) == sorted(["pack_taps", "folded_queries", "_mixer_params", "doc_window"] * n_reads), calls_0
    assert torch.equal(out_1, out_0)
    assert grads_1.keys() == grads_0.keys() and any(".conv_taps." in n for n in grads_1)
    for n in grads_1:
        assert torch.equal(grads_1[n], grads_0[n]), n


@pytest.mark.slow
@pytest.mark.parametrize("pack_step", [False, True], ids=["", "pack-step"])
@pytest.mark.parametrize("name", ["msar", "msar_block"])
def test_buffered_fused_reads_trace_under_torch_compile(name, pack_step, monkeypatch):
    # The whole-forward compile (trainer.compile_scope=model) over the buffered read: Dynamo (its eager backend:
    # the tracing, not Inductor) breaks the graph only at the buffer's store and at the read, which runs as one
    # eager call (`residuals.attnres.eager`, both torch.compiler.disable'd: test_model.py shows why), and the compiled
    # forward and backward equal the eager ones (bf16 autocast, as the compiled grouped GEMM wants on the CPU). With
    # Msar.pack_step the reads' packed parameters, made at begin's eager call, pass through the compiled forward too.
    from residuals.msar import Msar
    from tests.helpers import build_backbone, packed_batch

    monkeypatch.setattr(Msar, "pack_step", pack_step)

    torch.manual_seed(0)
    model = build_backbone(name, vocab=37, n_blocks=2, residual_overrides=("residual.kernels=[2,3]",
                                                                        "residual.backend=triton"))
    tokens, docs = packed_batch(1, 9, 37, n_docs=2)
    upstream = torch.randn(1, 9, 37, generator=torch.Generator().manual_seed(5))

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tokens, docs)
        out.float().backward(upstream)
        return [out.float().detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]

    eager = run()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.trunk = torch.compile(model.trunk, backend="eager")
    compiled = run()
    reasons = list(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()
    assert len(compiled) == len(eager) and all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert all("torch.compiler.disable" in r for r in reasons), reasons  # no other break
    assert any("SourceBuffer.append" in r for r in reasons) and any("function eager" in r for r in reasons), reasons


def test_fused_kernel_refuses_what_it_does_not_compute():
    from tests.helpers import make_cfg
    from platform.config import validate

    for extra in ("residual.view=scalar", "residual.placement=post", "residual.expand_values=false",
                  "residual.query=input", "residual.kernels=[4,17]"):
        with pytest.raises(ValueError, match=r"residual.backend='triton'.*use residual.backend=torch or auto"):
            validate(make_cfg("residual=msar_block", "residual.backend=triton", extra))


# --- placement=post (attnres_conv): Block AttnRes's two-phase depth attention, then the MSAR op over one source --
def _record_backends(monkeypatch, force_triton: bool = False) -> list[tuple[str, str]]:
    """Record (op, requested backend) of every depth_attn / msar_attn call; with force_triton, `auto`
    resolves to the fused kernels (what it does on CUDA; on CPU tensors under the interpreter)."""
    import kernels.depth_attn
    import kernels.msar_attn

    asked = []
    for module in (kernels.depth_attn, kernels.msar_attn):
        def resolve(b, x, op, _original=module.resolve_backend):
            asked.append((op, b))
            return "triton" if force_triton and b == "auto" else _original(b, x, op)

        monkeypatch.setattr(module, "resolve_backend", resolve)
    return asked


@pytest.mark.parametrize("backend, query, asked", [
    ("auto", "static", {("depth_attn_summaries", "auto"), ("depth_attn_merge", "auto"), ("msar_attn", "auto")}),
    ("torch", "static", {("depth_attn", "torch")}),
    ("auto", "input", {("depth_attn", "torch")})])
def test_post_placement_dispatch(backend, query, asked, monkeypatch):
    # `auto` lets the kernels pick (fused on CUDA): Block AttnRes's two-phase depth attention (phase 1 per
    # block, merge per sublayer) and the MSAR op over one source; `torch` and per-token queries keep the
    # reference.
    seen = _record_backends(monkeypatch)
    res = make("msar_block", placement="post", backend=backend, query=query, block_size=2)
    FakeStack()(res, embedding(), Context(DOC_IDS))
    # (a kernel's reference may call another kernel's reference with backend='torch': not the residual's ask)
    assert asked <= set(seen) and {b for _, b in seen} <= {b for _, b in asked} | {"torch"}


def _post_pair(monkeypatch, force_triton: bool):
    fields = {"placement": "post", "block_size": 2, "taps": "per_block"}
    ref = randomize(make("msar_block", **fields, backend="torch"))
    other = make("msar_block", **fields, backend="auto")
    other.load_state_dict(ref.state_dict())
    seen = _record_backends(monkeypatch, force_triton)
    assert_backends_agree(ref, other)
    assert "view0" in other.recorded
    assert {op for op, b in seen if b == "auto"} == {"depth_attn_summaries", "depth_attn_merge", "msar_attn"}


def test_post_placement_through_the_kernels_references_matches_the_residuals_reference(monkeypatch):
    # On CPU `auto` runs the two kernels' references: the MSAR op over the one source h equals the
    # residual's own views of h and its mixer (reads, recorded weights, output, every gradient).
    _post_pair(monkeypatch, force_triton=False)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on CPU tensors need TRITON_INTERPRET=1")
def test_post_placement_through_the_fused_kernels_matches_the_reference(monkeypatch):
    # What `auto` runs on CUDA, here under the interpreter: both fused kernels in the post path.
    _post_pair(monkeypatch, force_triton=True)


@pytest.mark.parametrize("name", ["msar", "msar_block"])
@pytest.mark.parametrize("source_dtype", ["stream", "bfloat16", "autocast"])
def test_the_fused_reads_keep_their_sources_in_the_buffers_dtype(name, source_dtype, monkeypatch):
    """``residual.source_dtype`` on the fused one-pass reads (under bf16 autocast, as a GPU trains): the buffer is bf16
    for bfloat16 and autocast, and each read then keeps the open block's partial in bf16 too (it reads it through the
    buffer's address; msar_block's partials are its largest kept term beyond vanilla's), while every read still hands
    its sublayer h in the stream's fp32 and the stream's gradients stay fp32."""
    from kernels.msar_attn import fused
    from tests.helpers import build_backbone, packed_batch

    outs, partials = [], []
    inner = fused.msar

    def spy(x, *args, **kwargs):
        h = inner(x, *args, **kwargs)
        outs.append((x.buffer.data.dtype, h.dtype))
        partials.append(x.partial is not None)
        return h

    monkeypatch.setattr(fused, "msar", spy)
    model = build_backbone(name, vocab=37, n_blocks=2, attention="sdpa",
                           residual_overrides=("residual.kernels=[2,3]", "residual.backend=triton",
                                               f"residual.source_dtype={source_dtype}"))
    tokens, docs = packed_batch(1, 9, 37, n_docs=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, docs).float().square().mean()
    narrow = torch.bfloat16 if source_dtype != "stream" else torch.float32
    assert outs and set(outs) == {(narrow, torch.float32)}, set(outs)
    kept, seen, todo = [], set(), [loss.grad_fn]  # what every read keeps for its backward (B, T, d)-shaped
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "MsarFunctionBackward":
            kept += [t.dtype for t in node.saved_tensors if t is not None and t.shape == (1, 9, model.residual.d_model)]
        todo += [n for n, _ in node.next_functions]
    assert sorted(kept, key=str) == [narrow] * sum(partials), kept  # msar_block: consumers 1-3 of its one block
    loss.backward()
    assert model.embed.weight.grad.dtype == torch.float32 and torch.isfinite(model.embed.weight.grad).all()
