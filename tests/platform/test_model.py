"""The backbone: shapes, causality, document isolation."""

import pytest
import torch

from tests.helpers import build_backbone, packed_batch


# The compiled-vs-eager numerics tests route every token through every expert (top_k = n_experts): the gates stay
# continuous functions of the input. With top-k routing a bf16 rounding flips a near-tie now and then, and a flip
# moves one token's update between two experts (their weights' gradients 0.2-0.3 off, the rest at bf16's 0.02):
# eager bf16 flips some and the compiled model others, which measures where the ties fall, not the compile (one
# Block AttnRes setting flipped one more tie compiled, `sublayers.7`, and failed the bound on that alone).
ALL_EXPERTS = {"n_experts": 4, "top_k": 4}


def test_forward_backward_shapes():
    model = build_backbone("vanilla", vocab=97)
    tokens, docs = packed_batch(2, 24, 97)
    logits = model(tokens, docs)
    assert logits.shape == (2, 24, 97) and torch.isfinite(logits).all()
    logits.backward(torch.randn_like(logits))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_causality_later_tokens_do_not_change_earlier_outputs():
    model = build_backbone("vanilla", vocab=97).eval()
    tokens, docs = packed_batch(2, 32, 97, n_docs=1)
    base = model(tokens, docs)
    for t in (0, 9, 30):
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, 97, changed[:, t + 1:].shape)
        out = model(changed, docs)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])


def test_documents_are_isolated():
    model = build_backbone("vanilla", vocab=97).eval()
    tokens, docs = packed_batch(1, 40, 97, n_docs=3, seed=1)
    base = model(tokens, docs)
    first_doc = docs[0] == docs[0, 0]
    end = int(first_doc.sum())
    changed = tokens.clone()
    changed[0, :end] = torch.randint(0, 97, (end,))  # rewrite the whole first document
    out = model(changed, docs)
    torch.testing.assert_close(out[:, end:], base[:, end:], rtol=0, atol=1e-5)


def test_moe_layers_follow_a_dense_first_block():
    model = build_backbone("vanilla", vocab=97)
    idx = [i for i, _ in model.moe_layers()]
    assert idx == list(range(3, len(model.sublayers), 2))


@pytest.mark.parametrize("residual, overrides, expected", [
    ("msar_block", ("residual.backend=torch",), True),  # the reference stacks and expands sources: recompute it
    ("msar_block", ("residual.backend=triton",), False),  # the fused read stores no views: nothing to save
    ("attnres_block", ("residual.backend=torch",), True),
    ("attnres_block", ("residual.backend=triton",), False),
    ("mhc", (), False),  # reads are computed ahead, in begin/write
    ("vanilla", (), False),
])
def test_reads_are_checkpointed_only_where_it_saves_memory(monkeypatch, residual, overrides, expected):
    import platform.model as model_module
    from tests.helpers import build_backbone, packed_batch

    calls = []
    real = model_module.checkpoint

    def counting(fn, *args, **kwargs):
        calls.append(getattr(fn, "__name__", ""))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(model_module, "checkpoint", counting)
    model = build_backbone(residual, vocab=37, n_blocks=2, checkpoint_reads=True, residual_overrides=overrides)
    tokens, docs = packed_batch(1, 9, 37, n_docs=2)
    model.train()
    model(tokens, docs).sum().backward()
    assert ("read" in calls) == expected, calls


def test_compiled_loss_equals_the_eager_loss_and_its_gradient():
    """compile_sublayers also compiles the loss (fused fp32 cast, log-softmax and backward): same value
    and gradient as the eager cross-entropy on bf16 logits, for a random upstream gradient."""
    from platform.graphs import next_token_loss
    from platform.model import cross_entropy

    torch.manual_seed(0)
    model = build_backbone("vanilla", vocab=101)
    assert model.cross_entropy is cross_entropy
    model.compile_sublayers()
    assert model.cross_entropy is not cross_entropy
    logits = torch.randn(2, 37, 101, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 101, (2, 37))
    up = torch.randn(())
    eager, compiled = cross_entropy(logits, target), model.cross_entropy(logits, target)
    assert torch.allclose(compiled, eager, rtol=1e-6, atol=1e-6)
    g_eager, = torch.autograd.grad(eager * up, logits)
    g_compiled, = torch.autograd.grad(compiled * up, logits)
    assert torch.allclose(g_compiled.float(), g_eager.float(), rtol=1e-2, atol=1e-5)
    tokens = torch.randint(0, 101, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # compiled grouped_mm wants bf16 operands
        loss, out, tgt = next_token_loss(model, tokens, torch.zeros_like(tokens))  # the objective uses it
    assert torch.allclose(loss, cross_entropy(out, tgt), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "mlp"])
def test_compiled_model_equals_the_eager_model(recompute):
    """trainer.compile_scope=model (`Backbone.compile_model`): the whole forward below the mask compiled
    as one graph, residual reads and writes fused with the sublayers, also with sublayers recomputed in
    backward (model.recompute, a checkpoint inside the graph). In bf16 (autocast on CPU, as the compiled
    grouped GEMM wants) its logits and gradients are as close to the fp32 eager model's as the eager bf16
    model's are, for a random upstream gradient."""
    torch.manual_seed(0)
    model = build_backbone("vanilla", vocab=101, recompute=recompute, **ALL_EXPERTS).train()
    tokens, docs = packed_batch(2, 24, 101)
    upstream = torch.randn(2, 24, 101)

    def run(bf16: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens, docs)
        logits.float().backward(upstream)
        return {"logits": logits.float().detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}

    exact, eager = run(False), run(True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.compile_model()
    compiled = run(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph: no break, no recompile
    for n, ref in exact.items():
        err_eager = float((eager[n] - ref).norm() / ref.norm().clamp_min(1e-12))
        err_compiled = float((compiled[n] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err_compiled <= 2 * err_eager + 1e-2, (n, err_compiled, err_eager)


@pytest.mark.slow
def test_compiled_model_records_depth_weights_as_the_eager_model():
    """A recording forward (record=True, what the end of a run does) on a compiled model keeps the depth
    weights of the eager one (attnres_block, PyTorch backend on the CPU)."""
    torch.manual_seed(0)
    model = build_backbone("attnres_block", vocab=101).eval()
    tokens, docs = packed_batch(2, 24, 101)
    with torch.no_grad():
        model(tokens, docs, record=True)
        eager = {k: v.clone() for k, v in model.residual.recorded.items()}
        model.residual.recorded.clear()
        model.compile_model()
        model(tokens, docs, record=True)
    assert eager and sorted(model.residual.recorded) == sorted(eager)
    for k, v in eager.items():
        torch.testing.assert_close(model.residual.recorded[k], v)


def test_compile_model_leaves_room_for_a_graph_per_layer(monkeypatch):
    """compile_model raises Dynamo's per-frame graph limit so that a residual's read/write, compiled per
    layer and output dtype between its fused ops' graph breaks, stays compiled for every layer (the
    default 8 ran mhc's later writes eager); a higher limit already set is kept."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)
    config = torch._dynamo.config  # patched with its own context manager: a config module is not a plain module
    model = build_backbone("vanilla", vocab=97)
    with config.patch(recompile_limit=8):
        model.compile_model()
        assert config.recompile_limit >= 2 * (len(model.sublayers) + 2)
    with config.patch(recompile_limit=1000):
        model.compile_model()
        assert config.recompile_limit == 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attnres_block", "msar_block"])
def test_compiled_model_compiles_fused_reads_once_whatever_the_depth(name, monkeypatch):
    """A residual whose reads and writes are fused ops runs each read and write as one eager call under
    compile_model (a graph break at the call, nothing of it traced: `residuals.attnres.eager`): the graphs
    compiled do not grow with the number of consumers, and the compiled model's logits and gradients are as
    close to the fp32 model's as the eager bf16 model's. Traced into, the frames between the backbone and the
    op (read, _retrieve, the op's checks; the two-phase path's group opening) were compiled once per consumer,
    on guards of its index and source count: msar_block 12 graphs at 4 sublayers and 20 at 12, attnres_block
    15 and 22. msar_block's fused op is a graph break (torch.compiler.disable); its stand-in here is the
    reference behind the same break (the Triton interpreter would take minutes), so the test measures Dynamo's
    treatment of the read; attnres_block runs its fused ops through the interpreter."""
    import kernels.msar_attn.fused as fused
    from kernels.msar_attn import reference

    @torch.compiler.disable
    def stand_in(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, *, key_norm, fusion, eps, return_weights,
                 recompute_streams=False, packed=None):
        # packed: the step's packing for this read (Msar.pack_step, the default) or None; the reference needs neither
        return reference.msar(torch.stack(list(x)), taps, queries, key_gains, doc_ids, phi, alpha, bias,
                              key_norm=key_norm, fusion=fusion, eps=eps, return_weights=return_weights)

    monkeypatch.setattr(fused, "msar", stand_in)
    tokens, docs = packed_batch(2, 24, 101)
    upstream = torch.randn(2, 24, 101)
    graphs = {}
    for n_blocks in (2, 6):
        torch.manual_seed(0)
        model = build_backbone(name, vocab=101, residual_overrides=("residual.backend=triton",),
                               n_blocks=n_blocks, **ALL_EXPERTS).train()

        def run(bf16: bool = True):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(tokens, docs)
            logits.float().backward(upstream)
            return {"logits": logits.float().detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}

        exact, eager = run(bf16=False), run()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.compile_model()
        compiled = run()
        graphs[n_blocks] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for n, ref in exact.items():  # bf16 compiled as close to the fp32 model as bf16 eager (as for vanilla above)
            err_eager = float((eager[n] - ref).norm() / ref.norm().clamp_min(1e-12))
            err_compiled = float((compiled[n] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert err_compiled <= 2 * err_eager + 1e-2, (n_blocks, n, err_compiled, err_eager)
    assert graphs[2] == graphs[6], graphs
