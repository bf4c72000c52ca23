"""The causal-conv reference against an explicit loop over tokens and taps, and its causality."""

from __future__ import annotations

import pytest
import torch

from kernels.causal_conv import causal_conv


def packed_doc_ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """(B, T) document ids, several documents of random lengths per row (ids unique per row)."""
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, T, generator=g) < 0.3).long()
    starts[:, 0] = 1
    return starts.cumsum(-1) + 100 * torch.arange(B)[:, None]


def _loop(x, taps, doc_ids):
    """y[t] = Σ_τ c_τ x[t-τ] over t-τ >= 0 in t's document, written out token by token."""
    y = torch.zeros_like(x, dtype=torch.float64)
    k, T = taps.shape[0], x.shape[-2]
    docs = doc_ids.expand(x.shape[:-1]) if doc_ids is not None else None
    for t in range(T):
        for tau in range(k):
            if t - tau < 0:
                continue
            keep = 1.0 if docs is None else (docs[..., t - tau] == docs[..., t]).double()[..., None]
            y[..., t, :] += keep * taps[tau].double() * x[..., t - tau, :].double()
    return y


# (id, leading shape, T, d, k, with doc ids)
CASES = [
    ("odd-docs", (2,), 13, 7, 5, True),
    ("sources-axis", (3, 2), 11, 5, 4, True),
    ("k-longer-than-T", (1,), 3, 4, 8, True),
    ("k1", (2,), 6, 3, 1, True),
    ("no-docs", (2,), 9, 6, 3, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_loop_forward_and_backward(case):
    _, lead, T, d, k, with_docs = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, T, d, generator=g, requires_grad=True)
    taps = torch.randn(k, d, generator=g, requires_grad=True)
    doc_ids = packed_doc_ids(lead[-1], T) if with_docs else None
    if with_docs:
        assert (doc_ids[:, 1:] != doc_ids[:, :-1]).any(), "the case needs several documents in a row"
    y, ref = causal_conv(x, taps, doc_ids), _loop(x, taps, doc_ids)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    up = torch.randn(y.shape, generator=g)
    for a, b in zip(torch.autograd.grad((y * up).sum(), (x, taps)), torch.autograd.grad((ref * up).sum(), (x, taps))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gradcheck_fp64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    taps = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 6, 6]])
    assert causal_conv(x, taps, doc_ids).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda a, c: causal_conv(a, c, doc_ids), (x, taps))


def test_causal_and_document_local():
    B, T, d, k = 2, 13, 7, 5
    g = torch.Generator().manual_seed(2)
    x, taps = torch.randn(B, T, d, generator=g), torch.randn(k, d, generator=g)
    doc_ids = packed_doc_ids(B, T, seed=4)
    y = causal_conv(x, taps, doc_ids)
    for t in range(T):
        x2 = x.clone()
        x2[0, t] += torch.randn(d, generator=g)
        dy = (causal_conv(x2, taps, doc_ids) - y).abs().sum(-1)  # (B, T)
        changed_ok = (doc_ids == doc_ids[0, t]) & (torch.arange(T) >= t)
        changed_ok[1:] = False
        assert (dy[~changed_ok] == 0).all(), f"perturbing token {t} leaked outside its document's future"
        assert dy[0, t] > 0


def test_dirac_is_identity_and_box_is_document_mean():
    B, T, d, k = 2, 10, 4, 3
    x = torch.randn(B, T, d)
    doc_ids = packed_doc_ids(B, T, seed=5)
    dirac = torch.zeros(k, d)
    dirac[0] = 1
    assert torch.equal(causal_conv(x, dirac, doc_ids), x)
    box = causal_conv(x, torch.full((k, d), 1.0 / k), doc_ids)
    t = T - 1
    window = [s for s in range(t - k + 1, t + 1) if s >= 0 and doc_ids[0, s] == doc_ids[0, t]]
    torch.testing.assert_close(box[0, t], x[0, window].sum(0) / k)


def test_backends_dispatch_explicitly():
    x, taps = torch.randn(1, 4, 2), torch.randn(2, 2)
    torch.testing.assert_close(causal_conv(x, taps, backend="auto"), causal_conv(x, taps, backend="torch"))
    with pytest.raises(ValueError, match="'triton'.*choices: auto, torch$"):
        causal_conv(x, taps, backend="triton")
    with pytest.raises(ValueError, match="'cuda'.*choices"):
        causal_conv(x, taps, backend="cuda")
    with pytest.raises(ValueError, match="taps must be"):
        causal_conv(x, torch.randn(2, 3))
