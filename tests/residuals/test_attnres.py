"""AttnRes and Block AttnRes (docs/method.md §3) through a fake stack of sublayers.

The fake stack (also used by test_msar.py) has L sublayers that are small random per-token linear
maps; the even ones ("attention") also take a causal mean over earlier tokens of the same document,
so a leak across tokens or documents anywhere in a mechanism shows up in the final output.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import Tensor, nn

from kernels.depth_attn import depth_attn
from residuals import Context, config_for, get, names

D, L, B, T = 16, 8, 2, 11
# two packed rows, several documents each
DOC_IDS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2],
                        [5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7]])


def make(name: str, d: int = D, n_sublayers: int = L, **fields):
    return get(name)(config_for(name, **fields), d, n_sublayers)


def doc_causal_mean(x: Tensor, doc_ids: Tensor) -> Tensor:
    """(B, T, d): mean over the earlier tokens (and itself) of the same document."""
    n = x.shape[1]
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return (allowed.to(x.dtype) / allowed.sum(-1, keepdim=True)) @ x


class FakeStack(nn.Module):
    def __init__(self, d: int = D, n_sublayers: int = L, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.maps = nn.ModuleList(nn.Linear(d, d) for _ in range(n_sublayers))

    def forward(self, res, embedding: Tensor, ctx: Context):
        """Returns (final output, reads h_0..h_{L-1} + final, outputs v_1..v_L, states after each write)."""
        state = res.begin(embedding, ctx)
        reads, outs, states = [], [], []
        for layer, f in enumerate(self.maps):
            h = res.read(state, layer)
            out = f(h)
            if layer % 2 == 0:
                out = doc_causal_mean(out, ctx.doc_ids)
            state = res.write(state, layer, out)
            reads.append(h), outs.append(out), states.append(state)
        final = res.end(state)
        return final, reads + [final], outs, states


def embedding(seed: int = 1, dtype=torch.float32, d: int = D) -> Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Move every parameter off its init (a test at init alone would miss the queries)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.1 / p.shape[-1] ** 0.5 if name.endswith("proj") else 0.5
            p.add_(scale * torch.randn(p.shape, generator=g))
    return module


def block_sources(emb: Tensor, outs: list[Tensor], consumer: int, block_size: int) -> list[Tensor]:
    """What consumer l attends over, written from docs/method.md §3: [b_0, completed summaries, partial]."""
    n, pos = divmod(consumer, block_size)
    summaries = [emb] + [sum(outs[b * block_size:(b + 1) * block_size]) for b in range(n)]
    return summaries + ([sum(outs[n * block_size:consumer])] if pos else [])


def held_tensors(state) -> list[Tensor]:
    """Every tensor a state holds between sublayers (the context aside)."""
    held = []
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if f.name != "ctx":
            held += [v for v in (value if isinstance(value, (tuple, list)) else [value]) if v is not None]
    assert all(isinstance(v, Tensor) for v in held)
    return held


def grads_through_stack(res, stack: FakeStack, seed: int = 3) -> tuple[Tensor, dict[str, Tensor]]:
    """Final output, and by name the gradients of a random projection of it (random upstream
    gradient) w.r.t. the embedding, the mechanism's parameters and the stack's."""
    emb = embedding().requires_grad_()
    final, *_ = stack(res, emb, Context(DOC_IDS))
    upstream = torch.randn(final.shape, generator=torch.Generator().manual_seed(seed))
    named = {"embedding": emb, **{f"res.{k}": p for k, p in res.named_parameters()},
             **{f"stack.{k}": p for k, p in stack.named_parameters()}}
    grads = torch.autograd.grad((final * upstream).sum(), list(named.values()))
    return final, dict(zip(named, grads))


def assert_same_grads(a: dict[str, Tensor], b: dict[str, Tensor], names=None) -> None:
    names = sorted(a) if names is None else names
    assert names and set(names) <= set(a) & set(b)
    for k in names:  # atol relative to the tensor's largest entry: fp32 sums in another order differ by ~1e-6 of it
        atol = max(1e-6, 5e-6 * b[k].abs().max().item())
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=atol, msg=k)


def assert_causal(res, d: int = D) -> None:
    """Perturbing token t of a document changes no output before t nor in any other document."""
    stack = FakeStack(d)
    emb = embedding(d=d)
    with torch.no_grad():
        base, *_ = stack(res, emb, Context(DOC_IDS))
        for t in (2, 5, 8):  # inside a document, at a document start, inside another document
            emb2 = emb.clone()
            emb2[0, t] += 3 * torch.randn(d)
            out, *_ = stack(res, emb2, Context(DOC_IDS))
            diff = (out - base).abs().amax(-1)  # (B, T)
            may_change = torch.zeros(B, T, dtype=torch.bool)
            may_change[0] = (DOC_IDS[0] == DOC_IDS[0, t]) & (torch.arange(T) >= t)
            assert diff[~may_change].max() <= 1e-6, f"token {t} leaked: {diff}"
            assert diff[0, t] > 1e-4


ATTNRES = [
    ("attnres", {}),
    ("attnres", {"heads": 4}),
    ("attnres", {"key_norm": False}),
    ("attnres", {"query": "input"}),
    ("attnres_block", {}),
    ("attnres_block", {"block_size": 2, "heads": 2}),
    ("attnres_block", {"block_size": 8, "query": "input"}),
    ("attnres_block", {"block_size": 1}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in f.items()) or 'default'}" for n, f in ATTNRES]


def sources_of(name: str, fields: dict, emb: Tensor, outs: list[Tensor], consumer: int) -> list[Tensor]:
    size = fields.get("block_size", 4) if name == "attnres_block" else 1
    return block_sources(emb, outs, consumer, size)


@pytest.mark.parametrize("name, fields", ATTNRES, ids=IDS)
def test_init_reads_the_plain_mean_of_the_sources(name, fields):
    res, emb = make(name, **fields), embedding()
    _, reads, outs, _ = FakeStack()(res, emb, Context(DOC_IDS))
    for consumer, h in enumerate(reads):
        expected = torch.stack(sources_of(name, fields, emb, outs, consumer)).mean(0)
        torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-6, msg=f"consumer {consumer}")


@pytest.mark.parametrize("name, fields", [c for c in ATTNRES if "heads" not in c[1] and "query" not in c[1]],
                         ids=[i for i, c in zip(IDS, ATTNRES) if "heads" not in c[1] and "query" not in c[1]])
def test_trained_reads_are_depth_attention_over_the_right_sources(name, fields):
    res, emb = randomize(make(name, **fields)), embedding()
    with torch.no_grad():
        _, reads, outs, _ = FakeStack()(res, emb, Context(DOC_IDS))
        for consumer, h in enumerate(reads):
            key_norm = fields.get("key_norm", True)
            gain = res.queries.key_gain[consumer] if key_norm else None
            expected = depth_attn(sources_of(name, fields, emb, outs, consumer), res.queries.weight[consumer],
                                  gain, key_norm=key_norm)[0]
            torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-5, msg=f"consumer {consumer}")


@pytest.mark.parametrize("fields", [{}, {"heads": 2}, {"query": "input"}, {"key_norm": False}],
                         ids=["default", "heads=2", "query=input", "key_norm=False"])
def test_block_size_one_is_full_attnres(fields):
    assert_block_size_one_is_full("attnres", "attnres_block", fields)


def assert_block_size_one_is_full(full_name: str, block_name: str, fields: dict) -> None:
    """With one sublayer per block, the block variant computes exactly the full one (outputs, grads)."""
    torch.manual_seed(0)  # the stack's and the mechanism's init: the same inputs every run
    full = randomize(make(full_name, **fields))
    block = make(block_name, block_size=1, **fields)
    block.load_state_dict(full.state_dict())
    stack = FakeStack()
    out_full, grads_full = grads_through_stack(full, stack)
    out_block, grads_block = grads_through_stack(block, stack)
    torch.testing.assert_close(out_block, out_full, rtol=1e-6, atol=1e-6)
    assert sorted(grads_block) == sorted(grads_full)
    assert_same_grads(grads_block, grads_full)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_block_state_holds_summaries_and_partial_only(block_size):
    assert_block_state_is_single_stream("attnres_block", block_size)


def assert_block_state_is_single_stream(name: str, block_size: int) -> None:
    """Between sublayers a block variant holds b_0, the completed summaries and the partial sum,
    each (B, T, d) (no view or stream axis), and reports that count as its state."""
    res = make(name, block_size=block_size)
    _, _, _, states = FakeStack()(res, embedding(), Context(DOC_IDS))
    counts = []
    for layer, state in enumerate(states):
        held = held_tensors(state)
        completed, in_block = divmod(layer + 1, block_size)
        assert len(held) == 1 + completed + (in_block > 0)  # b_0, completed summaries, partial
        assert all(t.shape == (B, T, D) for t in held)
        counts.append(len(held))
    assert max(counts) == res.state_per_token() == L // block_size + 1


def test_full_state_holds_every_source():
    res = make("attnres")
    _, _, _, states = FakeStack()(res, embedding(), Context(DOC_IDS))
    assert [len(held_tensors(s)) for s in states] == list(range(2, L + 2))
    assert res.state_per_token() == L + 1


@pytest.mark.parametrize("name, fields", ATTNRES, ids=IDS)
def test_causal_across_packed_documents(name, fields):
    assert_causal(randomize(make(name, **fields)))


@pytest.mark.parametrize("name, fields", [("attnres", {}), ("attnres", {"heads": 2}), ("attnres_block", {})],
                         ids=["attnres", "attnres-heads=2", "attnres_block"])
def test_recorded_weights_per_view(name, fields):
    res = make(name, **fields)
    FakeStack()(res, embedding(), Context(DOC_IDS, record=True))
    assert sorted(res.recorded) == [f"view{j}" for j in range(fields.get("heads", 1))]
    n_max = res.n_sources(L)
    for table in res.recorded.values():
        assert table.shape == (n_max, L + 1)
        for consumer in range(L + 1):
            n = res.n_sources(consumer)
            torch.testing.assert_close(table[:n, consumer], torch.full((n,), 1 / n))  # mean at init
            assert (table[n:, consumer] == 0).all()


@pytest.mark.parametrize("name", ["attnres", "attnres_block"])
def test_low_precision_in_same_dtype_out(name):
    res = randomize(make(name))
    stack = FakeStack().to(torch.bfloat16)
    final, reads, _, _ = stack(res, embedding(dtype=torch.bfloat16), Context(DOC_IDS))
    assert final.dtype == torch.bfloat16 and all(h.dtype == torch.bfloat16 for h in reads)
    assert torch.isfinite(final.float()).all()


def test_accounting():
    full, block = make("attnres"), make("attnres_block", block_size=4)
    per_source = 8 * D + 5  # key RMSNorm 4d, logit 2d, softmax 5, weighted sum 2d
    assert full.extra_flops_per_token() == per_source * sum(c + 1 for c in range(L + 1))
    assert block.extra_flops_per_token() == per_source * sum(block.n_sources(c) for c in range(L + 1))
    assert full.state_per_token() == L + 1 and block.state_per_token() == L // 4 + 1
    # N = 2 blocks of S = 4: N/S = 0.5, the paper's (N/S + 5)·d = 5.5d
    assert block.io_per_sublayer() == 5.5
    assert full.io_per_sublayer() == (L + 1) / 2 + 1  # read the 1..L sources (mean), write h
    assert sum(p.numel() for p in full.parameters()) == 2 * D * (L + 1)  # query + key gain per consumer
    assert make("attnres", key_norm=False).extra_flops_per_token() < full.extra_flops_per_token()
    assert make("attnres", query="input").extra_flops_per_token() > full.extra_flops_per_token()


@pytest.mark.parametrize("name, fields, match", [
    ("attnres", {"heads": 3}, r"residual.heads=3 must divide d_model=16 .*choose one of: 1, 2, 4, 8, 16$"),
    ("attnres", {"heads": 0}, r"residual.heads=0"),
    ("attnres", {"query": "dynamic"}, r"residual.query='dynamic' is not valid for residual=attnres; choose one of: static, input$"),
    ("attnres_block", {"block_size": 3}, r"residual.block_size=3 .* choose one of: 1, 2, 4, 8$"),
    ("attnres_block", {"block_size": 6}, r"residual.block_size=6 .*divide n_sublayers=8"),
    ("attnres_block", {"block_size": 0}, r"residual.block_size=0"),
    ("attnres_block", {"heads": 5}, r"residual.heads=5"),
], ids=["heads-not-dividing", "heads-zero", "query", "odd-block", "block-not-dividing", "block-zero", "block-heads"])
def test_bad_config_values(name, fields, match):
    cfg = config_for(name, **fields)
    with pytest.raises(ValueError, match=match):
        get(name).validate(cfg, d_model=D, n_sublayers=L)
    with pytest.raises(ValueError, match=match):
        get(name)(cfg, D, L)


# --- the fused backend (kernels/depth_attn, two-phase schedule; TRITON_INTERPRET=1 on CPU) ----------
FUSED = [
    ("attnres", {}),
    ("attnres", {"key_norm": False}),
    ("attnres_block", {}),
    ("attnres_block", {"block_size": 2, "key_norm": False}),
    ("attnres_block", {"block_size": 8}),
    ("attnres_block", {"block_size": 1}),
]
FUSED_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in f.items()) or 'default'}" for n, f in FUSED]
# backend=triton on CPU tensors runs only under the interpreter (set by conftest.py without CUDA)
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")


def assert_backends_agree(ref, other) -> None:
    """Two mechanisms with the same parameters on different backends, through the fake stack: every
    read, the recorded weights, the final output and every gradient (embedding, the mechanism's
    parameters, the stack's weights) with a random upstream gradient."""
    stack = FakeStack()
    with torch.no_grad():
        _, reads_ref, _, _ = stack(ref, embedding(), Context(DOC_IDS, record=True))
        _, reads_other, _, _ = stack(other, embedding(), Context(DOC_IDS, record=True))
    for consumer, (a, b) in enumerate(zip(reads_other, reads_ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"consumer {consumer}")
    assert sorted(other.recorded) == sorted(ref.recorded)
    for view in ref.recorded:
        torch.testing.assert_close(other.recorded[view], ref.recorded[view], rtol=1e-5, atol=1e-6, msg=view)
    out_ref, grads_ref = grads_through_stack(ref, stack)
    out_other, grads_other = grads_through_stack(other, stack)
    torch.testing.assert_close(out_other, out_ref, rtol=1e-5, atol=1e-5)
    for k in sorted(grads_ref):
        torch.testing.assert_close(grads_other[k], grads_ref[k], rtol=1e-4, atol=1e-5, msg=k)


@needs_interpreter
@pytest.mark.parametrize("name, fields", FUSED, ids=FUSED_IDS)
def test_fused_backend_matches_the_reference(name, fields):
    ref = randomize(make(name, **fields, backend="torch"))
    fused = make(name, **fields, backend="triton")
    fused.load_state_dict(ref.state_dict())
    assert_backends_agree(ref, fused)
    assert sorted(fused.recorded) == ["view0"]


@needs_interpreter
def test_fused_state_keeps_sources_in_one_buffer():
    # Block AttnRes on the fused path: b_0 and the completed summaries are rows of one preallocated
    # buffer (never re-stacked); each row holds exactly the block sum.
    res = make("attnres_block", block_size=2, backend="triton")
    emb = embedding()
    _, _, outs, states = FakeStack()(res, emb, Context(DOC_IDS))
    buffer = states[-1].buffer
    assert all(s.buffer is buffer for s in states) and buffer.data.shape == (L // 2 + 1, B, T, D)
    for n, row in enumerate(buffer.rows):
        expected = emb if n == 0 else outs[2 * n - 2] + outs[2 * n - 1]
        torch.testing.assert_close(buffer.data[n], expected.detach(), rtol=1e-6, atol=1e-6)
        assert row.data_ptr() == buffer.data[n].data_ptr()


@pytest.mark.parametrize("name, fields", [("attnres", {"heads": 2}), ("attnres", {"query": "input"}),
                                          ("attnres_block", {"heads": 4}), ("attnres_block", {"query": "input"})],
                         ids=["attnres-heads", "attnres-query", "block-heads", "block-query"])
def test_fused_backend_refuses_what_it_does_not_compute(name, fields):
    cfg = config_for(name, **fields, backend="triton")
    match = r"residual.backend='triton'.*needs heads=1, query=static.*use residual.backend"
    with pytest.raises(ValueError, match=match):
        get(name).validate(cfg, d_model=D, n_sublayers=L)
    assert not make(name, **fields).fused_covers()  # auto runs the reference for them


@needs_interpreter
@pytest.mark.parametrize("name, overrides", [("attnres", ()), ("attnres", ("residual.key_norm=false",)),
                                             ("attnres_block", ()), ("attnres_block", ("residual.block_size=2",)),
                                             ("attnres", ("residual.merge_backend=torch",)),
                                             ("attnres_block", ("residual.merge_backend=torch",))],
                         ids=["attnres", "attnres-raw-keys", "attnres_block", "attnres_block-size=2",
                              "attnres-torch-merge", "attnres_block-torch-merge"])
def test_fused_kernel_backend_matches_the_reference_in_the_backbone(name, overrides):
    # The whole backbone with residual.backend=triton (under Triton's interpreter on CPU) against the
    # PyTorch reference, with checkpoint_reads on for the fused one: outputs and every gradient. With
    # residual.merge_backend=torch the fused phase 1 feeds the PyTorch merge.
    check_fused_backbone_against_the_reference(name, overrides, "cpu", "triton", B=1, T=11, checkpoint_reads=True)


def check_fused_backbone_against_the_reference(name, overrides, device, backend, B, T, checkpoint_reads=False,
                                               tol=1e-4):
    """fp32 backbone on ``device``: ``residual.backend=backend`` (``checkpoint_reads`` for it) against
    ``backend=torch``; the fused one's state is the fused one; outputs and every gradient, each within a
    norm-wise relative ``tol``. Returns the largest relative error."""
    from tests.helpers import (backward_both_after_equal_outputs, build_backbone, packed_batch,
                               perturb_residual_params_alike, rel_err)

    torch.manual_seed(0)
    # SDPA attention: the comparison is of the residual, and FlexAttention's compiled kernel finds no
    # valid configuration for this fp32 backbone on an H200 (inductor NoValidChoicesError).
    ref = build_backbone(name, vocab=37, n_blocks=2, attention="sdpa",
                         residual_overrides=(*overrides, "residual.backend=torch")).to(device)
    torch.manual_seed(0)
    fused = build_backbone(name, vocab=37, n_blocks=2, attention="sdpa",
                           residual_overrides=(*overrides, f"residual.backend={backend}"),
                           checkpoint_reads=checkpoint_reads).to(device)
    perturb_residual_params_alike(ref, fused)
    tokens, docs = (t.to(device) for t in packed_batch(B, T, 37, n_docs=2 if T < 13 else 3))
    state = fused.residual.begin(fused.embed(tokens), Context(docs))
    # the fused path's state holds the source buffer (the two-phase FusedState, or MSAR's one-pass reads over it)
    assert getattr(state, "buffer", None) is not None, type(state)
    params = backward_both_after_equal_outputs(ref, fused, tokens, docs, norm_tol=None if tol <= 1e-4 else tol)
    # Gradients span 1e-3..1e2 within one tensor (the embedding's rows sum over tokens): element-wise
    # rtol=1e-3, atol=1e-5 sits at the backbone's own fp32 rounding (the fp32 reference against fp64
    # spends ~40% of it; fused against reference exceeds it for 2 of 4 seeds at B=2, T=67 on CPU).
    # Norm-wise relative error: ~1e-6 from rounding; a 1% error in one consumer's query gradient
    # gives ~2e-3.
    worst = 0.0
    for n, a, b in params:
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            err = rel_err(b.grad, a.grad)
            worst = max(worst, err)
            assert err < tol, f"{n}: relative error {err:.2e} (max abs {(b.grad - a.grad).abs().max().item():.2e})"
    return worst


@needs_interpreter
@pytest.mark.parametrize("name, overrides", [("attnres", ()), ("attnres_block", ("residual.block_size=2",))],
                         ids=["attnres", "attnres_block-size=2"])
def test_fused_backend_matches_the_reference_in_a_two_row_backbone(name, overrides):
    # The GPU test's body on CPU (backend=triton under the interpreter), two packed rows.
    check_fused_backbone_against_the_reference(name, overrides, "cpu", "triton", B=2, T=13)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, overrides", [("attnres", ()), ("attnres_block", ()),
                                             ("attnres_block", ("residual.block_size=2",))],
                         ids=["attnres", "attnres_block", "attnres_block-size=2"])
def test_gpu_auto_backend_is_the_fused_op_and_matches_the_reference(name, overrides):
    # On CUDA, backend=auto runs the fused op (its state is the fused one).
    check_fused_backbone_against_the_reference(name, overrides, "cuda", "auto", B=2, T=67)


@needs_interpreter
@pytest.mark.parametrize("apart", [True, False])
@pytest.mark.parametrize("mode", ["fp32", "autocast-delta-from-sources", "autocast-bf16-sources"])
@pytest.mark.parametrize("name, overrides", [("attnres", ()), ("attnres_block", ("residual.block_size=4",))])
def test_fused_path_keeps_no_group_of_phase_one_outputs_for_backward(name, overrides, mode, apart, monkeypatch):
    """Phase 1 writes the outputs of consumers 1 .. C-1 of a group into one (C - 1, B, T, d) tensor and consumer 0's
    into a tensor of its own. For backward the merges keep their own output, not the phase-1 output they read, and
    the read without a merge hands its sublayer consumer 0's tensor as it is (no copy): no autograd node keeps the
    group's shared phase-1 tensor, so it is freed when the next group opens (before, every group's C outputs lived
    until the backward; `python -m benchmarks.saved_bytes`). With ``fused.FIRST_APART=False`` (the way of before)
    all C outputs share one tensor and the residual hands consumer 0 a copy of its output instead. Also under
    bf16 autocast with Block AttnRes's bf16 phase-1 outputs wherever phase 1 does not keep them for its own
    backward: its dO·o taken from the sources (``fused.DELTA_FROM_OUTPUTS=False``), or sources stored in bf16 under
    autocast (``residual.source_dtype=autocast``, Block AttnRes's default: the outputs are then no narrower than the
    sources). (With fp32 sources and dO·o from the outputs, the default, they
    are kept: ``test_merges_keep_the_kept_phase_one_outputs_not_their_own``.)"""
    import contextlib

    from kernels.depth_attn import fused
    from residuals.attnres import DepthAttentionResidual
    from tests.helpers import build_backbone, packed_batch

    autocast = mode != "fp32"
    if autocast:
        monkeypatch.setattr(DepthAttentionResidual, "phase1_dtype", "autocast")  # attnres's too
        if mode == "autocast-delta-from-sources":
            monkeypatch.setattr(fused, "DELTA_FROM_OUTPUTS", False)
        else:  # bf16 sources under autocast (Block AttnRes's default)
            overrides = (*overrides, "residual.source_dtype=autocast")

    monkeypatch.setattr(fused, "FIRST_APART", apart)
    phase_one, firsts = [], []  # held here, so that no later tensor reuses their addresses
    real = fused.summaries

    def recording(*args, **kwargs):
        res = real(*args, **kwargs)
        if args[6].shape[0] > 1:  # C > 1 consumers (args[6]: their queries)
            # consumer 0's output: a tensor of its own, or (not apart) a view of the one tensor of all C
            assert (res[0].untyped_storage().nbytes() == res[0].nbytes) == apart
            phase_one.append(res[1].detach())  # consumers 1 .. C-1: one storage
            firsts.append(res[0].detach())
        return res

    monkeypatch.setattr(fused, "summaries", recording)
    model = build_backbone(name, vocab=37, n_blocks=2, residual_overrides=("residual.backend=triton", *overrides))
    tokens, docs = packed_batch(2, 11, 37)
    kept, inputs = set(), set()
    for sublayer in model.sublayers:  # a sublayer may keep its input as it is (a compiled one does): never a view
        sublayer.register_forward_pre_hook(lambda mod, args: inputs.add(args[0].untyped_storage().data_ptr()))

    def pack(t):
        kept.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
            torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()):
        logits = model(tokens, docs).float()
    assert len(phase_one) == (2 if name == "attnres" else 1)  # the groups of two sublayers, or the one block
    assert {t.dtype for t in phase_one} == {torch.bfloat16 if autocast else torch.float32}
    assert not {t.untyped_storage().data_ptr() for t in phase_one} & (kept | inputs)
    first_ptrs = {t.untyped_storage().data_ptr() for t in firsts}
    if apart:
        assert first_ptrs <= inputs  # handed to its sublayer as it is
    else:
        assert not first_ptrs & (kept | inputs)  # (the same storage as the others': a copy is handed on)
    logits.backward(torch.randn_like(logits))  # and the backward runs from what is kept
    assert all(torch.isfinite(p.grad).all() for p in model.residual.parameters())


class _FullSizeAdds(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the additions whose result is one (B, T, d) tensor, by ATen overload."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.counts = tuple(shape), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith("add") and isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.counts[func.__name__] = self.counts.get(func.__name__, 0) + 1
        return out


@needs_interpreter
def test_fused_block_partial_sums_take_no_separate_add(monkeypatch):
    """On the fused two-phase path Block AttnRes's running partial is summed inside the merge
    (``depth_attn_merge(new=...)``): the forward's only (B, T, d) additions are the block summaries' stores into the
    buffer (one per block), and against the same fused merges with the partial summed apart
    (``BlockSummaries.sum_in_merge=False``), the forward makes S − 2 and the backward S − 1 fewer (B, T, d) additions
    a block (the backward's: autograd's sums of a partial's gradient from its merge and from its later readers).
    Both give the same logits and gradients."""
    from residuals.attnres_block import BlockSummaries
    from tests.helpers import build_backbone, packed_batch, rel_err

    counts, results = {}, {}
    for sum_in_merge in (True, False):
        monkeypatch.setattr(BlockSummaries, "sum_in_merge", sum_in_merge)
        torch.manual_seed(0)
        model = build_backbone("attnres_block", vocab=37, n_blocks=4, attention="sdpa",
                               residual_overrides=("residual.block_size=4", "residual.backend=triton"))
        with torch.no_grad():
            for p in model.residual.parameters():
                p.add_(0.2 * torch.randn_like(p))
        tokens, docs = packed_batch(2, 9, 37)
        shape = (2, 9, model.embed.weight.shape[1])
        with _FullSizeAdds(shape) as fwd:
            logits = model(tokens, docs)
        with _FullSizeAdds(shape) as bwd:
            logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)))
        counts[sum_in_merge] = (sum(fwd.counts.values()), sum(bwd.counts.values()), fwd.counts)
        results[sum_in_merge] = (logits.detach(), [p.grad for p in model.parameters()])
    n_blocks, block_size = 2, 4  # 8 sublayers
    assert counts[True][2] == {"add.out": n_blocks}, counts
    assert counts[False][0] - counts[True][0] == n_blocks * (block_size - 2), counts
    assert counts[False][1] - counts[True][1] == n_blocks * (block_size - 1), counts
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[True][1], results[False][1], strict=True):
        assert (a is None) == (b is None) and (a is None or rel_err(a, b) < 1e-5)


@needs_interpreter
@pytest.mark.parametrize("merge_backend, fused_merges", [("auto", True), ("triton", True), ("torch", False)])
def test_merge_backend_dispatch_is_explicit(merge_backend, fused_merges, monkeypatch):
    """residual.merge_backend picks the op of phase 2 on the two-phase path, whatever phase 1 runs on: with
    "torch" the fused merge is never called (PyTorch ops, traced and compiled in the read's frame under
    torch.compile), with "auto" (backend=triton) and "triton" it is."""
    from kernels.depth_attn import fused
    from tests.helpers import build_backbone, packed_batch

    calls = []
    for op in ("merge", "merge_sum"):  # the merge alone, and the merge that sums Block AttnRes's partial
        real = getattr(fused, op)
        monkeypatch.setattr(fused, op, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    model = build_backbone("attnres_block", vocab=37, n_blocks=2, attention="sdpa",
                           residual_overrides=("residual.backend=triton", "residual.block_size=4",
                                               f"residual.merge_backend={merge_backend}"))
    tokens, docs = packed_batch(1, 9, 37)
    model(tokens, docs).sum().backward()
    assert bool(calls) == fused_merges, (merge_backend, len(calls))


@needs_interpreter
@pytest.mark.parametrize("name, overrides, tol", [("attnres", (), 6e-2), ("attnres_block", (), 1.5e-2),
                                                  ("attnres_block", ("residual.block_size=2",), 1.5e-2),
                                                  ("msar", ("residual.kernels=[2,3]",), 3e-2),
                                                  ("msar_block", ("residual.kernels=[2,3]",), 2.5e-2)],
                         ids=["attnres", "attnres_block", "attnres_block-size=2", "msar", "msar_block"])
def test_bf16_sources_fused_path_matches_the_reference_path(name, overrides, tol):
    """residual.source_dtype=bfloat16: the fused path stores its sources in bf16 (half the bytes of every
    read of them), and the reference path rounds the same sources alike, so the two backends still agree,
    within bf16 rounding rather than fp32's (~1e-6 with the stream's dtype): the fused path also rounds its
    phase-1 outputs (MSAR: its kept streams R) and each source gradient to bf16, which the reference keeps in
    fp32. Measured worst norm-wise errors (a router gradient): 3.1e-2 for full AttnRes (its partial is a buffered
    row too, so the merge runs in bf16), 5.7e-3 for Block AttnRes, 1.5e-2 for MSAR and 1.1e-2 for Block MSAR (whose
    reads take the open block's partial in bf16 too; 1.4e-6 with fp32 sources)."""
    bf16 = (*overrides, "residual.source_dtype=bfloat16")
    check_fused_backbone_against_the_reference(name, bf16, "cpu", "triton", B=1, T=11, tol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["msar", "msar_block"])
def test_gpu_bf16_sources_of_the_fused_msar_read_match_the_reference(name):
    """The body of the interpreter test above on CUDA (``auto``: the fused read), two packed rows of 67 tokens:
    MSAR's reads over a bf16 buffer and a bf16 partial agree with the reference that rounds its sources alike."""
    check_fused_backbone_against_the_reference(name, ("residual.kernels=[2,3]", "residual.source_dtype=bfloat16"),
                                               "cuda", "auto", B=2, T=67, tol=3e-2)


@needs_interpreter
@pytest.mark.parametrize("name, overrides, tol", [("attnres", (), 6e-2), ("attnres_block", (), 1.5e-2),
                                                  ("attnres_block", ("residual.block_size=2",), 1.5e-2)],
                         ids=["attnres", "attnres_block", "attnres_block-size=2"])
def test_bf16_phase_one_outputs_stay_within_bf16_of_the_reference(name, overrides, tol, monkeypatch):
    """``phase1_dtype = "bfloat16"`` (a class attribute of the depth-attention residuals): the two-phase path's
    phase-1 outputs (and their
    gradients) are bf16 while the sources stay fp32. The fused backbone then agrees with the fp32 reference within
    bf16 rounding, with the bounds of the bf16 sources' test above (measured worst norm-wise errors, a norm's
    gradient: 2.5e-2 for full AttnRes, whose every read rounds one, below 1.5e-2 for Block AttnRes), and it does
    round: its worst error is above fp32's (~1e-6)."""
    monkeypatch.setattr(get(name), "phase1_dtype", "bfloat16")
    worst = check_fused_backbone_against_the_reference(name, overrides, "cpu", "triton", B=1, T=11, tol=tol)
    assert worst > 1e-5, worst


@needs_interpreter
@pytest.mark.parametrize("narrow", ["bfloat16", "autocast", "default"])
def test_bf16_phase_one_outputs_under_autocast_reach_the_sublayers_uncast(narrow, monkeypatch):
    """Under bf16 autocast with bf16 phase-1 outputs ("bfloat16", or "autocast": Block AttnRes's default), Block
    AttnRes hands each sublayer its h as the merge (or phase 1) made it, bf16, instead of casting it to the stream's
    fp32 between the read's graph breaks (the sublayer's norm reads it in fp32 anyway); the logits and the gradient
    (all parameters', as one vector: a small one alone, as a norm's gain, moves by 13% here) stay within bf16
    rounding of the "stream" setting's. (Without autocast "autocast" is "stream": the fp32 comparisons of the fused
    path with the reference above hold it to 1e-4.)"""
    from residuals.attnres_block import AttnResBlock
    from tests.helpers import build_backbone, packed_batch, rel_err

    tokens, docs = packed_batch(2, 9, 37)
    results = {}
    for dtype in ("stream", narrow):
        if dtype == "default":
            monkeypatch.undo()  # the class's own setting
        else:
            monkeypatch.setattr(AttnResBlock, "phase1_dtype", dtype)
        torch.manual_seed(0)
        model = build_backbone("attnres_block", vocab=37, n_blocks=4, attention="sdpa",
                               residual_overrides=("residual.backend=triton", "residual.block_size=4"))
        inputs = []
        for block in model.sublayers:
            block.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens, docs).float()
        logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)))
        results[dtype] = logits.detach(), [p.grad for p in model.parameters()], inputs
    (a, ga, ia), (b, gb, ib) = results[narrow], results["stream"]
    assert set(ib) == {torch.float32} and set(ia) == {torch.bfloat16}, (ia, ib)
    assert rel_err(a, b) < 2e-2
    assert [x is None for x in ga] == [y is None for y in gb]
    flat_a, flat_b = (torch.cat([x.flatten() for x in g if x is not None]) for g in (ga, gb))
    assert rel_err(flat_a, flat_b) < 3e-2, rel_err(flat_a, flat_b)


@needs_interpreter
def test_merges_keep_the_kept_phase_one_outputs_not_their_own(monkeypatch):
    """Under bf16 autocast with fp32 sources phase 1 keeps its bf16 outputs for its backward (``summaries_keep_outputs``),
    so each merge
    keeps the output it read instead of its own h: one (B, T, bf16 d) tensor fewer saved per merge (here every
    merged consumer's h, which this eager sublayer does not keep: its norm saves an fp32 copy), the same logits, and
    gradients within bf16 rounding of the merges that keep h (the backward takes dh·(p − o) from o itself, not
    from the rounded h)."""
    import residuals.attnres as attnres
    from kernels.depth_attn import fused
    from tests.helpers import build_backbone, packed_batch, rel_err

    B, T, n_blocks, size = 2, 9, 4, 4
    tokens, docs = packed_batch(B, T, 37)
    merges, results = [], {}
    real = fused.MergeSumFunction.apply
    monkeypatch.setattr(fused.MergeSumFunction, "apply", lambda *a: merges.append(a[-1]) or real(*a))
    for keep in (True, False):
        monkeypatch.setattr(attnres.DepthAttentionResidual, "merges_keep_outputs", keep)
        merges.clear()
        torch.manual_seed(0)
        model = build_backbone("attnres_block", vocab=37, n_blocks=n_blocks, attention="sdpa",
                               residual_overrides=("residual.backend=triton", f"residual.block_size={size}",
                                                   "residual.source_dtype=stream"))  # fp32 sources: outputs kept
        saved, held = {}, []

        def pack(t):
            held.append(t)  # alive to the end: no later storage takes a counted one's address
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens, docs).float()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        nbytes = sum(n for ptr, n in saved.items() if ptr not in params)
        logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)))
        results[keep] = logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), nbytes, list(merges)
    (a, ga, kept_bytes, flags), (b, gb, h_bytes, h_flags) = results[True], results[False]
    merged = 2 * n_blocks - 2 * n_blocks // size  # every consumer but a block's first (the final output: none)
    assert flags == [True] * merged and h_flags == [False] * merged
    assert model.residual.d_model == 64
    assert h_bytes - kept_bytes == merged * B * T * 64 * 2  # one bf16 (B, T, d) per merge
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the forward is the same
    assert 0 < rel_err(ga, gb) < 1e-2, rel_err(ga, gb)


@needs_interpreter
def test_an_unknown_phase_one_dtype_names_the_choices(monkeypatch):
    from residuals.attnres_block import AttnResBlock
    from tests.helpers import build_backbone

    monkeypatch.setattr(AttnResBlock, "phase1_dtype", "bf16")
    with pytest.raises(ValueError, match=r"phase1_dtype='bf16': choose one of 'stream', 'bfloat16', 'autocast'"):
        build_backbone("attnres_block", vocab=37, n_blocks=2, attention="sdpa",
                       residual_overrides=("residual.backend=triton",))  # at construction, before any compute


SOURCE_DTYPE_RESIDUALS = [n for n in names() if "source_dtype" in {f.name for f in dataclasses.fields(get(n).Config)}]


@needs_interpreter
@pytest.mark.parametrize("name", SOURCE_DTYPE_RESIDUALS)
def test_autocast_sources_are_bf16_under_bf16_autocast_only(name):
    """``residual.source_dtype=autocast`` (Block AttnRes's default): the buffer is bf16 under bf16 autocast and the
    stream's fp32 otherwise, where the logits are those of ``stream`` to the bit (fused and reference path); under
    autocast the reference path rounds its sources as the bf16 buffer stores them (its logits those of ``bfloat16``)."""
    from tests.helpers import build_backbone, packed_batch, perturb_residual_params_alike

    tokens, docs = packed_batch(1, 11, 37, n_docs=2)
    logits = {}
    for dtype in ("stream", "bfloat16", "autocast"):
        for backend in ("torch", "triton"):
            torch.manual_seed(0)
            model = build_backbone(name, vocab=37, n_blocks=2, attention="sdpa",
                                   residual_overrides=(f"residual.backend={backend}", f"residual.source_dtype={dtype}"))
            torch.manual_seed(1)
            perturb_residual_params_alike(model, model)
            for amp in (False, True):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    logits[dtype, backend, amp] = model(tokens, docs).detach().float()
                    state = model.residual.begin(model.embed(tokens), Context(docs))
                if backend == "triton":  # the two-phase state, or MSAR's one-pass reads over the buffer
                    assert getattr(state, "buffer", None) is not None, type(state)
                    wide = dtype == "stream" or (dtype == "autocast" and not amp)
                    assert state.buffer.data.dtype == (torch.float32 if wide else torch.bfloat16), (dtype, amp)
    for backend in ("torch", "triton"):
        torch.testing.assert_close(logits["autocast", backend, False], logits["stream", backend, False], rtol=0, atol=0)
    torch.testing.assert_close(logits["autocast", "torch", True], logits["bfloat16", "torch", True], rtol=0, atol=0)
    assert not torch.equal(logits["autocast", "torch", True], logits["stream", "torch", True])


def test_source_dtype_residuals_are_found_in_the_registry():
    assert {"attnres", "attnres_block", "msar", "msar_block"} <= set(SOURCE_DTYPE_RESIDUALS)


@needs_interpreter
@pytest.mark.parametrize("name", SOURCE_DTYPE_RESIDUALS)
def test_bf16_sources_are_stored_in_bf16_and_change_the_numbers(name):
    """The buffer of the two-phase path is bf16 with residual.source_dtype=bfloat16 (the stream's dtype
    otherwise), and the reference path's read rounds its sources: the logits move by bf16 rounding, not
    more, not zero."""
    from tests.helpers import build_backbone, packed_batch, perturb_residual_params_alike, rel_err

    tokens, docs = packed_batch(1, 11, 37, n_docs=2)
    logits = {}
    for dtype in ("stream", "bfloat16"):
        torch.manual_seed(0)
        model = build_backbone(name, vocab=37, n_blocks=2, attention="sdpa",
                               residual_overrides=("residual.backend=torch", f"residual.source_dtype={dtype}"))
        torch.manual_seed(1)
        perturb_residual_params_alike(model, model)
        logits[dtype] = model(tokens, docs).detach()
        fused = build_backbone(name, vocab=37, n_blocks=2, attention="sdpa",
                               residual_overrides=("residual.backend=triton", f"residual.source_dtype={dtype}"))
        state = fused.residual.begin(fused.embed(tokens), Context(docs))
        assert getattr(state, "buffer", None) is not None, type(state)
        assert state.buffer.data.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    err = rel_err(logits["bfloat16"], logits["stream"])
    assert 1e-5 < err < 2e-2, err
