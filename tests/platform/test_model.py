"""The backbone: shapes, causality, document isolation."""

import pytest
import torch

from tests.helpers import build_backbone, packed_batch


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
