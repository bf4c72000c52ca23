"""The depth-attention reference against an explicit per-source loop, and its own invariants."""

from __future__ import annotations

import pytest
import torch

from kernels.depth_attn import depth_attn

# (id, m, S, B, T, d, per_view_sources, per_token_queries, separate_keys, key_norm)
CASES = [
    ("shared-static", 3, 5, 2, 7, 9, False, False, False, True),
    ("per-view-static", 2, 4, 1, 13, 6, True, False, False, True),
    ("shared-per-token", 3, 3, 2, 5, 11, False, True, False, True),
    ("keys-only-views", 4, 6, 2, 3, 5, False, False, True, True),
    ("per-view-per-token-keys", 2, 2, 3, 4, 7, True, True, True, True),
    ("raw-keys", 2, 5, 1, 9, 8, True, False, False, False),
    ("one-source", 1, 1, 2, 3, 4, False, False, False, True),
]


def _inputs(m, S, B, T, d, per_view, per_token, separate_keys, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    sources = rand(*((m,) if per_view else ()), S, B, T, d) * 3
    queries = rand(*((m, B, T, d) if per_token else (m, d)))
    gains = 1 + 0.3 * rand(m, d)
    keys = rand(m, S, B, T, d) if separate_keys else None
    return sources, queries, gains, keys


def _loop(sources, queries, gains, keys, key_norm, eps=1e-6):
    """Explicit loop over views and sources: the formula of docs/method.md §3, written out."""
    m = queries.shape[0]
    S = sources.shape[-4]
    outs, weights = [], []
    for j in range(m):
        src = sources[j] if sources.dim() == 5 else sources  # (S, B, T, d)
        ksrc = src if keys is None else (keys[j] if keys.dim() == 5 else keys)
        q = queries[j]  # (d,) or (B, T, d)
        logits = []
        for s in range(S):
            k = ksrc[s].double()
            if key_norm:
                k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps) * gains[j].double()
            logits.append((k * q.double()).sum(-1))  # (B, T)
        w = torch.softmax(torch.stack(logits), dim=0)  # (S, B, T)
        outs.append(sum(w[s, ..., None] * src[s].double() for s in range(S)))
        weights.append(w)
    return torch.stack(outs), torch.stack(weights)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_loop_forward_and_backward(case):
    _, m, S, B, T, d, per_view, per_token, separate_keys, key_norm = case
    inputs = [t.requires_grad_() if t is not None else None
              for t in _inputs(m, S, B, T, d, per_view, per_token, separate_keys)]
    sources, queries, gains, keys = inputs
    gains_arg = gains if key_norm else None
    out, w = depth_attn(sources, queries, gains_arg, key_sources=keys, key_norm=key_norm, return_weights=True)
    ref_out, ref_w = _loop(sources, queries, gains, keys, key_norm)
    assert out.shape == (m, B, T, d) and w.shape == (m, S, B, T)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-6)

    # random upstream gradients through both outputs
    g = torch.Generator().manual_seed(1)
    up_out, up_w = torch.randn(out.shape, generator=g), torch.randn(w.shape, generator=g)
    used = [t for t in (sources, queries, gains_arg, keys) if t is not None]
    grads = torch.autograd.grad((out * up_out).sum() + (w * up_w).sum(), used)
    ref_grads = torch.autograd.grad((ref_out * up_out).sum() + (ref_w * up_w).sum(), used)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_weights_sum_to_one(case):
    _, m, S, B, T, d, per_view, per_token, separate_keys, key_norm = case
    sources, queries, gains, keys = _inputs(m, S, B, T, d, per_view, per_token, separate_keys, seed=3)
    _, w = depth_attn(sources, 5 * queries, gains, key_sources=keys, key_norm=key_norm, return_weights=True)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(1), torch.ones(m, B, T), rtol=0, atol=1e-6)


def test_list_of_sources_equals_stack():
    sources, queries, gains, _ = _inputs(2, 4, 2, 5, 6, False, False, False)
    torch.testing.assert_close(depth_attn(list(sources), queries, gains), depth_attn(sources, queries, gains))


@pytest.mark.parametrize("per_view", [False, True], ids=["shared", "per-view"])
def test_zero_queries_give_plain_mean(per_view):
    sources, queries, gains, _ = _inputs(3, 6, 2, 5, 8, per_view, False, False)
    out = depth_attn(sources, torch.zeros_like(queries), gains)
    mean = sources.mean(-4)
    torch.testing.assert_close(out, mean if per_view else mean.expand(3, *mean.shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("shared-per-token", "per-view-per-token-keys", "raw-keys")],
                         ids=lambda c: c[0])
def test_gradcheck_fp64(case):
    _, m, S, B, T, d, per_view, per_token, separate_keys, key_norm = case
    sources, queries, gains, keys = _inputs(min(m, 2), min(S, 3), 1, 2, min(d, 4), per_view, per_token,
                                            separate_keys, dtype=torch.float64)
    args = [t.requires_grad_() for t in (sources, queries, gains, keys) if t is not None]

    def f(*a):
        s, q, g, *k = a
        out, w = depth_attn(s, q, g if key_norm else None, key_sources=k[0] if k else None,
                            key_norm=key_norm, return_weights=True)
        return out, w

    assert f(*args)[0].dtype == torch.float64
    assert torch.autograd.gradcheck(f, args)


def test_low_precision_in_fp32_out():
    sources, queries, gains, _ = _inputs(2, 5, 2, 4, 16, False, False, False)
    out, w = depth_attn(sources.bfloat16(), queries, gains, return_weights=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32
    ref = depth_attn(sources.bfloat16().float(), queries, gains)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_backends_dispatch_explicitly():
    sources, queries, gains, _ = _inputs(2, 3, 1, 2, 4, False, False, False)
    torch.testing.assert_close(depth_attn(sources, queries, gains, backend="torch"),
                               depth_attn(sources, queries, gains, backend="auto"))
    with pytest.raises(ValueError, match="backend 'triton' takes keys = values"):  # fused: tests/kernels/test_depth_attn_fused.py
        depth_attn(sources, queries, gains, key_sources=sources, backend="triton")
    with pytest.raises(ValueError, match="'cuda'.*choices"):
        depth_attn(sources, queries, gains, backend="cuda")


def test_bad_shapes_are_refused():
    sources, queries, gains, _ = _inputs(2, 3, 1, 2, 4, False, False, False)
    with pytest.raises(ValueError, match="share d"):
        depth_attn(sources, queries[:, :3], gains)
    with pytest.raises(ValueError, match="sources must have"):
        depth_attn(sources[0, 0], queries, gains)
