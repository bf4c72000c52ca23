"""MoE routing and dispatch (docs/method.md §6)."""

import pytest
import torch

from platform.moe import MOE_TOPK, MoE, top_k_indices


def make_moe(impl="grouped_mm", E=8, k=2, d=16, h=8, shared=1, seed=0):
    torch.manual_seed(seed)
    moe = MoE(d, E, k, h, shared, bias_update_rate=1e-2, impl=impl)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def assert_same_forward_and_backward(a, b, N, tol):
    """Two MoEs with the same weights: equal outputs, input gradients and parameter gradients on random inputs
    and a random upstream gradient."""
    x = torch.randn(N, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = a(x), b(x2)
    torch.testing.assert_close(y, y2, rtol=tol, atol=tol)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=tol, atol=tol)
    for (n, p), (_, p2) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.grad, p2.grad, rtol=tol, atol=tol, msg=n)


@pytest.mark.parametrize("E,k,N", [(8, 2, 37), (5, 1, 11), (4, 4, 9)])
def test_grouped_mm_matches_sliced_forward_and_backward(E, k, N):
    fast, ref = make_moe("grouped_mm", E, k), make_moe("sliced", E, k)
    ref.load_state_dict(fast.state_dict())
    assert_same_forward_and_backward(fast, ref, N, 1e-5)


def test_moe_equals_explicit_per_token_mixture():
    moe = make_moe(E=6, k=2, shared=0)
    x = torch.randn(13, 16)
    idx, gates = moe.route(x)
    expected = torch.zeros(13, 16)
    for t in range(13):
        for j in range(2):
            e = idx[t, j]
            hidden = torch.nn.functional.silu(x[t] @ moe.w1[e]) * (x[t] @ moe.w3[e])
            expected[t] += gates[t, j] * (hidden @ moe.w2[e])
    torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["grouped_mm", "sliced"])
def test_moe_gradients_equal_explicit_per_token_mixture(impl):
    """The dispatch and combine (sort, grouped GEMMs, copy back, sum over slots) against the mixture
    written token by token: gradients of the input, the expert weights and the router (through the
    gates), for a random upstream gradient and an expert that receives no token."""
    moe = make_moe(impl, E=6, k=3, shared=1)
    moe.bias[4] = -100.0  # expert 4 is never chosen: its weights get no gradient (zero or None alike)
    x = torch.randn(11, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    up = torch.randn(11, 16)
    (moe(x) * up).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    idx, gates = moe.route(x2)
    assert not (idx == 4).any()
    rows = []
    for t in range(11):
        acc = moe.shared(x2[t:t + 1])[0]
        for j in range(3):
            e = idx[t, j]
            hidden = torch.nn.functional.silu(x2[t] @ moe.w1[e]) * (x2[t] @ moe.w3[e])
            acc = acc + gates[t, j] * (hidden @ moe.w2[e])
        rows.append(acc)
    (torch.stack(rows) * up).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    for n, p in moe.named_parameters():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[n], ref, rtol=1e-4, atol=1e-5, msg=n)
    assert grads["router"].abs().max() > 0 and grads["w1"][4].abs().max() == 0


def test_routing_topk_gates_and_bias():
    moe = make_moe(E=8, k=3)
    x = torch.randn(50, 16)
    idx, gates = moe.route(x)
    scores = torch.sigmoid(x @ moe.router.t())
    assert torch.equal(idx.sort(-1).values, scores.topk(3, -1).indices.sort(-1).values)
    torch.testing.assert_close(gates.sum(-1), torch.ones(50))
    # A large bias on expert 5 makes every token pick it, but its gate still comes from the score.
    moe.bias[5] = 100.0
    idx, gates = moe.route(x)
    assert (idx == 5).any(-1).all()
    sel = scores.gather(-1, idx)
    torch.testing.assert_close(gates, sel / sel.sum(-1, keepdim=True))


@pytest.mark.parametrize("E,k,N", [(32, 4, 257), (7, 7, 5), (6, 1, 33), (3, 2, 1)])
def test_argmax_top_k_picks_the_same_set_as_topk(E, k, N):
    g = torch.Generator().manual_seed(E * 100 + k)
    scores = torch.randn(N, E, generator=g)
    fast, ref = top_k_indices(scores, k, "argmax"), top_k_indices(scores, k, "topk")
    assert fast.shape == (N, k) and fast.dtype == ref.dtype == torch.int64
    assert torch.equal(fast.sort(-1).values, ref.sort(-1).values)
    # Ties (few distinct values, -inf included): the lowest indices among equals, as a stable sort keeps them.
    tied = torch.randint(0, 3, (N, E), generator=g).float()
    tied[tied == 0] = float("-inf")
    stable = torch.sort(tied, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(top_k_indices(tied, k, "argmax").sort(-1).values, stable.sort(-1).values)


def test_moe_trains_identically_with_either_top_k():
    a, b = make_moe(E=8, k=3), make_moe(E=8, k=3)
    a.topk_impl, b.topk_impl = "topk", "argmax"
    assert_same_forward_and_backward(a, b, 41, 1e-6)
    torch.testing.assert_close(a.counts, b.counts)


def test_unknown_top_k_impl_names_the_choices():
    with pytest.raises(ValueError, match="'sorting'.*argmax or topk"):
        top_k_indices(torch.randn(2, 4), 2, "sorting")
    assert MOE_TOPK == ("argmax", "topk")


def test_bias_update_moves_toward_balance():
    moe = make_moe(E=4, k=1)
    moe.train()
    with torch.no_grad():
        moe.router.zero_()
        moe.router[2] += 5.0  # every token prefers expert 2
    x = torch.randn(64, 16).abs()
    moe(x)
    moe.accumulate_load()
    load = moe.load.clone()
    assert load[2] == load.max() and load.sum() == 64
    moe.update_bias()
    assert moe.bias[2] < 0, "over-loaded expert's bias must go down"
    assert (moe.bias[[0, 1, 3]] > 0).all(), "under-loaded experts' biases must go up"
    assert moe.load.sum() == 0, "load counter resets after the update"


def test_load_stats():
    moe = make_moe(E=4, k=1)
    with torch.no_grad():
        moe.router.zero_()
        moe.router[1] += 5.0
    moe(torch.randn(32, 16).abs())
    s = moe.last_stats
    assert s["max_over_mean"] == pytest.approx(4.0) and s["entropy"] == pytest.approx(0.0, abs=1e-6)
    moe.bias.copy_(torch.tensor([0.0, -100.0, 0.0, 0.0]))
    moe.bias[0] = 50.0
    moe(torch.randn(32, 16).abs())
    assert moe.last_stats["max_over_mean"] == pytest.approx(4.0)


@pytest.mark.parametrize("N, k, d", [(1, 1, 3), (7, 2, 5), (13, 4, 9)])
def test_dispatch_backward_sums_each_tokens_rows(N, k, d):
    """The dispatch's gather-and-sum backward against autograd's scatter-add of x[token], for a random
    upstream gradient, and fp64 gradcheck."""
    from platform.moe import dispatch

    g = torch.Generator().manual_seed(N * 100 + k)
    choice = torch.randint(0, 5, (N, k), generator=g).flatten()
    order = torch.argsort(choice, stable=True)
    x = torch.randn(N, d, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(N * k, d, dtype=torch.float64, generator=g)
    xs = dispatch(x, order, k)
    torch.testing.assert_close(xs, x[order // k], rtol=0, atol=0)
    (dx,) = torch.autograd.grad(xs, x, up)
    (ref,) = torch.autograd.grad(x[order // k], x, up)
    torch.testing.assert_close(dx, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: dispatch(x, order, k), (x,))


@pytest.mark.parametrize("E", [4, 32, 256, 257, 3000])
def test_narrow_sort_key_gives_the_int64_order_and_group_ends(E):
    """The dispatch sorts expert ids as the narrowest dtype that holds them (one radix pass per byte):
    the stable order and the group ends equal those of topk's int64 indices, up to the dtype's edge."""
    from platform.moe import sort_key_dtype

    dtype = sort_key_dtype(E)
    assert torch.iinfo(dtype).max >= E - 1 and dtype.itemsize <= 4
    g = torch.Generator().manual_seed(E)
    flat = torch.randint(0, E, (5003,), generator=g)
    flat[:3] = E - 1  # the largest id, at the dtype's edge for E = 256 (uint8 255)
    order = torch.argsort(flat.to(dtype), stable=True)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    ends = torch.searchsorted(flat.to(dtype)[order], torch.arange(E, dtype=dtype), right=True)
    assert torch.equal(ends, torch.searchsorted(flat[order], torch.arange(E), right=True))


def test_moe_with_more_experts_than_uint8_holds_matches_sliced():
    """300 experts: the sort key is int16; the grouped dispatch still equals the sliced reference."""
    fast, ref = make_moe("grouped_mm", E=300, k=3), make_moe("sliced", E=300, k=3)
    ref.load_state_dict(fast.state_dict())
    assert fast.key_dtype == torch.int16
    x = torch.randn(64, 16)
    torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N, k, d", [(1, 1, 3), (7, 2, 5), (13, 4, 9)])
def test_combine_gathers_each_tokens_rows(N, k, d):
    """The combine (each token gathers its k sorted rows and sums them) against copying the rows back to
    (token, slot) order with index_copy and summing; its gather backward against autograd's, for a
    random upstream gradient; fp64 gradcheck."""
    from platform.moe import combine

    g = torch.Generator().manual_seed(N * 100 + k + 1)
    order = torch.argsort(torch.randint(0, 5, (N * k,), generator=g), stable=True)
    y = torch.randn(N * k, d, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(N, d, dtype=torch.float64, generator=g)
    out = combine(y, order, k)
    ref = torch.zeros_like(y).index_copy(0, order, y).view(N, k, d).sum(1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    (dy,) = torch.autograd.grad(out, y, up)
    (dref,) = torch.autograd.grad(ref, y, up)
    torch.testing.assert_close(dy, dref, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda y: combine(y, order, k), (y,))
