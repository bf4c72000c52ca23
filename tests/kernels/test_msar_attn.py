"""The fused MSAR op (conv views + depth attention + H^pre mixer) against its reference, and the
reference against docs/method.md §4 written out. On CPU the Triton kernels run under TRITON_INTERPRET=1 (set
by the root conftest before any kernel import); they cost ~1 ms per operation and tap there, so the
shapes are tiny and most kernel sizes small."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.msar_attn import msar, msar_attn
from kernels.msar_attn import reference
from tests.helpers import rel_err

ROOT = Path(__file__).resolve().parents[2]
# the CPU tests run the Triton kernels on CPU tensors: only under the interpreter
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")


def doc_ids_for(B, T, generator, device="cpu"):
    """Several documents per row: random boundaries (odd offsets included) plus one in the middle."""
    starts = torch.rand(B, T, generator=generator) < 0.2
    starts[:, T // 2] = True
    starts[:, 0] = False
    return torch.cumsum(starts.long(), dim=1).to(device)


def make_inputs(S, B, T, d, kernels, gains, *, dtype=torch.float32, device="cpu", seed=0):
    """x, taps, queries, key_gains, doc_ids, phi, alpha, bias; queries scaled ~1/√d so the softmax
    over sources is not saturated (its gradients are then not ~0)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(device, dtype)

    m = 1 + len(kernels)
    x = rand(S, B, T, d, scale=2.0)
    taps = [rand(k, d, scale=0.5) for k in kernels]
    queries = rand(m, d, scale=min(1.0, 3 / d ** 0.5))
    key_gains = rand(m, d, scale=0.3, shift=1.0) if gains else None
    phi = rand(m * d, m, scale=2 / (m * d) ** 0.5)
    alpha = rand(scale=0.3, shift=0.7)
    bias = rand(m)
    return x, taps, queries, key_gains, doc_ids_for(B, T, g, device), phi, alpha, bias


def _blocks(bt, bd, sub=2, bwd_bd=None, mode="serial"):
    """A block-size override for fused._blocks: GPU-like geometry under the interpreter (several
    channel tiles, token blocks that straddle documents, several blocks per source-gradient program;
    serial source-gradient programs of bt + 1 tokens, an odd count, over bwd_bd channels).
    ``bwd_bd``: other channel tiles for the backward than for the forward; ``mode``: Blocks.src_mode, or "split":
    the serial source gradients and the split forward (on bd channels, chunks of bt + 1 tokens), or "lean": the
    split forward with its lean pass 2 (Blocks.split_lean)."""
    from kernels.msar_attn import fused

    bwd_bd = bwd_bd or bd
    split = (dict(fwd_mode="split", split_logit_bd=bd, split_bd=bd, split_ch=bt + 1, split_lean=mode == "lean")
             if mode in ("split", "lean") else dict(fwd_mode="tile"))

    def blocks(T, d, m_pad, k_max):
        src_bt = max(bt, 1 << max(k_max - 2, 0).bit_length())  # >= k_max - 1
        return fused.Blocks(bd, bd >= d, bt, 4, bwd_bd, bt, 4, src_bt, bwd_bd, 4, sub,
                            src_mode="serial" if mode in ("split", "lean") else mode, serial_bd=bwd_bd,
                            serial_ch=bt + 1,
                            **split)

    return blocks


def _with_split(monkeypatch, lean=False, glue="torch"):
    """fused._blocks (as overridden so far) with the split forward (Blocks.fwd_mode="split"): several channel tiles
    of both passes and several chunks a row (5 tokens) where d is small, 512 channels where it is wide; ``lean``:
    its lean pass 2 (Blocks.split_lean); ``glue``: Blocks.glue and Blocks.stats_glue."""
    import dataclasses

    from kernels.msar_attn import fused

    inner = fused._blocks

    def blocks(T, d, m_pad, k_max):
        bd = 8 if d <= 32 else 512
        return dataclasses.replace(inner(T, d, m_pad, k_max), fwd_mode="split", split_logit_bd=bd, split_bd=bd,
                                   split_ch=5, split_lean=lean, glue=glue, stats_glue=glue)

    monkeypatch.setattr(fused, "_blocks", blocks)


def _with_fields(monkeypatch, **fields):
    """fused._blocks (as overridden so far) with these fields of Blocks replaced, its tiles otherwise as they were."""
    import dataclasses

    from kernels.msar_attn import fused

    inner = fused._blocks
    monkeypatch.setattr(fused, "_blocks", lambda *a: dataclasses.replace(inner(*a), **fields))


def _with_lean(monkeypatch):
    """The split forward's lean pass 2 (Blocks.split_lean)."""
    _with_fields(monkeypatch, fwd_mode="split", split_lean=True)


def _with_ring(monkeypatch):
    """The ring source-gradient kernel (Blocks.src_mode="ring")."""
    _with_fields(monkeypatch, src_mode="ring")


# (id, S, B, T, d, kernels, key_norm, gains, fusion, (BT, BD) override or None)
CASES = [
    ("S3-B2-T13-d24-k2,3", 3, 2, 13, 24, (2, 3), True, True, "sigmoid", None),
    ("S1-B1-T1-d8-k3-one-source-one-token", 1, 1, 1, 8, (3,), True, True, "sigmoid", None),
    ("S1-B2-T13-d12-k2,5-one-source-tiled", 1, 2, 13, 12, (2, 5), False, False, "softmax", (4, 8)),
    ("S2-B1-T3-d8-k5-T-below-k-softmax-nogain", 2, 1, 3, 8, (5,), True, False, "softmax", None),
    ("S3-B1-T9-d12-k2,3-tiled-rawkeys", 3, 1, 9, 12, (2, 3), False, True, "sigmoid", (4, 8)),
    ("S3-B1-T11-d12-k5,2-tiled-softmax", 3, 1, 11, 12, (5, 2), True, True, "softmax", (4, 8)),
    ("S2-B1-T7-d12-k3-one-tile-forward-tiled-backward", 2, 1, 7, 12, (3,), True, True, "sigmoid", (4, 16, 2, 8)),
    ("S2-B1-T4-d1100-k2-wide", 2, 1, 4, 1100, (2,), True, True, "sigmoid", None),
    ("S5-B1-T6-d12-k1,1,1-identity-views", 5, 1, 6, 12, (1, 1, 1), True, True, "softmax", None),
    ("S2-B1-T10-d16-k4,8,12", 2, 1, 10, 16, (4, 8, 12), True, True, "sigmoid", None),
]


def _leaves(x, taps, queries, key_gains, phi, alpha, bias):
    named = [("x", x), ("queries", queries), ("key_gains", key_gains), ("phi", phi), ("alpha", alpha),
             ("bias", bias), *((f"taps[{i}]", c) for i, c in enumerate(taps))]
    return [(n, t.requires_grad_()) for n, t in named if t is not None]


# --- the fused op against the reference -----------------------------------------------------------
def _with_views_3d(monkeypatch):
    """The tile forward with the view builder's 3-d layout (Blocks.views_3d)."""
    _with_fields(monkeypatch, views_3d=True, fwd_mode="tile")


def _with_tile_forward(monkeypatch):
    """The tile forward (Blocks.fwd_mode="tile")."""
    _with_fields(monkeypatch, fwd_mode="tile")


# (id, rows the reader sees, buffer rows written, partial: None / "after" / "before" the buffer, partial dtype)
BUFFERED = [
    ("rows-and-partial-after", 3, 3, "after", torch.float32),
    ("partial-made-before-the-buffer", 2, 2, "before", torch.float32),
    ("rows-only", 3, 3, None, torch.float32),
    ("reader-saw-fewer-rows", 2, 4, "after", torch.float32),
    ("bf16-partial-cast-to-the-buffer", 2, 2, "after", torch.bfloat16),
]


@needs_triton
@pytest.mark.parametrize("mode", ["serial", "ring", "split", "lean"])
@pytest.mark.parametrize("case", BUFFERED, ids=[c[0] for c in BUFFERED])
def test_buffered_sources_are_read_in_place(case, mode, monkeypatch):
    """BufferedSources (a SourceBuffer's first rows, then a partial at its own address, before or after the buffer
    in memory): the fused op equals the reference on the same S tensors, forward and every gradient (the rows'
    gradients reach the terms stored into them, the partial's its leaf), with a random upstream gradient, and it
    stacks nothing, in forward or backward."""
    from kernels.depth_attn import SourceBuffer
    from kernels.msar_attn import BufferedSources, fused

    _, n, written, where, p_dtype = case
    blocks = _blocks(4, 8, mode=mode)  # several serial programs a row (5 tokens), two channel tiles
    B, T, d, kernels = 1, 9, 12, (2, 3)
    S = n + (where is not None)
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(max(written, S), B, T, d, kernels, True)
    leaves = [x[i].clone().requires_grad_() for i in range(written)]
    p_leaf = x[-1].to(p_dtype).clone().requires_grad_() if where == "before" else None
    partial = None if p_leaf is None else p_leaf * 1.5  # a non-leaf, as in the residual
    buffer = SourceBuffer(written, leaves[0])
    for t in leaves:
        buffer.append(t)
    if where == "after":
        p_leaf = (x[-1] * 0.5).to(p_dtype).requires_grad_()
        partial = p_leaf * 1.5
    up = torch.randn(B, T, d, generator=torch.Generator().manual_seed(2))
    params = [queries, key_gains, phi, alpha, bias, *taps]
    for t in params:
        t.requires_grad_()
    grads = {}
    for backend in ("triton", "torch"):
        if backend == "triton":
            src = BufferedSources(buffer, buffer.rows[:n], partial)
            monkeypatch.setattr(fused.torch, "stack", _refuse_stack)
            monkeypatch.setattr(fused, "_blocks", blocks)
        else:
            monkeypatch.undo()
            src = [*buffer.rows[:n], *(() if partial is None else (partial.to(buffer.data.dtype),))]
        h = msar(src, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend=backend)
        assert h.shape == (B, T, d)
        inputs = [*leaves[:n], *(() if p_leaf is None else (p_leaf,)), *params]
        grads[backend] = (h, *torch.autograd.grad((h * up).sum(), inputs, retain_graph=True))
    names = ["h", *(f"row{i}" for i in range(n)), *(() if p_leaf is None else ("partial",)), "queries", "key_gains",
             "phi", "alpha", "bias", *(f"taps[{i}]" for i in range(len(taps)))]
    for name, a, b in zip(names, grads["triton"], grads["torch"]):
        tol = 1e-2 if name == "partial" and p_dtype == torch.bfloat16 else 1e-4
        assert a.dtype == b.dtype and rel_err(a, b) < tol, f"{name}: {rel_err(a, b):.2e}"
    assert all(g.abs().max() > 0 for g in grads["torch"][1:]), "a compared gradient is zero"


@needs_triton
def test_a_partial_below_the_rows_in_memory():
    """The kernels address the partial by its element offset from the rows, which is negative when it lies below
    them: forward (h, lse, saved streams) and the streams' backward equal those of the stacked sources."""
    from kernels.msar_attn import fused

    S, B, T, d, kernels = 3, 2, 7, 8, (2, 3)
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, True)
    arena = torch.empty(S * B * T * d + 5)  # the partial first, then (at an odd gap) the rows
    partial = arena[: B * T * d].view(B, T, d)
    rows = arena[B * T * d + 5:].view(S - 1, B, T, d)
    partial.copy_(x[-1])
    rows.copy_(x[:-1])
    assert fused.sources_layout(rows, partial) == (S, S - 1, -(B * T * d + 5))
    packed, ks, _ = fused.pack_taps(taps, d, x.device)
    qg, near = fused.folded_queries(queries, key_gains), fused.doc_window(doc_ids)
    mixer = fused._mixer_params(phi, alpha, bias)
    kw = dict(key_norm=True, eps=1e-6)
    got = fused.forward(rows, packed, ks, len(ks), qg, near, mixer=mixer, save=True, partial=partial,
                        save_stats=True, **kw)
    want = fused.forward(x, packed, ks, len(ks), qg, near, mixer=mixer, save=True, save_stats=True, **kw)
    for a, b in zip([got[0], got[1], *got[3], *got[4]], [want[0], want[1], *want[3], *want[4]]):
        assert torch.equal(a, b)
    dr = torch.randn(len(ks), B, T, d, generator=torch.Generator().manual_seed(4))
    got_b = fused.streams_backward(dr, want[1], rows, taps, packed, ks, qg, near, partial=partial, stats=got[4],
                                   **kw)
    want_b = fused.streams_backward(dr, want[1], x, taps, packed, ks, qg, near, stats=want[4], **kw)
    for a, b in zip([got_b[0], *got_b[1], got_b[2]], [want_b[0], *want_b[1], want_b[2]]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="the partial source must be a contiguous torch.float32 tensor"):
        fused.sources_layout(rows, partial.double())
    # no buffered row before the partial: an empty slice has no address to offset from, so it is refused by name
    with pytest.raises(ValueError, match=r"a partial source needs at least one buffered row before it \(got 0 rows\)"):
        fused.sources_layout(rows[:0], partial)


def test_offsets_reach_the_kernels_as_one_specialisation():
    """offset_arg: the partial's element offset from the rows (and its gradient's) depends on where the allocator put
    them, which differs between the eager warm-up and a CUDA-graph capture. Biased by 2**40 every such offset,
    below or above, near or far (multiples of 128 elements: 512-byte-aligned fp32 allocations), is an int64 that
    Triton specialises the same way (beyond int32, divisible by 16, not 1), so a capture never compiles a new
    kernel; a bias beyond the kernels' range is refused."""
    from kernels.msar_attn import fused

    for offset in (-(3 << 33), -(1 << 20), -128, 128, 1 << 20, 5 << 31, 7 << 34):
        arg = fused.offset_arg(offset)
        assert arg >= 2 ** 31 and arg % 16 == 0 and arg - fused.OFFSET_BIAS == offset
    with pytest.raises(ValueError, match=r"element offset of 1099511627776 is beyond"):
        fused.offset_arg(1 << 40)


def _refuse_stack(*args, **kwargs):
    raise AssertionError("the fused op stacked its sources")


def test_buffered_sources_must_be_the_buffers_first_rows():
    from kernels.depth_attn import SourceBuffer
    from kernels.msar_attn import BufferedSources

    rows = torch.randn(3, 1, 4, 8)
    buffer = SourceBuffer(3, rows[0])
    for r in rows:
        buffer.append(r)
    assert len(BufferedSources(buffer, buffer.rows[:2], rows[0])) == 3
    with pytest.raises(ValueError, match=r"must be the buffer's first rows .* got 2 rows for a buffer of 3"):
        BufferedSources(buffer, buffer.rows[1:])


@needs_triton
@pytest.mark.parametrize("variant", ["views-2d", "views-3d", "ring", "split", "lean", "lean-glue", "coef-planes",
                                     "parts-planes", "lean-near", "serial-ahead2", "part-sums-torch"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_msar_matches_reference(case, variant, monkeypatch):
    """Every case with the serial source-gradient kernel (the default) and the tile forward in the 2-d or 3-d view
    layout, with the ring source-gradient kernel (and the default forward), and with the split forward (the
    default) on several channel tiles and chunks, plain and with its lean pass 2 (and the glue between the kernels
    as kernels too, Blocks.glue="triton"; and its rows loaded where they are used instead of a source ahead,
    Blocks.split_ahead=False), and with the backward's w, κ, μ (Blocks.coef_layout) or pass 1's and the stats
    kernel's sums (Blocks.parts_layout) in planes instead of token-major (the defaults), with the
    source-gradient kernel's loads two tokens ahead (Blocks.serial_ahead2), and with its partial query and tap
    gradients summed by torch (Blocks.part_sums="torch"; every other variant sums them with ``sum_rows``)."""
    _, S, B, T, d, kernels, key_norm, gains, fusion, blocks = case
    if blocks is not None:
        from kernels.msar_attn import fused

        monkeypatch.setattr(fused, "_blocks", _blocks(*blocks))
    if variant == "views-2d":
        _with_tile_forward(monkeypatch)
    if variant == "views-3d":
        _with_views_3d(monkeypatch)
    if variant == "ring":
        _with_ring(monkeypatch)
    if variant in ("split", "lean", "lean-glue", "lean-near"):
        _with_split(monkeypatch, lean=variant != "split", glue="triton" if variant == "lean-glue" else "torch")
    if variant == "lean-near":
        _with_fields(monkeypatch, split_ahead=False)
    if variant == "serial-ahead2":
        _with_fields(monkeypatch, serial_ahead2=True)
    if variant == "part-sums-torch":
        _with_fields(monkeypatch, part_sums="torch")
    if variant == "coef-planes":
        _with_fields(monkeypatch, coef_layout="planes", stats_glue="triton")
    if variant == "parts-planes":
        _with_split(monkeypatch, lean=True, glue="triton")
        _with_fields(monkeypatch, parts_layout="planes")
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, gains)
    named = _leaves(x, taps, queries, key_gains, phi, alpha, bias)
    results = {}
    for backend in ("triton", "torch"):
        results[backend] = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, key_norm=key_norm,
                                fusion=fusion, return_weights=True, backend=backend)
    (h, w), (ref_h, ref_w) = results["triton"], results["torch"]
    assert h.shape == ref_h.shape == (B, T, d) and h.dtype == x.dtype
    assert w.shape == ref_w.shape == (1 + len(kernels), S, B, T) and w.dtype == torch.float32
    assert rel_err(h, ref_h) < 1e-5
    assert rel_err(w, ref_w) < 1e-5

    # random upstream gradients (a ones_like gradient would hide errors of the softmax backward)
    up = torch.randn(h.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t for _, t in named]
    grads = torch.autograd.grad((h * up).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_h * up).sum(), leaves)
    for (name, _), a, b in zip(named, grads, ref_grads):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if S == 1 and name in ("queries", "key_gains"):  # one source: the softmax is constant
            assert (b == 0).all() and a.abs().max() < 1e-5, f"{name}: {a.abs().max():.2e}, fp32 round-off only"
            continue
        assert rel_err(a, b) < 1e-4, f"{name}: relative error {rel_err(a, b):.2e}"
    # the gradients compared are not trivially zero (one source: the softmax is constant, no key path)
    nonzero = {"x", "phi", "alpha", "bias", *(n for n, _ in named if n.startswith("taps"))}
    if S > 1:
        nonzero |= {"queries"}
    for (name, _), b in zip(named, ref_grads):
        if name in nonzero:
            assert b.abs().max() > 1e-6, name


STREAM_CASES = [
    ("S3-B2-T13-d24-k2,3", 3, 2, 13, 24, (2, 3), True, True, None),
    ("S3-B1-T9-d12-k3-tiled-rawkeys-nogain", 3, 1, 9, 12, (3,), False, False, (4, 8)),
]


@needs_triton
@pytest.mark.parametrize("case", STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
@pytest.mark.parametrize("forward", ["tile", "split", "lean"])
def test_fused_streams_match_reference(case, forward, monkeypatch):
    """``msar_attn`` (the m streams, no mixer) on the fused kernels, with the tile and the split forward (plain and
    lean)."""
    _, S, B, T, d, kernels, key_norm, gains, blocks = case
    if blocks is not None:
        from kernels.msar_attn import fused

        monkeypatch.setattr(fused, "_blocks", _blocks(*blocks))
    if forward in ("split", "lean"):
        _with_split(monkeypatch, lean=forward == "lean")
    else:
        _with_tile_forward(monkeypatch)
    x, taps, queries, key_gains, doc_ids, *_ = make_inputs(S, B, T, d, kernels, gains)
    named = [(n, t.requires_grad_()) for n, t in [("x", x), ("queries", queries), ("key_gains", key_gains),
                                                   *((f"taps[{i}]", c) for i, c in enumerate(taps))]
             if t is not None]
    leaves = [t for _, t in named]
    out, w = msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm, return_weights=True,
                       backend="triton")
    ref, ref_w = msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm, return_weights=True,
                           backend="torch")
    assert out.shape == ref.shape == (1 + len(kernels), B, T, d)
    assert rel_err(out, ref) < 1e-5 and rel_err(w, ref_w) < 1e-5
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for (name, _), a, b in zip(named, torch.autograd.grad((out * up).sum(), leaves),
                               torch.autograd.grad((ref * up).sum(), leaves)):
        assert rel_err(a, b) < 1e-4, f"{name}: relative error {rel_err(a, b):.2e}"


@needs_triton
def test_source_gradient_programs_keep_to_their_own_scratch(monkeypatch):
    """Each program of the source-gradient kernel accumulates its tap-gradient products and its κE in
    its own row of the scratch (``fused.src_scratch``), summed over its tokens at the end. On a GPU the
    programs run at once, so rows that overlap race (the query and first tap gradients came out wrong
    on an H200 host when one program's κE partials were the next program's first tap partials); the
    interpreter runs them one after another, so the sign of an overlap is what the scratch holds
    afterwards: summed over programs and tokens, its rows must give the query and tap gradients."""
    from kernels.msar_attn import fused

    # the ring kernel: 2 chunks of 2 token blocks, 2 channel tiles
    monkeypatch.setattr(fused, "_blocks", _blocks(4, 8, mode="ring"))
    seen = []

    def spy(*args):
        seen.append(fused_src_scratch(*args))
        return seen[-1]

    fused_src_scratch = fused.src_scratch
    monkeypatch.setattr(fused, "src_scratch", spy)
    S, B, T, d, kernels = 2, 2, 13, 12, (2, 3)
    x, taps, queries, _, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, False)
    named = _leaves(x, taps, queries, None, phi, alpha, bias)
    h = msar(x, taps, queries, None, doc_ids, phi, alpha, bias, backend="triton")
    up = torch.randn(h.shape, generator=torch.Generator().manual_seed(4))
    grads = dict(zip([n for n, _ in named], torch.autograd.grad((h * up).sum(), [t for _, t in named])))
    (_, partials), = seen  # (n_prog, NPAIR + M_PAD, BT, BD)
    ks, m = (1, *kernels), 1 + len(kernels)
    npair, m_pad, bt, bd = sum(ks), partials.shape[1] - sum(ks), partials.shape[2], partials.shape[3]
    n_dt = -(-d // bd)
    # program id = (chunk · B + b) · n_dt + channel tile
    per_tile = partials.reshape(-1, B, n_dt, npair + m_pad, bt, bd).sum((0, 1, 4))  # (n_dt, NPAIR + M_PAD, BD)
    per_tile = per_tile.permute(1, 0, 2).reshape(npair + m_pad, n_dt * bd)[:, :d]  # (NPAIR + M_PAD, d)
    torch.testing.assert_close(per_tile[npair:npair + m], grads["queries"], rtol=1e-5, atol=1e-6)  # no key gains
    for j in range(1, m):
        first = sum(ks[:j])
        torch.testing.assert_close(per_tile[first:first + ks[j]], grads[f"taps[{j - 1}]"], rtol=1e-5, atol=1e-6)


# (id, S, B, T, d, kernels, serial program's tokens, serial program's channels, key norm)
SERIAL = [
    ("one-token-programs", 3, 2, 13, 24, (2, 3), 1, 8, True),
    ("programs-shorter-than-the-kernel", 2, 1, 10, 16, (4, 8, 12), 5, 16, True),
    ("one-program-a-row", 2, 1, 10, 16, (4, 8, 12), 128, 128, True),
    ("one-source", 1, 2, 9, 12, (2, 5), 4, 8, True),
    ("T-below-k-rawkeys", 2, 1, 3, 8, (5,), 2, 8, False),
    ("T-1", 3, 1, 1, 8, (3,), 4, 8, True),
    ("identity-views-rawkeys", 4, 1, 7, 12, (1, 1, 1), 3, 8, False),
    ("both-window-kinds", 2, 2, 30, 8, (2, 3), 7, 8, True),  # windows with and without a boundary (serial_fast)
]


def _packed_op_inputs(case, seed):
    """The fused op's inputs for a (name, S, B, T, d, kernels, ch, bd, key_norm) case, as its kernels take them: x,
    taps, the document window bits, m, the packed taps (with ks and M_PAD), the gain-folded queries and the mixer."""
    from kernels.msar_attn import fused

    _, S, B, T, d, kernels, *_ = case
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, True, seed=seed)
    packed, ks, m_pad = fused.pack_taps(taps, d, x.device)
    return (x, taps, fused.doc_window(doc_ids), 1 + len(taps), packed, ks, m_pad,
            fused.folded_queries(queries, key_gains), fused._mixer_params(phi, alpha, bias))


@needs_triton
@pytest.mark.parametrize("case", SERIAL, ids=[c[0] for c in SERIAL])
def test_serial_source_gradients_equal_the_ring(case):
    """The serial source-gradient kernel (a program walks its tokens one at a time, scattering each dE into the
    dx of the tokens it reaches, and runs K_MAX - 1 tokens past its chunk), with and without its loads issued a
    step ahead, and with the serial stats kernel (per-channel-tile sums, finished by ``stats_from_parts``), also
    with the document masks applied only in steps whose window holds a boundary (``serial_fast``), and reducing
    dR·E alone from the forward's saved logits and ρ (with and without its loads a step ahead), against the
    ring and tile kernels, on the same dR and stats: dx, every tap gradient and the query gradient, for programs
    of one token, of fewer tokens than the kernel, of a whole row, over several channel tiles, with documents at
    odd offsets."""
    import dataclasses

    from kernels.msar_attn import fused

    _, S, B, T, d, kernels, ch, bd, key_norm = case
    x, taps, near, m, packed, ks, m_pad, qg, mixer = _packed_op_inputs(case, seed=0)
    if case[0] == "both-window-kinds":  # serial_fast's branch both ways: no boundary in the window, and one
        full = (1 << max(kernels)) - 1
        assert {True, False} == set(((near & full) == full).flatten().tolist())
    h, lse, _, saved, stats = fused.forward(x, packed, ks, m, qg, near, mixer=mixer, save=True, key_norm=key_norm,
                                            eps=1e-6, save_stats=True)
    dh = torch.randn(B, T, d, generator=torch.Generator().manual_seed(5))
    dr, *_ = fused.mixer_backward(dh, saved, mixer, eps=1e-6, sigmoid=True)
    base = fused._blocks(T, d, m_pad, max(ks))
    out = {}
    serials = ("serial", "serial-no-prefetch", "serial-stats", "serial-fast", "serial-saved", "serial-saved-prefetch",
               "serial-saved-pairs")
    for mode, prefetch, stats_mode in (("ring", True, "tile"), ("serial", True, "tile"),
                                       ("serial-no-prefetch", False, "tile"), ("serial-stats", True, "serial"),
                                       ("serial-fast", True, "serial"), ("serial-saved", True, "serial"),
                                       ("serial-saved-prefetch", True, "serial"), ("serial-saved-pairs", True, "serial")):
        # pairs: the stats kernel two tokens a trip (odd and even chunks; the default), the others one
        blk = dataclasses.replace(base, src_mode=mode.split("-")[0], serial_ch=ch, serial_bd=bd,
                                  serial_prefetch=prefetch, stats_mode=stats_mode, stats_serial_ch=ch,
                                  stats_serial_bd=bd, serial_fast=mode == "serial-fast",
                                  stats_prefetch=mode in ("serial-saved-prefetch", "serial-fast"),
                                  stats_pairs=mode.endswith("pairs"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "_blocks", lambda *_a, _b=blk: _b)
            # the forward's saved logits and ρ only for the saved modes: the others recompute them
            dx, dtaps, dqg = fused.streams_backward(dr, lse, x, taps, packed, ks, qg, near, key_norm=key_norm,
                                                    eps=1e-6, stats=stats if "saved" in mode else None)
        out[mode] = (dx, *dtaps, dqg)
    names = ["dx", *(f"taps[{i}]" for i in range(len(taps))), "dqg"]
    for serial in serials:
        # the stats summed in another order: fp32 round-off of a query gradient near zero (one view of raw keys
        # whose softmax is nearly one-hot, T-below-k-rawkeys) moves by 1.5e-5 of the tensor's norm; against an fp64
        # reference there the serial stats are off by 4.5e-6, the tile stats by 1.8e-5
        tol = 1e-4 if serial in ("serial-stats", "serial-fast") or "saved" in serial else 1e-5
        for name, a, b in zip(names, out[serial], out["ring"]):
            assert a.shape == b.shape and rel_err(a, b) < tol, f"{serial} {name}: {rel_err(a, b):.2e}"
            if name != "dqg" or S > 1:
                assert b.abs().max() > 0, name


# (id, S, B, T, d, kernels, serial program's tokens, serial program's channels, key norm): M_PAD 1 to 8
TOKEN_MAJOR = [
    *SERIAL,
    ("no-kernels-M_PAD-1", 3, 2, 9, 12, (), 4, 8, True),
    ("five-views-M_PAD-8", 4, 2, 11, 20, (2, 3, 2, 4), 5, 8, True),
    ("five-views-rawkeys-M_PAD-8", 3, 1, 17, 12, (3, 1, 2, 5), 6, 8, False),
]


@needs_triton
@pytest.mark.parametrize("case", TOKEN_MAJOR, ids=[c[0] for c in TOKEN_MAJOR])
def test_token_major_stats_equal_the_planes(case):
    """Blocks.coef_layout="token": the backward's w, κ, μ stored token-major, (S, B, T, 4, M_PAD), and read by the
    serial source-gradient kernel as one load a token split into scalars, give the same dx, tap and query
    gradients as the planes, to the bit, after every way of computing them: the serial stats kernel
    finished by the glue kernel (from the forward's saved logits and ρ, or recomputing them) or by PyTorch, and
    the tile stats kernel (written in planes, then copied); one to five sources, M_PAD 1 to 8, random upstream
    gradients, documents at odd offsets, programs of 1 token to a whole row. The planes' results are also
    checked against the ring kernel."""
    import dataclasses

    from kernels.msar_attn import fused

    _, S, B, T, d, kernels, ch, bd, key_norm = case
    x, taps, near, m, packed, ks, m_pad, qg, mixer = _packed_op_inputs(case, seed=3)
    _, lse, _, saved, stats = fused.forward(x, packed, ks, m, qg, near, mixer=mixer, save=True, key_norm=key_norm,
                                            eps=1e-6, save_stats=True)
    dh = torch.randn(B, T, d, generator=torch.Generator().manual_seed(7))
    dr, *_ = fused.mixer_backward(dh, saved, mixer, eps=1e-6, sigmoid=True)
    base = dataclasses.replace(fused._blocks(T, d, m_pad, max(ks)), serial_ch=ch, serial_bd=bd, stats_serial_ch=ch,
                               stats_serial_bd=bd)

    def grads(blk, saved_stats):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "_blocks", lambda *_a: blk)
            dx, dtaps, dqg = fused.streams_backward(dr, lse, x, taps, packed, ks, qg, near, key_norm=key_norm,
                                                    eps=1e-6, stats=saved_stats)
        return (dx, *dtaps, dqg)

    names = ["dx", *(f"taps[{i}]" for i in range(len(taps))), "dqg"]
    ring = grads(dataclasses.replace(base, src_mode="ring", stats_mode="tile"), None)
    for label, fields, saved_stats in (("glue-saved", dict(stats_glue="triton"), stats),
                                       ("glue-recomputed", dict(stats_glue="triton", stats_saved=False), None),
                                       ("torch-saved", dict(stats_glue="torch"), stats),
                                       ("tile-stats", dict(stats_mode="tile"), None)):
        planes = grads(dataclasses.replace(base, coef_layout="planes", **fields), saved_stats)
        token = grads(dataclasses.replace(base, coef_layout="token", **fields), saved_stats)
        for name, a, b, r in zip(names, token, planes, ring):
            assert a.shape == b.shape and torch.equal(a, b), f"{label} {name}: {rel_err(a, b):.2e}"
            assert rel_err(b, r) < 1e-4, f"{label} {name}: planes against the ring {rel_err(b, r):.2e}"
            if name != "dqg" or S > 1:
                assert b.abs().max() > 0, name


@needs_triton
@pytest.mark.parametrize("case", TOKEN_MAJOR, ids=[c[0] for c in TOKEN_MAJOR])
def test_token_major_parts_equal_the_planes(case):
    """Blocks.parts_layout="token": the serial stats kernel's per-tile sums stored token-major, (n_dt, S, B, T, K,
    M_PAD), a vector a (token, statistic), give the same results as the planes, to the bit: the split
    forward's pass 1 (QS) finished by the glue kernel or by PyTorch (h, the lse, the logits and ρ saved for the
    backward, R·φ, ‖vec R‖², the kept R), and the backward's stats (DR alone from the saved logits and ρ, or
    recomputing them, K = 3) finished by the glue kernel or by PyTorch (dx, tap and query gradients); one and two
    tokens a trip, one to five sources, M_PAD 1 to 8, odd T and d, documents at odd offsets, random upstream
    gradients, chunks of 1 token to a whole row and channel tiles that do not divide d."""
    import dataclasses

    from kernels.msar_attn import fused

    _, S, B, T, d, kernels, ch, bd, key_norm = case
    x, taps, near, m, packed, ks, m_pad, qg, mixer = _packed_op_inputs(case, seed=5)
    base = dataclasses.replace(fused._blocks(T, d, m_pad, max(ks)), fwd_mode="split", split_logit_bd=bd, split_ch=ch,
                               split_bd=16, stats_mode="serial", stats_serial_ch=ch, stats_serial_bd=bd)

    def run(blk, fn):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "_blocks", lambda *_a: blk)
            return fn()

    kw = dict(mixer=mixer, save=True, key_norm=key_norm, eps=1e-6, save_stats=True, save_dtype=torch.bfloat16)
    fwd_names = ("h", "lse", "R", "R·φ", "‖R‖²", "logits", "ρ")
    for fields in (dict(glue="torch", stats_pairs=True), dict(glue="triton", stats_pairs=False)):
        out = {}
        for layout in ("planes", "token"):
            h, lse, _, saved, stats = run(dataclasses.replace(base, parts_layout=layout, **fields),
                                          lambda: fused.forward(x, packed, ks, m, qg, near, **kw))
            out[layout] = (h, lse, *saved, *stats)
        for name, a, b in zip(fwd_names, out["token"], out["planes"]):
            assert (a is None) == (b is None), name
            if b is not None:
                assert a.shape == b.shape and torch.equal(a, b), f"{fields} {name}: {rel_err(a, b):.2e}"
        assert out["planes"][0].float().abs().max() > 0 and out["planes"][5].abs().max() > 0
    _, lse, _, saved, stats = run(base, lambda: fused.forward(x, packed, ks, m, qg, near, **{**kw, "save_dtype": None}))
    dh = torch.randn(B, T, d, generator=torch.Generator().manual_seed(11))
    dr, *_ = fused.mixer_backward(dh, saved, mixer, eps=1e-6, sigmoid=True)
    names = ["dx", *(f"taps[{i}]" for i in range(len(taps))), "dqg"]
    for fields, saved_stats in ((dict(stats_glue="triton", stats_pairs=True), stats),
                                (dict(stats_glue="triton", stats_saved=False, stats_pairs=False), None),
                                (dict(stats_glue="torch", stats_saved=False), None)):
        out = {}
        for layout in ("planes", "token"):
            blk = dataclasses.replace(base, parts_layout=layout, **fields)
            out[layout] = run(blk, lambda: fused.streams_backward(dr, lse, x, taps, packed, ks, qg, near,
                                                                  key_norm=key_norm, eps=1e-6, stats=saved_stats))
        token, planes = ((dx, *dtaps, dqg) for dx, dtaps, dqg in (out["token"], out["planes"]))
        for name, a, b in zip(names, token, planes):
            assert a.shape == b.shape and torch.equal(a, b), f"{fields} {name}: {rel_err(a, b):.2e}"
            if name != "dqg" or S > 1:
                assert b.abs().max() > 0, f"{fields} {name}"


@pytest.mark.parametrize("field, value, choices", [("src_mode", "rings", "'serial', 'ring'"),
                                                    ("stats_mode", "tiles", "'tile', 'serial'"),
                                                    ("fwd_mode", "splits", "'tile', 'split'"),
                                                    ("glue", "pytorch", "'torch', 'triton'"),
                                                    ("stats_glue", "pytorch", "'torch', 'triton'"),
                                                    ("coef_layout", "tokens", "'planes', 'token'"),
                                                    ("parts_layout", "token-major", "'planes', 'token'"),
                                                    ("combine_from", "bf16", "'float32', 'kept'"),
                                                    ("part_sums", "cuda", "'torch', 'triton'"),
                                                    ("mix_dphi", "kernel", "'product', 'walk', 'reduce'"),
                                                    ("dphi_partials", "bf16", "'kept', 'float32'"),
                                                    ("grad_streams", "bf16", "'float32', 'kept'")])
def test_an_unknown_kernel_mode_is_an_error(field, value, choices, monkeypatch):
    from kernels.msar_attn import fused

    _with_fields(monkeypatch, **{field: value})
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 1, 5, 8, (2,), True)
    packed, ks, _ = fused.pack_taps(taps, 8, x.device)
    dr = torch.zeros(2, 1, 5, 8)
    with pytest.raises(ValueError, match=f"{field} '{value}' is not one of {choices}"):
        fused.streams_backward(dr, torch.zeros(2, 1, 5), x, taps, packed, ks, fused.folded_queries(queries, key_gains),
                               torch.zeros(1, 5, dtype=torch.int32), key_norm=True, eps=1e-6)


@needs_triton
def test_fused_zero_queries_at_init():
    """The pseudo-queries start at zero and φ at zero (docs/method.md §4): uniform weights, g = σ(b), and
    still a query and a φ gradient."""
    x, taps, _, key_gains, doc_ids, _, alpha, _ = make_inputs(3, 1, 11, 8, (2,), True)
    queries, phi, bias = torch.zeros(2, 8), torch.zeros(16, 2), torch.zeros(2)
    named = _leaves(x, taps, queries, key_gains, phi, alpha, bias)
    h, w = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, return_weights=True, backend="triton")
    ref = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="torch")
    torch.testing.assert_close(w, torch.full_like(w, 1 / 3))
    assert rel_err(h, ref) < 1e-5
    up = torch.randn(h.shape, generator=torch.Generator().manual_seed(3))
    leaves = [t for _, t in named]
    for (name, _), a, b in zip(named, torch.autograd.grad((h * up).sum(), leaves),
                               torch.autograd.grad((ref * up).sum(), leaves)):
        assert rel_err(a, b) < 1e-4, name
        if name in ("queries", "phi"):
            assert a.abs().max() > 1e-6, name


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_a_list_of_sources_equals_the_stacked_sources(backend):
    """x as S tensors (B, T, d): the same h and the same gradient per source as the stacked tensor; the
    fused op saves the sources themselves for its backward, never an (S, B, T, d) copy."""
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(4, 2, 13, 8, (2, 5), True)  # S=4, m=3
    stacked = x.clone().requires_grad_()
    sources = [t.clone().requires_grad_() for t in x.unbind(0)]
    up = torch.randn(2, 13, 8, generator=torch.Generator().manual_seed(5))
    h_ref = msar(stacked, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend=backend)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        h = msar(sources, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend=backend)
    assert rel_err(h, h_ref) < 1e-6
    (h_ref * up).sum().backward()
    (h * up).sum().backward()
    for i, src in enumerate(sources):
        assert rel_err(src.grad, stacked.grad[i]) < 1e-6, i
    if backend == "triton":
        assert tuple(x.shape) not in saved, saved


@needs_triton
@pytest.mark.parametrize("combine_from", ["kept", "float32"])
def test_under_autocast_the_streams_are_kept_in_its_dtype(combine_from, monkeypatch):
    """fp32 sources under bf16 autocast (how the residuals run in training): the fused op keeps R for the
    mixer's backward in bf16 (half the bytes of the largest thing it saves), with the forward's h combined from
    that bf16 R (Blocks.combine_from="kept", the default: within bf16 rounding of the fp32 run's h) or from the fp32
    R (combine_from="float32": the same h to the bit), and gradients within bf16 rounding of the fp32 ones (the
    softmax backward does not read R; measured here 0.7e-3 to 1.7e-3 for the sources, queries, gains and taps,
    4.7e-3 to 6.9e-3 for φ, α, b at d = 16); without autocast R stays fp32."""
    _with_fields(monkeypatch, combine_from=combine_from)
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(4, 2, 11, 16, (2, 5), True)
    m = 1 + len(taps)  # 3 streams, 4 sources: R's shape is not the sources'
    up = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(7))

    def run(autocast: bool):
        leaves = [t.clone().requires_grad_() for t in (x, queries, key_gains, phi, alpha, bias, *taps)]
        xs, q, g, ph, al, bi, *tp = leaves
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                h = msar(xs, tp, q, g, doc_ids, ph, al, bi, backend="triton")
        streams = [t.dtype for t in saved if tuple(t.shape) == (m, 2, 11, 16)]
        return h.detach(), torch.autograd.grad((h * up).sum(), leaves), streams

    h32, g32, s32 = run(False)
    h16, g16, s16 = run(True)
    assert s32 == [torch.float32] and s16 == [torch.bfloat16], (s32, s16)
    if combine_from == "float32":
        assert torch.equal(h16, h32)
    else:  # one rounding of the streams apart (the interpreter truncates to bf16: 2^-7 relative at most)
        assert 0 < rel_err(h16, h32) < 2.0 ** -7
    for i, (a, b) in enumerate(zip(g16, g32)):
        assert rel_err(a, b) < 1e-2, f"input {i}: relative error {rel_err(a, b):.2e}"


def test_a_list_of_sources_is_checked():
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 1, 5, 8, (2,), False)
    with pytest.raises(ValueError, match=r"a list of sources must hold S >= 1 tensors \(B, T, d\) of one shape, "
                                         r"got \[\(1, 5, 8\), \(1, 4, 8\)\]"):
        msar([x[0], x[1, :, :4]], taps, queries, key_gains, doc_ids, phi, alpha, bias)
    with pytest.raises(ValueError, match=r"a list of sources must hold S >= 1"):
        msar([], taps, queries, key_gains, doc_ids, phi, alpha, bias)


@needs_triton
def test_fused_non_contiguous_inputs():
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 2, 9, 8, (3,), True)
    x_nc = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    taps_nc = [c.t().contiguous().t() for c in taps]
    phi_nc = phi.t().contiguous().t()
    assert not x_nc.is_contiguous() and not taps_nc[0].is_contiguous() and not phi_nc.is_contiguous()
    h = msar(x_nc, taps_nc, queries, key_gains, doc_ids, phi_nc, alpha, bias, backend="triton")
    ref = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="torch")
    assert rel_err(h, ref) < 1e-5


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_causal_and_document_local(backend):
    """Perturbing token t0 of one row changes no output before t0 and none in another document."""
    S, B, T, d = 2, 2, 16, 8
    x, taps, queries, key_gains, _, phi, alpha, bias = make_inputs(S, B, T, d, (3, 5), True)
    doc_ids = torch.tensor([[0] * 6 + [1] * 6 + [2] * 4, [0] * 16])
    h = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend=backend)
    t0 = 7  # inside document 1 of row 0 (tokens 6..11)
    x2 = x.clone()
    x2[:, 0, t0] += 5.0
    h2 = msar(x2, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend=backend)
    changed = (h2 - h).abs().amax(dim=-1) > 0  # (B, T)
    assert changed[0, t0]
    assert not changed[0, :t0].any(), "an earlier token saw a later one"
    assert not changed[0, 12:].any(), "another document saw the change"
    assert not changed[1].any(), "another row saw the change"


@needs_triton
@pytest.mark.parametrize("T", [1, 5, 37])
def test_doc_window_bits(T):
    """The window bits the kernels test instead of document ids: bit τ of near[b, t] is
    [t-τ >= 0 and doc(t-τ) = doc(t)], bit 16 + τ the same of t+τ, for τ < 16; ids drawn from a
    small range so one id also recurs after another document (equality, not runs, decides)."""
    from kernels.msar_attn import fused

    g = torch.Generator().manual_seed(T)
    doc_ids = torch.randint(0, 3, (3, T), generator=g)
    doc_ids[1] = doc_ids_for(1, T, g)[0]
    near = fused.doc_window(doc_ids).long() & 0xFFFFFFFF
    for b in range(3):
        for t in range(T):
            for tau in range(16):
                back = t - tau >= 0 and bool(doc_ids[b, t - tau] == doc_ids[b, t])
                ahead = t + tau < T and bool(doc_ids[b, t + tau] == doc_ids[b, t])
                assert bool((near[b, t] >> tau) & 1) == back, (b, t, tau)
                assert bool((near[b, t] >> (16 + tau)) & 1) == ahead, (b, t, tau)


# --- the reference itself --------------------------------------------------------------------------
def explicit_loop(x, taps, queries, key_gains, doc_ids, key_norm, eps=1e-6):
    """docs/method.md §4's streams written out: every view, source, token and tap by hand (fp64)."""
    S, B, T, d = x.shape
    all_taps = [torch.ones(1, d, dtype=torch.float64), *(c.double() for c in taps)]  # view 0: identity
    out = torch.zeros(len(all_taps), B, T, d, dtype=torch.float64)
    for j, c in enumerate(all_taps):
        q = queries[j].double() * (1 if key_gains is None else key_gains[j].double())
        for b in range(B):
            for t in range(T):
                views = []
                for s in range(S):
                    e = torch.zeros(d, dtype=torch.float64)
                    for tau in range(c.shape[0]):
                        if t - tau >= 0 and doc_ids[b, t - tau] == doc_ids[b, t]:
                            e = e + c[tau] * x[s, b, t - tau].double()
                    views.append(e)
                keys = [e / torch.sqrt((e * e).mean() + eps) if key_norm else e for e in views]
                w = torch.softmax(torch.stack([(k * q).sum() for k in keys]), 0)
                out[j, b, t] = sum(w[s] * views[s] for s in range(S))
    return out


def explicit_mix(streams, phi, alpha, bias, fusion, eps=1e-6):
    """docs/method.md §4's mixer per token: R ∈ R^{m×d}, g = σ(α·RMSNorm(vec R)·φ + b), h = Σ_j g_j r^{(j)}."""
    m, B, T, d = streams.shape
    h = torch.zeros(B, T, d, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            R = streams[:, b, t]  # (m, d)
            v = R.reshape(-1)  # vec R: stream j's channel c at j·d + c
            z = alpha * (v / torch.sqrt((v * v).mean() + eps)) @ phi + bias
            g = torch.sigmoid(z) if fusion == "sigmoid" else torch.softmax(z, 0)
            h[b, t] = (g[:, None] * R).sum(0)
    return h


@pytest.mark.parametrize("key_norm, fusion", [(True, "sigmoid"), (False, "softmax")],
                         ids=["key-norm-sigmoid", "raw-keys-softmax"])
def test_reference_equals_explicit_loop(key_norm, fusion):
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 2, 6, 5, (2, 3), True,
                                                                         dtype=torch.float64)
    streams = reference.msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm)
    expected = explicit_loop(x, taps, queries, key_gains, doc_ids, key_norm)
    torch.testing.assert_close(streams, expected)
    h = reference.msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, key_norm=key_norm, fusion=fusion)
    torch.testing.assert_close(h, explicit_mix(expected, phi, alpha, bias, fusion))


@pytest.mark.parametrize("fusion", ["sigmoid", "softmax"])
def test_reference_gradcheck_fp64(fusion):
    """Every input of the whole reference op, in fp64 (the mixer's RMSNorm promotes, not fp32)."""
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 1, 5, 3, (2, 3), True,
                                                                         dtype=torch.float64)

    def f(x, queries, key_gains, phi, alpha, bias, *taps):
        return reference.msar(x, list(taps), queries, key_gains, doc_ids, phi, alpha, bias, fusion=fusion)

    leaves = [t.requires_grad_() for t in (x, queries, key_gains, phi, alpha, bias, *taps)]
    assert f(*leaves).dtype == torch.float64
    assert torch.autograd.gradcheck(f, tuple(leaves))


# --- dispatch --------------------------------------------------------------------------------------
def test_unknown_backend_lists_choices():
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(1, 1, 4, 4, (2,), False)
    with pytest.raises(ValueError, match="auto, torch, triton"):
        msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="cuda")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        msar_attn(x, taps, queries, key_gains, doc_ids, backend="cuda")


@pytest.mark.parametrize("what", ["k-too-large", "fp64", "bad-queries", "bad-doc-ids", "bad-phi", "bad-alpha",
                                  "bad-bias", "bad-fusion"])
def test_unsupported_inputs_are_refused(what):
    dtype = torch.float64 if what == "fp64" else torch.float32
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(
        1, 1, 4, 4, (17 if what == "k-too-large" else 2,), True, dtype=dtype)
    fusion = "tanh" if what == "bad-fusion" else "sigmoid"
    queries = queries[:1] if what == "bad-queries" else queries
    doc_ids = doc_ids[:, :3] if what == "bad-doc-ids" else doc_ids
    phi = phi[:-1] if what == "bad-phi" else phi
    alpha = alpha.expand(2) if what == "bad-alpha" else alpha
    bias = bias[:1] if what == "bad-bias" else bias
    with pytest.raises(ValueError, match="msar"):
        msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, fusion=fusion, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path without the interpreter")
def test_triton_on_cpu_without_interpreter_is_an_error():
    code = ("import torch; from kernels.msar_attn import msar\n"
            "x = torch.randn(1, 1, 4, 4); q = torch.randn(2, 4); c = [torch.randn(2, 4)]\n"
            "d = torch.zeros(1, 4, dtype=torch.long)\n"
            "try:\n    msar(x, c, q, None, d, torch.zeros(8, 2), torch.tensor(0.01), torch.zeros(2), backend='triton')\n"
            "except RuntimeError as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert "REFUSED" in res.stdout and "TRITON_INTERPRET=1" in res.stdout, res.stdout + res.stderr


def test_auto_is_torch_on_cpu():
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 1, 5, 4, (2,), True)
    a = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="auto")
    b = msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="torch")
    assert torch.equal(a, b)


def _run_compiled(*args: str) -> str:
    """``python ARGS`` from the repo root without TRITON_INTERPRET (a compile for sm_90a needs Triton's real
    backend); its stdout, after asserting it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="the triton wheel has no ptxas")
@pytest.mark.parametrize("views_3d", ["default", "on"])
def test_kernels_compile_for_sm90_with_few_spills(views_3d):
    """Every fused kernel compiles for an H100/H200 (Triton's NVIDIA backend and ptxas, no GPU needed),
    with the tile sizes ``_blocks`` picks at model=small, and with the view builder's 3-d layout (a candidate
    of benchmarks.msar_tiles): catches GPU-only compile errors on CPU CI."""
    stdout = _run_compiled("-m", "benchmarks.msar_attn_ptxas", "--shapes", "small", "--views-3d", views_3d)
    lines = [line for line in stdout.splitlines() if "registers" in line]
    # window bits, the tile forward, the tile forward over one source, the split forward's two passes (pass 1 and
    # its sums in planes; pass 2 plain, lean, lean two tokens a trip, one and two with a source's rows loaded a
    # source ahead, and four on 64 channels), the three glue
    # kernels (the softmax also from sums in planes; w, κ, μ written in planes, and from sums in planes) and
    # its h, the mixer, the stats (and their sums in planes), the sources (and reading w, κ, μ in planes: the
    # layouts token-major by default since 2026-12-05, the planes the listed candidates; the source gradients with
    # two tokens' loads in flight, a candidate), the mixer, the stats and the sources with dR in bf16 (candidates,
    # Blocks.grad_streams), the source gradients' partial sums (Blocks.part_sums="triton", the default), and the
    # mixer's backward with dφ summed inside (Blocks.mix_dphi="walk", a candidate) or by a reduction kernel after it
    # (Blocks.mix_dphi="reduce", a candidate; its products summed every step or once at the end, Blocks.dphi_late),
    # and the mixer's backward summing Σ dz and Σ dz·y a row a program (Blocks.mix_sums="kernel", a candidate)
    assert len(lines) == 32, stdout
    spills = {line.split(" {")[0]: int(re.search(r"(\d+) bytes spill stores", line).group(1)) for line in lines}
    # a few hundred bytes at most: the tiles are chosen by timing (benchmarks.msar_tiles), and 4 warps
    # with a few spilled values beat 16 warps without; a tile that spills kilobytes costs far more.
    # The one-source forward at 2 warps spills about 1.2 KB and was timed faster than at 4 warps
    # (0.249 against 0.345 ms, msar_tiles_nvidia_h200_passes_s1.md): bounded, not exempt.
    one = spills.pop("forward, one source")
    assert max(spills.values()) <= 512 and one <= 2048, stdout
    # compiled as a launch specialises them (aligned pointers, multiples of 16): the streams backward's two
    # kernels spill a few values at most. An int64 offset kept per element, with the buffered sources'
    # second row offset live across the block loop, spilled 376 bytes in the source-gradient kernel and
    # made the streams backward 3.09 -> 4.30 ms at `small` on an H200 (msar_tiles_nvidia_h200_regs.md)
    if views_3d == "default":  # (the 3-d view layout, a candidate that lost, spills 172 bytes in the stats)
        assert spills["stats"] <= 64 and spills["source gradients"] <= 64, stdout
        # Blocks.coef_layout="token" (the default): a token's w, κ, μ in one load frees registers (8 bytes spilled
        # in planes -> 0 at `small`)
        assert spills["source gradients"] <= spills["source gradients, w κ μ in planes (candidate)"], stdout
        # Blocks.parts_layout="token" (the default): a token's sums in one store each, no more spills than the planes
        assert spills["stats"] <= spills["stats, sums in planes (candidate)"], stdout
        # the split forward's kernels (the default forward) are serial like the stats: none spill at their tiles
        assert all(spills[k] == 0 for k in spills if k.startswith("split forward")), stdout


# --- GPU, and the same checks on CPU at small shapes ------------------------------------------------
# (id, S, B, T, d, kernels, key_norm, gains, fusion)
GPU_CASES = [
    ("S5-B4-T1024-d512-k4,8,12", 5, 4, 1024, 512, (4, 8, 12), True, True, "sigmoid"),
    ("S9-B2-T2048-d1024-k4,8,12", 9, 2, 2048, 1024, (4, 8, 12), True, True, "sigmoid"),
    ("S3-B2-T333-d2048-k4,8,12-softmax", 3, 2, 333, 2048, (4, 8, 12), True, True, "softmax"),
    ("S3-B2-T333-d3000-k3,5-rawkeys", 3, 2, 333, 3000, (3, 5), False, False, "sigmoid"),
]
# the same checks under the interpreter: (case, block override for fused._blocks or None)
CPU_TWIN_CASES = [
    (("S3-B2-T13-d24-k2,3-softmax", 3, 2, 13, 24, (2, 3), True, True, "softmax"), None),
    (("S3-B1-T11-d12-k3,5-tiled-rawkeys", 3, 1, 11, 12, (3, 5), False, False, "sigmoid"), (4, 8)),
]
# bf16 inputs against the fp32 reference on the same bf16-rounded inputs (and the same bf16-rounded
# upstream gradient): the kernel computes in fp32 and rounds h, dx and the gradients of bf16
# parameters to bf16 once (R too, for dφ only), so ~2^-8 relative per element; 2e-2 over the tensor
BF16_TOL = 2e-2


def _low_precision_inputs(case, dtype, device):
    """Sources, taps, queries and key gains in dtype; φ, α, b fp32 (the mixer's parameters)."""
    _, S, B, T, d, kernels, key_norm, gains, fusion = case
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, gains, device=device)
    named = _leaves(x, taps, queries, key_gains, phi, alpha, bias)
    cast = [(n, t.detach().to(dtype if n in ("x", "queries", "key_gains") or n.startswith("taps")
                                else torch.float32).requires_grad_()) for n, t in named]
    return cast, doc_ids, key_norm, fusion


def _call(named, doc_ids, key_norm, fusion, backend):
    t = dict(named)
    taps = [t[n] for n, _ in named if n.startswith("taps")]
    return msar(t["x"], taps, t["queries"], t.get("key_gains"), doc_ids, t["phi"], t["alpha"], t["bias"],
                key_norm=key_norm, fusion=fusion, return_weights=True, backend=backend)


def check_bf16_matches_fp32_reference(case, device):
    bf, doc_ids, key_norm, fusion = _low_precision_inputs(case, torch.bfloat16, device)
    ref_in = [(n, t.detach().float().requires_grad_()) for n, t in bf]
    h, w = _call(bf, doc_ids, key_norm, fusion, "triton")
    ref, ref_w = _call(ref_in, doc_ids, key_norm, fusion, "torch")
    assert h.dtype == torch.bfloat16
    assert rel_err(h, ref) < BF16_TOL
    assert rel_err(w, ref_w) < BF16_TOL
    # the fused backward receives dh in h's dtype (autograd rounds it to bf16): the reference gets the same
    # values, else the rounding of dh alone moves the scalar gradients (Σ over tokens of terms of random
    # sign, so sometimes near zero: dα by 2.7e-2 for 1 draw of 24 at S=5, T=1024, d=512)
    up = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(device).to(h.dtype).float()
    grads = torch.autograd.grad((h.float() * up).sum(), [t for _, t in bf])
    ref_grads = torch.autograd.grad((ref * up).sum(), [t for _, t in ref_in])
    for (name, _), a, b in zip(bf, grads, ref_grads):
        assert a.dtype == (torch.float32 if name in ("phi", "alpha", "bias") else torch.bfloat16), name
        assert rel_err(a, b) < BF16_TOL, f"{name}: relative error {rel_err(a, b):.2e}"


def check_fp32_matches_reference(case, device):
    named, doc_ids, key_norm, fusion = _low_precision_inputs(case, torch.float32, device)
    h, w = _call(named, doc_ids, key_norm, fusion, "triton")
    ref, ref_w = _call(named, doc_ids, key_norm, fusion, "torch")
    assert rel_err(h, ref) < 1e-5 and rel_err(w, ref_w) < 1e-5
    up = torch.randn(h.shape, generator=torch.Generator().manual_seed(2)).to(device)
    leaves = [t for _, t in named]
    for (name, _), a, b in zip(named, torch.autograd.grad((h * up).sum(), leaves),
                               torch.autograd.grad((ref * up).sum(), leaves)):
        assert rel_err(a, b) < 1e-4, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pass2", ["plain", "lean", "src-ahead2", "combine-float32", "part-sums-torch",
                                   "grad-streams-kept", "mix-dphi-walk", "mix-dphi-product",
                                   "mix-dphi-reduce", "mix-sums-kernel", "pack-twice"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_bf16_matches_fp32_reference(case, pass2, monkeypatch):
    """On the GPU's tiles, with the split forward's plain pass 2 and its lean one (Blocks.split_lean: d 2048 and
    3000 are the lean pass's unmasked and masked channel tiles), with the source-gradient kernel's loads two
    tokens ahead (Blocks.serial_ahead2, a candidate), with h combined from the fp32 streams and then copied
    (Blocks.combine_from="float32", the combine before 2026-12-06 night), and with the source gradients' partials
    summed by torch (Blocks.part_sums="torch", before the same night), and with dR in bf16 (Blocks.grad_streams=
    "kept", a candidate: the bf16 inputs make the kept streams bf16), and with dφ summed inside the mixer's
    backward (Blocks.mix_dphi="walk", a candidate: d 512 and 1024 run it, 2048 and 3000 the product), and by the
    product after it (Blocks.mix_dphi="product", the setting before 2026-12-07's final session; the default is one
    reduction kernel after it, its products kept per token and summed once at the end, Blocks.dphi_late at 4 tokens a
    step), by the reduction summing its products every step (Blocks.dphi_late=False at 8 tokens a step), with Σ dz
    and Σ dz·y summed by the product's mixer backward programs (Blocks.mix_sums="kernel", a candidate), and with the
    backward packing the
    taps, queries and φᵀ again (Blocks.pack_once=False; taking the forward's is the default since 2026-12-06, final
    session, when both ran on an H100 and passed)."""
    if pass2 == "lean":
        _with_lean(monkeypatch)
    if pass2 == "src-ahead2":
        _with_fields(monkeypatch, serial_ahead2=True)
    if pass2 == "combine-float32":
        _with_fields(monkeypatch, combine_from="float32")
    if pass2 == "part-sums-torch":
        _with_fields(monkeypatch, part_sums="torch")
    if pass2 == "grad-streams-kept":
        _with_fields(monkeypatch, grad_streams="kept")
    if pass2 == "mix-dphi-walk":
        _with_fields(monkeypatch, mix_dphi="walk")
    if pass2 == "mix-dphi-product":
        _with_fields(monkeypatch, mix_dphi="product")
    if pass2 == "mix-dphi-reduce":
        _with_fields(monkeypatch, mix_dphi="reduce", dphi_late=False, dphi_bt=8)
    if pass2 == "mix-sums-kernel":
        _with_fields(monkeypatch, mix_dphi="product", mix_sums="kernel")
    if pass2 == "pack-twice":
        _with_fields(monkeypatch, pack_once=False)
    check_bf16_matches_fp32_reference(case, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [96, 1500])
def test_gpu_fp32_matches_reference(d):
    check_fp32_matches_reference(("fp32", 3, 2, 257, d, (4, 8, 12), True, True, "sigmoid"), "cuda")


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "bf16-lean", "bf16-float32-combine", "fp32-mix-walk",
                                   "bf16-mix-reduce", "bf16-mix-product"])
@pytest.mark.parametrize("case, blocks", CPU_TWIN_CASES, ids=[c[0][0] for c in CPU_TWIN_CASES])
def test_gpu_checks_on_cpu(case, blocks, dtype, monkeypatch):
    """The two GPU tests' checks, under the interpreter at small shapes (one tile, and tiled channels; bf16 also
    with the lean pass 2, whose unmasked loads read bf16 sources, and with h combined from fp32 streams,
    Blocks.combine_from="float32"; fp32 also with dφ summed inside the mixer's backward, Blocks.mix_dphi="walk",
    which the tiled case's channel tiles turn into the product; bf16 also with dφ, Σ dz and Σ dz·y by the reduction
    kernel summing every step, Blocks.dphi_late=False, and by the product, Blocks.mix_dphi="product", the default's
    two alternatives): the comparison logic itself runs in CI."""
    if blocks is not None:
        from kernels.msar_attn import fused

        mode = {"bf16-lean": "lean", "bf16-float32-combine": "split"}.get(dtype, "serial")
        monkeypatch.setattr(fused, "_blocks", _blocks(*blocks, mode=mode))
    elif dtype == "bf16-lean":
        _with_lean(monkeypatch)
    if dtype == "bf16-float32-combine":
        _with_fields(monkeypatch, combine_from="float32")
    if dtype == "fp32-mix-walk":
        _with_fields(monkeypatch, mix_dphi="walk", mix_walk=4)
    if dtype == "bf16-mix-reduce":
        _with_fields(monkeypatch, mix_dphi="reduce", dphi_late=False, dphi_bt=4, dphi_bd=16)
    if dtype == "bf16-mix-product":
        _with_fields(monkeypatch, mix_dphi="product")
    (check_fp32_matches_reference if dtype.startswith("fp32") else check_bf16_matches_fp32_reference)(case, "cpu")


@needs_triton
@pytest.mark.parametrize("case", CPU_TWIN_CASES[:1] + [(("S2-B1-T7-d8-k3-rawkeys-no-gains", 2, 1, 7, 8, (3,), False,
                                                         False, "sigmoid"), None)], ids=["gains", "no-gains"])
def test_backward_takes_what_the_forward_packed(case, monkeypatch):
    """Blocks.pack_once: the backward takes the packed taps, the folded queries and the mixer's φᵀ that the forward
    made, instead of making them again: pack_taps, folded_queries and _mixer_params run once a read instead of twice,
    and h and every gradient are the same to the bit (random upstream gradient; queries with and without key gains)."""
    from kernels.msar_attn import fused

    calls = []
    for name in ("pack_taps", "folded_queries", "_mixer_params"):
        inner = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _f=inner, _n=name, **k: calls.append(_n) or _f(*a, **k))
    runs = {}
    for once in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            _with_fields(mp, pack_once=once)
            named, doc_ids, key_norm, fusion = _low_precision_inputs(case[0], torch.float32, "cpu")
            calls.clear()
            h, _ = _call(named, doc_ids, key_norm, fusion, "triton")
            up = torch.randn(h.shape, generator=torch.Generator().manual_seed(6))
            grads = torch.autograd.grad((h * up).sum(), [t for _, t in named])
            runs[once] = (h, grads, sorted(calls))
    (h1, g1, c1), (h0, g0, c0) = runs[True], runs[False]
    assert c1 == sorted(["pack_taps", "folded_queries", "_mixer_params"]) and c0 == sorted(c1 * 2), (c1, c0)
    assert torch.equal(h1, h0)
    for a, b in zip(g1, g0):
        assert torch.equal(a, b)
    assert any(g.abs().max() > 0 for g in g1)


@needs_triton
@pytest.mark.parametrize("gains", [True, False], ids=["gains", "no-gains"])
def test_reads_take_what_pack_reads_made_once(gains):
    """pack_reads (Msar.pack_step): every consumer's packed taps, folded queries, φᵀ and the document window made
    once for C consumers equal to the bit what each read makes (pack_taps, folded_queries, _mixer_params,
    doc_window); a read given its entry makes none of them, and its h and every gradient (random upstream) equal
    the read that packs its own, to the bit."""
    from kernels.msar_attn import fused, pack_reads

    S, B, T, d, kernels, C = 3, 2, 11, 12, (2, 5), 3
    per = [make_inputs(S, B, T, d, kernels, gains, seed=10 + c) for c in range(C)]
    x, doc_ids = per[0][0], per[0][4]
    stack = [torch.stack([p[i] for p in per]) for i in (2, 5, 6, 7)]  # queries, φ, α, b: (C, ...)
    taps = [torch.stack([p[1][j] for p in per]) for j in range(len(kernels))]  # m-1 of (C, k_j, d)
    gain = torch.stack([p[3] for p in per]) if gains else None
    packs = pack_reads(taps, stack[0], gain, *stack[1:], doc_ids)
    assert len(packs) == C
    near = fused.doc_window(doc_ids)
    for c, (_, tc, q, g, _, phi, alpha, bias) in enumerate(per):
        packed, ks, _ = fused.pack_taps(tc, d, x.device)
        assert packs[c].ks == ks and torch.equal(packs[c].taps, packed) and packs[c].taps.is_contiguous()
        assert torch.equal(packs[c].qg, fused.folded_queries(q, g))
        for a, b in zip(packs[c].mixer, fused._mixer_params(phi, alpha, bias)):
            assert a.shape == b.shape and a.is_contiguous() and torch.equal(a, b)
        assert torch.equal(packs[c].near, near)

    c = 1
    _, tc, q, g, _, phi, alpha, bias = per[c]
    up = torch.randn(B, T, d, generator=torch.Generator().manual_seed(3))
    runs = []
    for packed in (packs[c], None):
        leaves = [t.detach().clone().requires_grad_() for t in (x, q, phi, alpha, bias, *tc)]
        xl, ql, phil, al, bl, *tl_ = leaves
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            for name in ("pack_taps", "folded_queries", "_mixer_params", "doc_window"):
                inner = getattr(fused, name)
                mp.setattr(fused, name, lambda *a, _f=inner, _n=name, **k: calls.append(_n) or _f(*a, **k))
            h = msar(xl, tl_, ql, g, doc_ids, phil, al, bl, backend="triton", packed=packed)
            grads = torch.autograd.grad((h * up).sum(), leaves)
        runs.append((h, grads, calls))
    (h1, g1, c1), (h0, g0, c0) = runs
    assert c1 == [] and sorted(c0) == sorted(["pack_taps", "folded_queries", "_mixer_params", "doc_window"]), (c1, c0)
    assert torch.equal(h1, h0)
    for a, b in zip(g1, g0):
        assert torch.equal(a, b)
    assert all(t.abs().max() > 0 for t in g1)


@needs_triton
def test_pack_reads_refuses_what_does_not_match():
    from kernels.msar_attn import pack_reads

    x, taps, q, g, doc_ids, phi, alpha, bias = make_inputs(2, 1, 5, 8, (2, 3), True)
    C = 2
    ctaps = [t.expand(C, -1, -1) for t in taps]
    cq, cg, cphi, ca, cb = (t.expand(C, *t.shape) for t in (q, g, phi, alpha, bias))
    with pytest.raises(ValueError, match=r"phi must be \(2, 24, 3\)"):
        pack_reads(ctaps, cq, cg, cphi[:, :-1], ca, cb, doc_ids)
    with pytest.raises(ValueError, match="taps must be m-1 = 2 tensors"):
        pack_reads(ctaps[:1], cq, cg, cphi, ca, cb, doc_ids)
    with pytest.raises(ValueError, match="doc_ids must be integer"):
        pack_reads(ctaps, cq, cg, cphi, ca, cb, doc_ids.float())
    packs = pack_reads(ctaps, cq, cg, cphi, ca, cb, doc_ids)
    with pytest.raises(ValueError, match="applies to the fused backend.*'torch'"):
        msar(x, taps, q, g, doc_ids, phi, alpha, bias, backend="torch", packed=packs[0])
    with pytest.raises(ValueError, match=r"kernel sizes \(1, 2, 3\) against \(1, 2, 4\)"):
        msar(x, [taps[0], torch.randn(4, 8)], q, g, doc_ids, phi, alpha, bias, backend="triton", packed=packs[0])
    with pytest.raises(ValueError, match=r"doc_ids \(1, 5\) against \(1, 4\)"):
        msar(x[:, :, :4], taps, q, g, doc_ids[:, :4], phi, alpha, bias, backend="triton", packed=packs[0])


class _MixerSums:
    """A fused forward's saved streams and a random dh at (S, B, T, d, kernels, fusion): ``grads(**fields)`` runs
    the mixer's backward with those fields of the chosen tiles replaced; ``check(candidate)`` holds a candidate's dR,
    dφ, dα and db to the product's, and its dφ, dα and db to their fp64 definition (the reference mixer's backward
    on the same streams)."""

    def __init__(self, S, B, T, d, kernels, fusion, *, seed, dh_seed, **base_fields):
        import dataclasses

        from kernels.msar_attn import fused

        self.fused = fused
        x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, True, seed=seed)
        packed, ks, m_pad = fused.pack_taps(taps, d, x.device)
        self.params, self.fusion, self.sigmoid = (phi, alpha, bias), fusion, fusion == "sigmoid"
        self.mixer = fused._mixer_params(phi, alpha, bias)
        _, _, _, self.saved, _ = fused.forward(x, packed, ks, 1 + len(taps), fused.folded_queries(queries, key_gains),
                                               fused.doc_window(doc_ids), mixer=self.mixer, save=True, key_norm=True,
                                               eps=1e-6, sigmoid=self.sigmoid)
        self.dh = torch.randn(B, T, d, generator=torch.Generator().manual_seed(dh_seed))
        # the product's settings unless a case says otherwise: the candidates are compared with it
        self.base = dataclasses.replace(fused._blocks(T, d, m_pad, max(ks)), **{"mix_dphi": "product", **base_fields})
        self.product = self.grads(mix_dphi="product")

    def grads(self, **fields):
        import dataclasses

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(self.fused, "_blocks", lambda *_a, _b=dataclasses.replace(self.base, **fields): _b)
            return self.fused.mixer_backward(self.dh, self.saved, self.mixer, eps=1e-6, sigmoid=self.sigmoid)

    def check(self, candidate):
        for name, a, b in zip(("dR", "dφ", "dα", "db"), candidate, self.product):
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
            assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.2e}"
            assert b.abs().max() > 0, name
        p64, a64, b64 = (t.detach().double().requires_grad_() for t in self.params)
        h = reference.mix(self.saved[0].double(), p64, a64, b64, fusion=self.fusion, eps=1e-6)
        want = torch.autograd.grad((h * self.dh.double()).sum(), [p64, a64, b64])
        for name, a, b in zip(("dφ", "dα", "db"), candidate[1:], want):
            assert rel_err(a.double().reshape(b.shape), b) < 1e-5, f"{name} against fp64: {rel_err(a.double(), b):.2e}"


# (id, S, B, T, d, kernels, mix_walk, mix_walk_bt, fusion): M_PAD above m, tokens that do not fill the last program
# or its last step, a program of one step, a program longer than every row, d not a power of two
MIX_WALK = [
    ("m3-ragged-last-program", 2, 2, 13, 24, (2, 3), 8, 2, "sigmoid"),
    ("m4-softmax-one-step-programs", 3, 1, 11, 12, (3, 5, 2), 2, 2, "softmax"),
    ("m2-one-program", 1, 3, 7, 20, (4,), 64, 4, "sigmoid"),
    ("m5-M_PAD-8-odd-steps", 2, 2, 9, 10, (2, 3, 2, 4), 12, 4, "sigmoid"),
    ("m3-default-walk", 2, 2, 13, 24, (2, 3), 0, 2, "sigmoid"),  # 0: as many programs as multiprocessors (4 on CPU)
]


@needs_triton
@pytest.mark.parametrize("case", MIX_WALK, ids=[c[0] for c in MIX_WALK])
def test_mixer_backward_walking_sums_dphi_as_the_product(case):
    """Blocks.mix_dphi="walk": the mixer's backward summing dφ, Σ dz and Σ dz·y inside its kernel (a program walks
    mix_walk tokens of the flattened rows, mix_walk_bt a step) gives the product's dR, dφ, dα and db: with a random
    upstream gradient, M_PAD above m, sigmoid and softmax gates, programs of one step, one program for all tokens,
    and a last program and step that the tokens do not fill. dφ is also checked against its definition, Σ_t vec R ⊗
    α ρ_R dz, from an fp64 reference of the gate's backward. Where d needs several channel tiles the product runs."""
    import dataclasses

    _, S, B, T, d, kernels, walk, bt, fusion = case
    sums = _MixerSums(S, B, T, d, kernels, fusion, seed=4, dh_seed=9)
    assert sums.base.bwd_bd >= d  # one tile: the walking kernel runs
    sums.check(sums.grads(mix_dphi="walk", mix_walk=walk, mix_walk_bt=bt))
    # several channel tiles: the product, whatever mix_dphi says
    with pytest.MonkeyPatch.context() as mp:
        tiled = dataclasses.replace(sums.base, bwd_bd=1 << ((d - 1).bit_length() - 1), mix_dphi="walk")  # below d
        mp.setattr(sums.fused, "_blocks", lambda *_a: tiled)
        mp.setattr(sums.fused, "_mix_bwd_walk_kernel", None)  # not called
        got = sums.fused.mixer_backward(sums.dh, sums.saved, sums.mixer, eps=1e-6, sigmoid=sums.sigmoid)
        for name, a, b in zip(("dR", "dφ", "dα", "db"), got, sums.product):
            assert rel_err(a, b) < 1e-5, f"tiled {name}: {rel_err(a, b):.2e}"


# (id, S, B, T, d, kernels, bwd_bt, bwd_bd or None for _blocks', fusion): M_PAD above m, a last token block that the
# tokens do not fill, one block for every token, channel tiles that d does not fill (dg summed over them)
MIX_SUMS = [
    ("m3-ragged-last-block", 2, 2, 13, 24, (2, 3), 4, None, "sigmoid"),
    ("m4-softmax", 3, 1, 11, 12, (3, 5, 2), 2, None, "softmax"),
    ("m2-one-block", 1, 3, 7, 20, (4,), 8, None, "sigmoid"),
    ("m5-M_PAD-8", 2, 2, 9, 10, (2, 3, 2, 4), 4, None, "sigmoid"),
    ("m3-channel-tiles", 2, 2, 13, 20, (2, 3), 4, 8, "softmax"),
]


@needs_triton
@pytest.mark.parametrize("case", MIX_SUMS, ids=[c[0] for c in MIX_SUMS])
def test_mixer_backward_sums_dz_in_its_kernel(case):
    """Blocks.mix_sums="kernel": each program of the mixer's backward sums its tokens' dz and dz·y into one row, and
    one sum finishes db and dα. With a random upstream gradient, M_PAD above m, sigmoid and softmax gates, a last
    token block the tokens do not fill, one block for every token and channel tiles d does not fill, dR, dφ, dα and
    db equal the torch sums' and dφ, dα, db their fp64 definition; the per-token dz and dz·y are not written (the
    candidate passes no buffers for them), and with the reduction (which reads them) the setting gives the
    reduction's results."""
    _, S, B, T, d, kernels, bt, bd, fusion = case
    sums = _MixerSums(S, B, T, d, kernels, fusion, seed=6, dh_seed=11, bwd_bt=bt, **({} if bd is None else
                                                                                   {"bwd_bd": bd}))
    got = sums.grads(mix_sums="kernel")
    sums.check(got)
    assert got[2].shape == () and got[3].shape == sums.product[3].shape
    calls = []
    kernel = sums.fused._mix_bwd_kernel
    with pytest.MonkeyPatch.context() as mp:  # what the kernel was given: no dz, no dz·y, one row a program
        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    calls.append((grid, args[8], args[10], args[11], kw["SUMS"]))
                    return kernel[grid](*args, **kw)
                return launch
        mp.setattr(sums.fused, "_mix_bwd_kernel", Spy())
        sums.grads(mix_sums="kernel")
        sums.check(sums.grads(mix_sums="kernel", mix_dphi="reduce", dphi_bt=4, dphi_bd=16))
    (grid, dz, dzy, part, flag), (_, dz2, dzy2, part2, flag2) = calls
    assert flag and dz is None and dzy is None and part.shape == (B * -(-T // bt), 1 + len(kernels) + 1)
    assert grid == (-(-T // bt), B)
    assert not flag2 and part2 is None and dz2.shape == (B, T, 1 + len(kernels)) and dzy2.shape == (B, T)


# (id, S, B, T, d, kernels, dphi_chunk, dphi_bt, dphi_bd, fusion): M_PAD above m, chunks and steps that the tokens do
# not fill, one chunk for every token, channel tiles that d does not fill, the default chunks
DPHI_REDUCE = [
    ("m3-ragged-chunks", 2, 2, 13, 24, (2, 3), 8, 4, 16, "sigmoid"),
    ("m4-softmax-one-step-chunks", 3, 1, 11, 12, (3, 5, 2), 2, 2, 8, "softmax"),
    ("m2-one-chunk", 1, 3, 7, 20, (4,), 64, 8, 32, "sigmoid"),
    ("m5-M_PAD-8-odd-steps", 2, 2, 9, 10, (2, 3, 2, 4), 12, 8, 4, "sigmoid"),
    ("m3-default-chunks", 2, 2, 13, 40, (2, 3), 0, 8, 128, "sigmoid"),  # 0: four chunks under the interpreter
]


@needs_triton
@pytest.mark.parametrize("part_sums, late", [("triton", False), ("torch", False), ("triton", True)],
                         ids=["sum-rows", "torch-sum", "sum-rows-late"])
@pytest.mark.parametrize("case", DPHI_REDUCE, ids=[c[0] for c in DPHI_REDUCE])
def test_dphi_reduce_sums_dphi_as_the_product(case, part_sums, late):
    """Blocks.mix_dphi="reduce": dφ, Σ dz and Σ dz·y summed by one kernel after the mixer's backward (a program a
    channel tile and a token chunk, R read once) give the product's dR, dφ, dα and db, with a random upstream
    gradient, M_PAD above m, sigmoid and softmax gates, chunks of one step, one chunk for every token, a last chunk
    and step that the tokens do not fill, channel tiles narrower and wider than d, the chunks' rows summed by either
    part_sums, the products summed every step or once at the end (Blocks.dphi_late); dφ, dα and db also against
    their fp64 definition (the reference mixer's backward)."""
    _, S, B, T, d, kernels, chunk, bt, bd, fusion = case
    sums = _MixerSums(S, B, T, d, kernels, fusion, seed=5, dh_seed=10, part_sums=part_sums)
    sums.check(sums.grads(mix_dphi="reduce", dphi_chunk=chunk, dphi_bt=bt, dphi_bd=bd, dphi_late=late))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_dphi_partials_in_fp32_keep_dphi_to_fp32_round_off(device):
    """Blocks.dphi_partials="float32": the product's partials of dφ from bf16 R come out in fp32 (on a GPU the
    product's own fp32 output), so dφ is within fp32 round-off of its fp64 sum over the same bf16 values, while
    the partials in R's dtype are each rounded to 8 bits (the measured 2.4e-3, an order of magnitude above)."""
    from kernels.msar_attn import fused

    g = torch.Generator().manual_seed(8)
    m, B, T, d = 4, 2, 512, 48
    r = torch.randn(m, B, T, d, generator=g).to(device=device, dtype=torch.bfloat16)
    coef = torch.randn(B, T, m, generator=g).to(device)
    cb = coef.to(torch.bfloat16).double()  # what both products take
    want = torch.einsum("jnc,ni->jci", r.double().reshape(m, B * T, d), cb.reshape(B * T, m)).reshape(m * d, m)
    fp32 = fused.dphi_from(r, coef, fp32_partials=True)
    kept = fused.dphi_from(r, coef)
    assert fp32.dtype == kept.dtype == torch.float32
    assert rel_err(fp32.double(), want) < 1e-5
    assert rel_err(kept.double(), want) > 10 * rel_err(fp32.double(), want)


@pytest.mark.parametrize("B,T", [(2, 96), (1, 13), (3, 64)], ids=["split-64", "one-product", "split-64-odd-B"])
def test_dphi_split_over_tokens_matches_one_product(B, T):
    """dφ = Σ_t vec R ⊗ coef, split into batched products over token chunks (fused.dphi_from) when the
    token count allows, equals the single (m·d, B·T) @ (B·T, m) product."""
    from kernels.msar_attn import fused

    g = torch.Generator().manual_seed(3)
    m, d = 3, 10
    r = torch.randn(m, B, T, d, generator=g)
    coef = torch.randn(B, T, m, generator=g)
    want = torch.einsum("jnc,ni->jci", r.reshape(m, B * T, d), coef.reshape(B * T, m)).reshape(m * d, m)
    got = fused.dphi_from(r, coef)
    assert got.shape == (m * d, m) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends/nvidia/bin/nvdisasm").exists(),
                    reason="the triton wheel has no nvdisasm")
def test_lean_pass_2_takes_fewer_instructions_a_source():
    """What Blocks.split_lean is for, read from the sm_90a SASS at model=small with kernels 4 8 12: the body of the
    lean pass 2's unmasked loop over the sources (the one nearly every token takes) has at most 75% of the plain
    loop's instructions, the same fp32 arithmetic (the same sums), fewer integer instructions by half, and no
    trip through shared memory (a loop-carried tensor of pointers once cost a layout conversion and a barrier).
    Two tokens a trip (Blocks.split_trip): the unmasked loop does both tokens' fp32 arithmetic in at most 85% of
    twice the one-token loop's instructions (a pair's shifted rows are loaded once).
    Equal sums: test_split_forward_equals_the_tile_forward_and_keeps_r_narrow[...-lean],
    test_pass_2_two_tokens_a_trip_equals_one_token_a_trip."""
    code = (
        "import json\n"
        "from benchmarks.msar_attn_ptxas import compile_launch, kernels_for\n"
        "from benchmarks.ptxas import sass, sass_loops, sass_classes\n"
        "out = {}\n"
        "for name, fn, types, consts, warps in kernels_for(1024, 512, (4, 8, 12)):\n"
        "    if not name.startswith('split forward, pass 2'):\n"
        "        continue\n"
        "    k = compile_launch(fn, types, consts, warps)\n"
        "    loops = [lp for lp in sass_loops(sass(k)) if lp['depth'] > 0]\n"
        "    key = 'ahead' + name.split(' token')[0][-1] if 'ahead' in name else None\n"
        "    out[key or ('four' if 'four' in name else 'pairs' if 'pairs' in name else 'lean' if 'lean' in name else 'plain')] = dict(\n"
        "        loops=[dict(total=lp['total'], **sass_classes(lp['ops'])) for lp in loops],\n"
        "        shared=k.metadata.shared)\n"
        "print(json.dumps(out))\n")
    import json

    out = json.loads(_run_compiled("-c", code).splitlines()[-1])
    (plain,) = out["plain"]["loops"]  # one loop over the sources, masked
    # the lean kernel: unmasked and masked loops over the buffer rows and over the partial
    assert len(out["lean"]["loops"]) == 4, out
    fast = min(out["lean"]["loops"], key=lambda lp: lp["total"] if lp["load"] > 4 else 10 ** 9)
    assert fast["fp32"] == plain["fp32"] > 0, (fast, plain)
    assert fast["total"] <= 0.75 * plain["total"] and 2 * fast["integer"] <= plain["integer"], (fast, plain)
    assert out["lean"]["shared"] == 0, out
    # two tokens a trip: its four loops over the sources, then the one-token path's four for a chunk's odd last token
    pair_fast = min((lp for lp in out["pairs"]["loops"] if lp["fp32"] == 2 * fast["fp32"]), key=lambda lp: lp["total"])
    assert pair_fast["total"] <= 0.85 * 2 * fast["total"] and out["pairs"]["shared"] == 0, (pair_fast, fast)
    # a source's rows loaded one source ahead (Blocks.split_ahead): the same arithmetic in its unmasked loop, no trip
    # through shared memory, and at most 20% more instructions than the loop it replaces (the rows' rotation)
    for trip, base in (("1", fast), ("2", pair_fast)):
        ahead = out["ahead" + trip]
        ahead_fast = min((lp for lp in ahead["loops"] if lp["fp32"] == base["fp32"]), key=lambda lp: lp["total"])
        assert ahead["shared"] == 0 and ahead_fast["total"] <= 1.2 * base["total"], (trip, ahead_fast, base)


def _layout_default(field: str) -> str:
    """Blocks' default of a layout switch: the kernel listed under its plain name in
    ``benchmarks.msar_attn_ptxas.kernels_for`` is compiled in it, the other layout is the listed candidate."""
    import dataclasses

    from kernels.msar_attn import fused

    return {f.name: f.default for f in dataclasses.fields(fused.Blocks)}[field]


# the start of a script that compiles each of model=small's kernels (kernels 4 8 12) for sm_90a and fills `out`
_SMALL_KERNELS_LOOP = (
    "import json\n"
    "from benchmarks.msar_attn_ptxas import compile_launch, kernels_for\n"
    "from benchmarks.ptxas import sass, sass_loops\n"
    "out = {}\n"
    "for name, fn, types, consts, warps in kernels_for(1024, 512, (4, 8, 12)):\n"
)


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends/nvidia/bin/nvdisasm").exists(),
                    reason="the triton wheel has no nvdisasm")
def test_token_major_stats_are_three_vector_loads_a_token():
    """What Blocks.coef_layout="token" is for, read from the sm_90a SASS at model=small with kernels 4 8 12: in the
    serial source-gradient kernel's token loop the 12 scalars w, κ, μ (m = 4) are 3 loads of 16 bytes instead of 12
    of 4 (the pad plane is never loaded), no longer moved to uniform registers one by one (R2UR), and the loop takes
    fewer instructions with the same fp32 arithmetic. Equal results: test_token_major_stats_equal_the_planes.
    The candidate with two tokens' loads in flight (Blocks.serial_ahead2, listed as "... tokens ahead"): the same
    fp32 arithmetic and loads in at most 1.2x the default's instructions (the loads' rotation). Equal results:
    test_fused_msar_matches_reference[...-serial-ahead2]."""
    code = f"DEFAULT = {_layout_default('coef_layout')!r}\n" + _SMALL_KERNELS_LOOP + (
        "    if name.startswith('source gradients'):\n"
        "        text = sass(compile_launch(fn, types, consts, warps))\n"
        "        (lp,) = sass_loops(text)\n"
        "        lines = text.split(chr(10))\n"
        "        layout = 'token' if 'token-major' in name else 'planes' if 'in planes' in name else DEFAULT\n"
        "        layout = 'ahead' if 'ahead' in name else layout\n"
        "        out[layout] = dict(ops=lp['ops'], total=lp['total'],\n"
        "            wide=sum('LDG.E.128' in line for line in lines))\n"
        "print(json.dumps(out))\n")
    import json

    out = json.loads(_run_compiled("-c", code).splitlines()[-1])
    planes, token = out["planes"], out["token"]
    fp32 = ("FFMA", "FMUL", "FADD", "FSEL")
    assert [token["ops"].get(op, 0) for op in fp32] == [planes["ops"].get(op, 0) for op in fp32], out
    assert planes["ops"]["R2UR"] >= 12 and token["ops"].get("R2UR", 0) == 0, out
    assert token["ops"]["LDG"] == planes["ops"]["LDG"] - 9 and planes["wide"] == 0 < token["wide"], out
    assert token["total"] <= planes["total"] - 30, out
    default, ahead = out[_layout_default("coef_layout")], out["ahead"]
    assert [ahead["ops"].get(op, 0) for op in fp32 + ("LDG",)] == [default["ops"].get(op, 0) for op in fp32 + ("LDG",)]
    assert ahead["total"] <= 1.2 * default["total"], out


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends/nvidia/bin/nvdisasm").exists(),
                    reason="the triton wheel has no nvdisasm")
def test_token_major_parts_are_one_store_a_statistic():
    """What Blocks.parts_layout="token" is for, read from the sm_90a SASS at model=small with kernels 4 8 12: in the
    serial stats kernel's loop of two tokens a trip, pass 1 (QS) stores 4 times a trip instead of 16 and the
    backward's stats (DR alone) 2 instead of 8, with the same fp32 multiplies and adds, and each loop takes fewer
    instructions (pass 1 at most 92% of the planes', the stats 97%). Equal results:
    test_token_major_parts_equal_the_planes."""
    code = f"DEFAULT = {_layout_default('parts_layout')!r}\n" + _SMALL_KERNELS_LOOP + (
        "    if name.startswith('split forward, pass 1') or name.startswith('stats'):\n"
        "        lp = max(sass_loops(sass(compile_launch(fn, types, consts, warps))), key=lambda lp: lp['total'])\n"
        "        kind = 'pass1' if 'pass 1' in name else 'stats'\n"
        "        layout = 'token' if 'token-major' in name else 'planes' if 'in planes' in name else DEFAULT\n"
        "        out[kind + (' token' if layout == 'token' else '')] = dict(ops=lp['ops'], total=lp['total'])\n"
        "print(json.dumps(out))\n")
    import json

    out = json.loads(_run_compiled("-c", code).splitlines()[-1])
    for kind, stores, ratio in (("pass1", 16, 0.92), ("stats", 8, 0.97)):
        planes, token = out[kind], out[kind + " token"]
        fp32 = ("FFMA", "FMUL", "FADD")
        assert [token["ops"].get(op, 0) for op in fp32] == [planes["ops"].get(op, 0) for op in fp32], (kind, out)
        assert planes["ops"]["STG"] == stores and token["ops"]["STG"] == stores // 4, (kind, out)
        assert token["total"] <= ratio * planes["total"], (kind, out)


def test_sass_loops_finds_nested_loops_and_counts_their_bodies():
    """``benchmarks.ptxas.sass_loops`` on a hand-written SASS listing: every backward branch closes a loop from its
    label, nested loops get their depth, predicated and suffixed opcodes count under their base name, and the
    branch to itself at a kernel's end is not a loop."""
    from benchmarks.ptxas import sass_classes, sass_loops

    lines = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;", ".L_x_0:",
             "        /*0010*/                   IMAD R2, R3, R4, RZ ;", ".L_x_1:",
             "        /*0020*/              @P0 LDG.E.64 R4, desc[UR4][R2.64] ;",
             "        /*0030*/                   FFMA R5, R4, R4, R5 ;",
             "        /*0040*/              @P1 BRA `(.L_x_1) ;",
             "        /*0050*/                   ISETP.NE.AND P2, PT, R6, RZ, PT ;",
             "        /*0060*/              @P2 BRA `(.L_x_0) ;",
             "        /*0070*/                   EXIT ;", ".L_x_2:",
             "        /*0080*/                   BRA `(.L_x_2);"]
    inner, outer = sass_loops("\n".join(lines))
    assert (inner["depth"], inner["total"], inner["ops"]) == (1, 3, {"LDG": 1, "FFMA": 1, "BRA": 1})
    assert (outer["depth"], outer["total"]) == (0, 6)
    assert sass_classes(outer["ops"]) == dict(fp32=1, load=1, store=0, convert=0, integer=2, other=2)


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="the triton wheel has no ptxas")
def test_views_in_the_tiles_layout_remove_the_forwards_layout_conversions():
    """What Blocks.views_3d is for: compiled for sm_90a at model=small, the forward built from loads in the view
    tile's own layout has a fraction of the 2-d builder's layout conversions (each a trip through shared memory
    or a shuffle), and computes the same (test_fused_msar_matches_reference[...-views-3d])."""
    code = (
        "from benchmarks.msar_attn_ptxas import kernels_for\n"
        "from benchmarks.ptxas import compile_sm90, layout_conversions\n"
        "from triton.compiler import ASTSource\n"
        "for v3 in (False, True):\n"
        "    name, fn, types, consts, warps = [k for k in kernels_for(1024, 512, (4, 8, 12), views_3d=v3)][1]\n"
        "    sig = {n: ('constexpr' if n in consts else types.get(n, 'i32')) for n in fn.arg_names}\n"
        "    k = compile_sm90(ASTSource(fn=fn, signature=sig, constexprs=consts), {'num_warps': warps})\n"
        "    print(name, v3, layout_conversions(k))\n")
    stdout = _run_compiled("-c", code)
    counts = {line.split()[-2]: int(line.split()[-1]) for line in stdout.splitlines() if line.startswith("forward")}
    assert counts["True"] * 3 < counts["False"], stdout


def test_buffered_benchmark_reads_agree_with_the_list_reads():
    """benchmarks.msar_buffered's two ways of one block's reads (two readers of the same sources; a buffer's
    rows plus the partial, read in place, against a list stacked per read) give the same gradient to every
    leaf, for a random upstream gradient: what the benchmark checks before timing, at a small odd shape."""
    from benchmarks.msar_attn import KERNELS
    from benchmarks.msar_buffered import grads, make_case

    case = make_case(3, 1, 29, 16, readers=2, seed=1, device="cpu")
    ref, got = grads("list", case), grads("buffered", case)
    assert len(ref) == len(got) == 3 + 2 * (len(KERNELS) + 5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert all(g.abs().sum() > 0 for g in ref[:3])


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="the triton wheel has no ptxas")
@pytest.mark.skipif(subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "b3446a9^{commit}"],
                                   capture_output=True).returncode != 0, reason="a clone without commit b3446a9")
def test_the_ptxas_report_against_a_revision_shows_its_spills():
    """``benchmarks.msar_attn_ptxas --against REV`` compiles REV's kernels with the launch hints beside this tree's:
    against b3446a9, whose source-gradient kernel spilled under the launch's specialisation (4.30 against 3.09 ms
    for the streams backward at `small` on an H200), it shows those spills next to this tree's few."""
    stdout = _run_compiled("-m", "benchmarks.msar_attn_ptxas", "--shapes", "small", "--against", "b3446a9")
    ours, theirs = stdout.split("==== the kernels of b3446a9")

    def src_spills(text):
        line = next(ln for ln in text.splitlines() if ln.startswith("source gradients"))
        return int(re.search(r"(\d+) bytes spill stores", line).group(1))

    assert src_spills(ours) <= 64 < 256 <= src_spills(theirs), stdout


@needs_triton
@pytest.mark.parametrize("S", [1, 2, 5])
@pytest.mark.parametrize("key_norm, lean", [(True, False), (False, True), (True, True)])
def test_glue_kernels_equal_their_pytorch_twins(S, key_norm, lean):
    """The split forward's softmax over the sources, its gate (sigmoid and softmax fusion) and the backward's w, κ, μ
    (from recomputed or saved logits) as one kernel each (Blocks.glue="triton") against the PyTorch they replace, on
    random per-tile sums: several channel tiles, a token count that is not a multiple of the programs' 128, large
    logits (a softmax without its maximum subtracted would overflow)."""
    from kernels.msar_attn import fused

    g = torch.Generator().manual_seed(S)
    n_dt, m, B, T, d, eps = 3, 4, 2, 75, 40, 1e-6

    def rand(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g)

    parts = torch.stack([rand(n_dt, m, S, B, T, scale=30.0), rand(n_dt, m, S, B, T).abs() * 20],
                        dim=1)  # (n_dt, 2, m, S, B, T): qg·E, ‖E‖² ≥ 0
    got = fused.softmax_parts(parts, key_norm=key_norm, eps=eps, d=d, lean=lean, glue="triton")
    want = fused.softmax_parts(parts, key_norm=key_norm, eps=eps, d=d, lean=lean, glue="torch")
    for name, a, b in zip(("logits", "rho", "lse", "w"), got, want):
        assert (a is None) == (b is None) == (name == "rho" and not key_norm), name
        if a is not None:
            assert a.shape == b.shape and rel_err(a, b) < 1e-6, f"{name}: {rel_err(a, b):.1e}"
    assert got[3].shape == ((B, T, S, m) if lean else (m, S, B, T))

    mparts = torch.cat([rand(n_dt, 1, B, T).abs() * 50, rand(n_dt, m, B, T, scale=5.0)], dim=1)
    alpha, bias = torch.tensor([0.7]), rand(m)
    for sigmoid in (True, False):
        got = fused.gate(mparts, alpha, bias, m=m, d=d, eps=eps, sigmoid=sigmoid, glue="triton")
        want = fused.gate(mparts, alpha, bias, m=m, d=d, eps=eps, sigmoid=sigmoid, glue="torch")
        for name, a, b in zip(("g", "z", "rr"), got, want):
            assert a.shape == b.shape and rel_err(a, b) < 1e-6, f"{name} (sigmoid={sigmoid}): {rel_err(a, b):.1e}"

    logits, rho, lse, _ = want_fwd = fused.softmax_parts(parts, key_norm=key_norm, eps=eps, d=d, lean=False,
                                                         glue="torch")
    for saved in (None, (logits, rho)):
        k = 1 if saved else 3
        stats_parts = torch.cat([parts, rand(n_dt, 1, m, S, B, T, scale=3.0)], dim=1) if not saved else \
            rand(n_dt, 1, m, S, B, T, scale=3.0)
        assert stats_parts.shape[1] == k
        coef = {glue: torch.zeros(4, 4, S, B, T) for glue in ("torch", "triton")}
        for glue in coef:
            fused.finish_stats(stats_parts, lse, coef[glue], key_norm=key_norm, eps=eps, d=d, saved=saved, glue=glue)
        for plane, name in enumerate(("w", "κ", "μ")):
            a, b = coef["triton"][plane], coef["torch"][plane]
            assert rel_err(a, b) < 1e-5 or (b.abs().max() == 0 and a.abs().max() == 0), f"{name}: {rel_err(a, b):.1e}"
        assert coef["torch"][1].abs().max() > 0 or S == 1  # κ is not trivially zero (one source: w = 1, κ = 0)
    del want_fwd


@needs_triton
@pytest.mark.parametrize("lean, pairs", [(False, False), (True, False), (True, True)],
                         ids=["plain", "lean", "lean-pairs"])
@pytest.mark.parametrize("key_norm", [True, False], ids=["keynorm", "rawkeys"])
def test_split_forward_equals_the_tile_forward_and_keeps_r_narrow(key_norm, lean, pairs, monkeypatch):
    """The split forward's pieces (with the plain or the lean pass 2) against the tile forward's on the same inputs,
    with the streams kept for the mixer's backward in bf16 (as under bf16 autocast): h, the lse, the logits and ρ
    saved for the backward's stats, R·φ, ‖vec R‖², and the kept R (the fp32 streams rounded once: h is combined
    from the fp32 streams, not from the bf16 copy), over several channel tiles (d = 24: 16 does not divide it, the
    lean pass 2's masked tail tile) and chunks, documents at odd offsets (tokens whose window holds a boundary, the
    lean pass's masked loop, and tokens whose window does not); with ``pairs``, both passes two tokens a trip
    (Blocks.stats_pairs, Blocks.split_trip; chunks of 4 tokens and a last one of 3). The split forward combines h from
    the fp32 streams here (Blocks.combine_from="float32"); from the kept ones: test_combine_from_the_kept_streams."""
    import dataclasses

    from kernels.msar_attn import fused

    S, B, T, d, kernels = 3, 2, 11, 24, (2, 5)
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, True)
    packed, ks, m_pad = fused.pack_taps(taps, d, x.device)
    qg, near = fused.folded_queries(queries, key_gains), fused.doc_window(doc_ids)
    full = (near & ((1 << max(ks)) - 1)) == (1 << max(ks)) - 1  # no boundary among t-σ, σ < k_max
    assert full.any() and not full.all()  # both of the lean pass's loops run
    mixer = fused._mixer_params(phi, alpha, bias)
    kw = dict(key_norm=key_norm, eps=1e-6, mixer=mixer, save=True, save_stats=True, save_dtype=torch.bfloat16)
    base = fused._blocks(T, d, m_pad, max(ks))
    out = {}
    for mode in ("tile", "split"):
        blk = dataclasses.replace(base, fwd_mode=mode, split_logit_bd=8, split_bd=16, split_ch=4, split_lean=lean,
                                  stats_pairs=pairs, split_trip=2 if pairs else 1, combine_from="float32")
        monkeypatch.setattr(fused, "_blocks", lambda *_a, _b=blk: _b)
        out[mode] = fused.forward(x, packed, ks, len(ks), qg, near, **kw)
    (h, lse, logits, (r, z, rr), (lg, rho)), (h0, lse0, logits0, (r0, z0, rr0), (lg0, rho0)) = out["split"], out["tile"]
    assert r.dtype == r0.dtype == torch.bfloat16 and h.dtype == x.dtype
    for name, a, b in (("h", h, h0), ("lse", lse, lse0), ("logits", lg, lg0), ("R·φ", z, z0), ("‖R‖²", rr, rr0)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.2e}"
    assert logits is None and logits0 is None  # stored for the backward, not returned unless asked for
    assert (rho is None) == (rho0 is None) == (not key_norm)
    if key_norm:
        assert rel_err(rho, rho0) < 1e-5
    assert (r.float() - r0.float()).abs().max() <= 2 ** -7 * r0.float().abs().max()  # one bf16 rounding apart
    assert rel_err(r.float(), r0.float()) < 1e-2 and r.float().abs().max() > 0


@needs_triton
@pytest.mark.parametrize("sigmoid", [True, False], ids=["sigmoid", "softmax"])
def test_combine_from_the_kept_streams(sigmoid, monkeypatch):
    """Blocks.combine_from="kept": pass 2 writes R in the dtype the mixer's backward keeps (bf16 here, as under bf16
    autocast) and h is combined from that R. Against "float32" (R in fp32, then copied): the kept R, R·φ, ‖vec R‖²,
    the lse and the logits equal to the bit (R rounded once from the same fp32 sums); h = Σ_j g_j R_j of the kept R
    with g from the saved R·φ and ‖vec R‖² (fp64, within fp32 rounding), so it differs from the fp32 combine by at
    most the streams' bf16 rounding, and does differ. Then the whole op under bf16 autocast: every gradient equal to
    the bit in both modes (the backward reads the kept R, not h), h within that bound. Several channel tiles (d = 24
    on tiles of 16) and chunks, documents at odd offsets."""
    import dataclasses

    from kernels.msar_attn import fused

    S, B, T, d, kernels = 3, 2, 11, 24, (2, 5)
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, True)
    packed, ks, m_pad = fused.pack_taps(taps, d, x.device)
    qg, near = fused.folded_queries(queries, key_gains), fused.doc_window(doc_ids)
    m, eps = len(ks), 1e-6
    mixer = fused._mixer_params(phi, alpha, bias)
    kw = dict(key_norm=True, eps=eps, mixer=mixer, sigmoid=sigmoid, save=True, save_stats=True,
              save_dtype=torch.bfloat16)
    base = fused._blocks(T, d, m_pad, max(ks))
    out = {}
    for mode in fused.COMBINE_FROM:
        blk = dataclasses.replace(base, fwd_mode="split", split_logit_bd=8, split_bd=16, split_ch=4, combine_from=mode)
        monkeypatch.setattr(fused, "_blocks", lambda *_a, _b=blk: _b)
        out[mode] = fused.forward(x, packed, ks, m, qg, near, **kw)
    (h, lse, _, (r, z, rr), (lg, rho)), (h0, lse0, _, (r0, z0, rr0), (lg0, rho0)) = out["kept"], out["float32"]
    assert r.dtype == r0.dtype == torch.bfloat16 and h.dtype == h0.dtype == x.dtype
    for name, a, b in (("R", r, r0), ("R·φ", z, z0), ("‖R‖²", rr, rr0), ("lse", lse, lse0), ("logits", lg, lg0),
                       ("ρ", rho, rho0)):
        assert torch.equal(a, b), name
    zz = alpha.double() * z.double() * torch.rsqrt(rr.double() / (m * d) + eps) + bias.double()[:, None, None]
    g = torch.sigmoid(zz) if sigmoid else torch.softmax(zz, dim=0)  # (m, B, T)
    rk = r.double()
    expected = (g[..., None] * rk).sum(0)  # (B, T, d) from the kept streams
    assert rel_err(h, expected) < 1e-6
    # Σ_j g_j |R_j| times bf16's relative spacing 2^-7, elementwise: one rounding of each stream (Triton's interpreter
    # truncates fp32 to bf16, up to 2^-7 relative, where the GPU rounds to nearest, up to 2^-8)
    bound = 2.0 ** -7 * (g[..., None] * rk.abs()).sum(0)
    assert ((h0.double() - h.double()).abs() <= bound + 1e-6 * expected.abs().max()).all()
    assert not torch.equal(h, h0)  # the rounding of the streams reached h

    # the op under bf16 autocast: the gradients do not depend on where h was combined from
    up = torch.randn(B, T, d, generator=torch.Generator().manual_seed(7))
    grads, hs = {}, {}
    for mode in fused.COMBINE_FROM:
        monkeypatch.setattr(fused, "_blocks", lambda *a, _m=mode: dataclasses.replace(base, combine_from=_m))
        leaves = [t.clone().requires_grad_() for t in (x, queries, key_gains, phi, alpha, bias, *taps)]
        xs, q, gk, ph, al, bi, *tp = leaves
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hs[mode] = msar(xs, tp, q, gk, doc_ids, ph, al, bi, fusion="sigmoid" if sigmoid else "softmax",
                            backend="triton")
        grads[mode] = torch.autograd.grad((hs[mode] * up).sum(), leaves)
    for i, (a, b) in enumerate(zip(grads["kept"], grads["float32"])):
        assert torch.equal(a, b), f"input {i}"
    assert 0 < (hs["kept"] - hs["float32"]).abs().max() <= 2.0 ** -7 * hs["float32"].abs().max() * m


@needs_triton
def test_grad_streams_kept_in_bf16(monkeypatch):
    """Blocks.grad_streams="kept" (a candidate): under bf16 autocast the mixer's backward writes dR in bf16, the
    kept streams' dtype, and the stats and source-gradient kernels read it. Against dR in fp32 on the same inputs:
    the streams backward receives a bf16 dR whose values are the fp32 run's rounded once; h equal to the bit (the
    forward does not change); every gradient within bf16 rounding (relative 1e-2) and not equal to the fp32 run's
    (the rounding reached them). Several channel tiles and chunks of the serial kernels (d = 24 on 8-channel
    tiles, chunks of 5 tokens), documents at odd offsets; fp32 sources stay as they were."""
    from kernels.msar_attn import fused

    _, S, B, T, d, kernels, key_norm, gains, fusion, blocks = next(c for c in CASES if c[0] == "S3-B2-T13-d24-k2,3")
    monkeypatch.setattr(fused, "_blocks", _blocks(4, 8))
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, gains)
    up = torch.randn(B, T, d, generator=torch.Generator().manual_seed(3))
    inner, seen = fused.streams_backward, []

    def spy(dr, *args, **kwargs):
        seen.append(dr.detach().clone())
        return inner(dr, *args, **kwargs)

    monkeypatch.setattr(fused, "streams_backward", spy)
    out = {}
    for mode in ("float32", "kept"):
        _with_fields(monkeypatch, grad_streams=mode)
        leaves = [t.clone().requires_grad_() for t in (x, queries, key_gains, phi, alpha, bias, *taps)]
        xs, q, g, ph, al, bi, *tp = leaves
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = msar(xs, tp, q, g, doc_ids, ph, al, bi, key_norm=key_norm, fusion=fusion, backend="triton")
        out[mode] = h.detach(), torch.autograd.grad((h * up).sum(), leaves)
    (dr32, dr16) = seen
    assert dr32.dtype == torch.float32 and dr16.dtype == torch.bfloat16
    # one rounding apart (the interpreter truncates to bf16: up to 2^-7 relative)
    assert ((dr16.float() - dr32).abs() <= 2.0 ** -7 * dr32.abs()).all() and not torch.equal(dr16.float(), dr32)
    (h32, g32), (h16, g16) = out["float32"], out["kept"]
    assert torch.equal(h16, h32)
    names = ["x", "queries", "key_gains", "phi", "alpha", "bias", *(f"taps{j}" for j in range(len(taps)))]
    for name, a, b in zip(names, g16, g32):
        assert rel_err(a, b) < 1e-2, f"{name}: relative error {rel_err(a, b):.2e}"
    assert not all(torch.equal(a, b) for a, b in zip(g16, g32))


@needs_triton
@pytest.mark.parametrize("shape", [(1, 5), (37, 3, 24), (300, 2, 100), (8, 4000)], ids=str)
def test_sum_rows_equals_torch_sum(shape):
    """``fused.sum_rows`` (Blocks.part_sums="triton") against the fp64 sum over the first dimension: one row, a row
    count that is not a multiple of the rows a trip, column counts not a multiple of the columns a program, more
    columns than one program takes; the same result twice (deterministic); anything but contiguous fp32 refused."""
    from kernels.msar_attn import fused

    parts = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    out = fused.sum_rows(parts)
    assert out.shape == parts.shape[1:] and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), parts.double().sum(0), rtol=1e-6, atol=1e-5)
    assert torch.equal(out, fused.sum_rows(parts))
    for bad in (parts.double(), parts[..., ::2], parts[0, 0]):
        with pytest.raises(ValueError, match="sum_rows: needs contiguous fp32 partials"):
            fused.sum_rows(bad)


def _pass_2_reference(xs, packed, ks, doc_ids, w, phi_t, bd):
    """R (m, B, T, d) fp64 and the mixer's per-tile sums (n_dt, 1 + m, B, T) of pass 2 written out: R_j[t] =
    Σ_s w[t, s, j] Σ_τ c_j[τ] x_s[t-τ] over the t-τ >= 0 in t's document; w (B, T, S, m), φᵀ (m, m·d)."""
    S, B, T, d = xs.shape
    m = len(ks)
    x, c, w = xs.double(), packed.double(), w.double()
    r = torch.zeros(m, B, T, d, dtype=torch.float64)
    for tau in range(min(max(ks), T)):  # (a tap past the row's start reads nothing)
        shifted = torch.zeros_like(x)
        shifted[:, :, tau:] = x[:, :, :T - tau]
        same = torch.zeros(B, T, dtype=torch.bool)
        same[:, tau:] = doc_ids[:, tau:] == doc_ids[:, :T - tau]
        shifted = shifted * same[None, :, :, None]
        for j in range(m):
            if tau < ks[j]:
                r[j] += torch.einsum("sbtc,bts,c->btc", shifted, w[..., j], c[j, tau])
    tiles = []
    for lo in range(0, d, bd):
        rt, ph = r[..., lo:lo + bd], phi_t.double().reshape(m, m, d)[..., lo:lo + bd]  # φᵀ[i, j·d + c]
        tiles.append(torch.stack([(rt * rt).sum((0, 3)), *torch.einsum("jbtc,ijc->ibt", rt, ph)]))
    return r, torch.stack(tiles)


# (id, n_buf, partial, B, T, d, split_bd, split_ch, kernels, mixer, document starts (row 0, row 1))
PAIR_CASES = [
    ("T1-one-source", 1, False, 1, 1, 12, 8, 64, (2, 3), True, ((), ())),
    ("T3-below-kmax-row-and-partial", 1, True, 2, 3, 12, 8, 4, (2, 5), True, ((1,), ())),
    ("T11-rows-and-partial-ch4", 2, True, 2, 11, 12, 8, 4, (2, 3), True, ((3, 6, 9), (5,))),
    ("T13-three-rows-ch5-no-mixer", 3, False, 2, 13, 24, 16, 5, (4, 2), False, ((1, 8), (7, 10))),
    ("T9-row-and-partial-ch3-d-even", 1, True, 1, 9, 16, 8, 3, (3,), True, ((7,),)),
    ("T10-ch1-one-token-a-trip", 1, True, 1, 10, 12, 8, 1, (2, 3), False, ((3,),)),
    # chunks of 14 with a document starting at 17: trips of four with every window whole, and some with one not
    ("T37-ch14-four-tokens-a-trip", 2, True, 1, 37, 20, 16, 14, (3, 2), True, ((17,),)),
]


@needs_triton
@pytest.mark.parametrize("case", PAIR_CASES, ids=[c[0] for c in PAIR_CASES])
def test_pass_2_two_tokens_a_trip_equals_one_token_a_trip(case):
    """The lean pass 2 two and four tokens a trip (Blocks.split_trip) against one token a trip and against pass 2
    written out in PyTorch, fp32, on random weights: one token (no trip), fewer tokens than K_MAX (every window
    reaches before the row's start), odd T and chunks of 1, 3, 4, 5 tokens (a chunk's last tokens short of a trip
    take the one-token loop), d not a multiple of the channel tile (the masked channel tail) and a multiple,
    documents starting at odd and even offsets (trips where every window is whole, where only some are, where none
    is), one and several buffer rows, with and without the partial, with and without the mixer's per-tile sums.
    Breaking either token's document mask or rows, the whole-window condition, the second token's weights or its
    store fails it (checked at two tokens a trip). Each trip also with a source's rows loaded one source ahead
    (Blocks.split_ahead)."""
    import dataclasses

    from kernels.msar_attn import fused

    _, n_buf, with_partial, B, T, d, bd, ch, kernels, mixer, starts = case
    g = torch.Generator().manual_seed(T * 31 + n_buf)
    buf = torch.randn(n_buf + 2, B, T, d, generator=g)  # one allocation: the partial's offset from x is small
    x = buf[:n_buf]  # the buffer rows
    partial = buf[-1] if with_partial else None  # a row past a gap, at its own offset (``sources_layout``)
    taps = [torch.randn(k, d, generator=g) for k in kernels]
    packed, ks, m_pad = fused.pack_taps(taps, d, x.device)
    m, S = len(ks), n_buf + with_partial
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(starts):
        for t in row:
            doc_ids[b, t:] += 1
    near = fused.doc_window(doc_ids)
    w = torch.rand(B, T, S, m, generator=g) + 0.1
    phi_t = torch.randn(m, m * d, generator=g) if mixer else None
    base = dataclasses.replace(fused._blocks(T, d, m_pad, max(ks)), fwd_mode="split", split_lean=True, split_bd=bd,
                               split_ch=ch)
    out = {(trip, ahead): fused._pass_2(x, packed, ks, m, near, w,
                                        dataclasses.replace(base, split_trip=trip, split_ahead=ahead),
                                        partial=partial, phi=phi_t)
           for trip in (1, 2, 4) for ahead in (False, True)}
    r1, mp1 = out[1, False]
    xs = torch.cat([x, *(() if partial is None else (partial[None],))])
    r_ref, mp_ref = _pass_2_reference(xs, packed, ks, doc_ids, w, phi_t if mixer else torch.zeros(m, m * d), bd)
    assert r_ref.abs().max() > 0 and rel_err(r1, r_ref) < 1e-6
    for trip in ((2, False), (4, False), (1, True), (2, True), (4, True)):
        r2, mp2 = out[trip]
        assert (r2 - r1).abs().max() <= 1e-6 * r1.abs().max(), (trip, (r2 - r1).abs().max())
        assert rel_err(r2, r_ref) < 1e-6, trip
        assert (mp1 is None) == (mp2 is None) == (not mixer)
        if mixer:
            assert (mp2 - mp1).abs().max() <= 1e-5 * mp1.abs().max(), (trip, (mp2 - mp1).abs().max())
            assert rel_err(mp2, mp_ref) < 1e-6, trip


def test_pass_2_trip_setting_is_explicit():
    """Blocks.split_trip takes 1, 2 or 4 tokens a trip (2 by default) and applies to the lean pass 2 only; another
    value is refused with the value and the choices."""
    import dataclasses

    from kernels.msar_attn import fused

    blk = dataclasses.replace(fused._blocks(64, 32, 4, 12), split_lean=True)
    assert blk.split_trip == 2 and fused.split_trip(blk) == 2
    assert fused.split_trip(dataclasses.replace(blk, split_lean=False)) == 1
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match=rf"split_trip={bad!r}: choose 1, 2 or 4"):
            fused.split_trip(dataclasses.replace(blk, split_trip=bad))


@needs_triton
@pytest.mark.parametrize("mode, amp, glue", [("serial", False, "triton"), ("split", False, "triton"),
                                             ("lean", False, "triton"), ("split", True, "triton"),
                                             ("lean", True, "triton"), ("lean", True, "torch")])
@pytest.mark.parametrize("sources", ["list", "buffered"])
def test_recompute_streams_keeps_no_streams_and_rebuilds_them(sources, mode, amp, glue, monkeypatch):
    """msar(recompute_streams=True) saves no (m, B, T, d) streams for backward (keeping them does: the check can
    fail) and rebuilds them in the backward from the sources and the saved logits: the same h and the same gradient
    of every input as the read that keeps them, with a random upstream gradient, documents at odd offsets, a
    partial beside buffer rows. After the split forward (the default; plain and lean pass 2, either glue) equal to
    the bit, in fp32 and under bf16 autocast, where the kept R is bf16 and the rebuild rounds alike (its weights by
    the forward's own expression); after the tile forward, whose R comes from other arithmetic, within fp32
    rounding (the rebuild runs pass 2 alone whichever forward ran)."""
    import dataclasses

    from kernels.depth_attn import SourceBuffer
    from kernels.msar_attn import BufferedSources, fused

    tiles = _blocks(4, 8, mode=mode)
    monkeypatch.setattr(fused, "_blocks", lambda *a: dataclasses.replace(tiles(*a), glue=glue))
    S, B, T, d, kernels = 3, 2, 11, 12, (2, 3)
    m = 1 + len(kernels)
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(S, B, T, d, kernels, True)
    params = [queries, key_gains, phi, alpha, bias, *taps]
    for t in params:
        t.requires_grad_()
    up = torch.randn(B, T, d, generator=torch.Generator().manual_seed(7))
    out = {}
    for recompute in (False, True):
        leaves = [x[i].clone().requires_grad_() for i in range(S)]
        if sources == "buffered":
            buffer = SourceBuffer(S - 1, leaves[0])
            for t in leaves[:-1]:
                buffer.append(t)
            src = BufferedSources(buffer, buffer.rows, leaves[-1] * 1.0)  # the open block's partial: a non-leaf
        else:
            src = leaves
        shapes = []

        def keep(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            h = msar(src, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="triton",
                     recompute_streams=recompute)
        assert ((m, B, T, d) in shapes) is not recompute, shapes
        out[recompute] = (h, *torch.autograd.grad((h * up).sum(), [*leaves, *params]))
    names = ["h", *(f"x[{i}]" for i in range(S)), "queries", "key_gains", "phi", "alpha", "bias",
             *(f"taps[{i}]" for i in range(len(taps)))]
    assert torch.equal(out[True][0], out[False][0])
    for name, a, b in zip(names[1:], out[True][1:], out[False][1:]):
        assert b.abs().max() > 0, name
        if mode == "serial":
            assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.2e}"
        else:
            assert torch.equal(a, b), f"{name}: {rel_err(a, b):.2e}"


@needs_triton
@pytest.mark.parametrize("lean", [False, True])
def test_rebuilt_weights_kernel_matches_its_pytorch_twin(lean):
    """``rebuild_weights`` with the glue kernel (``_weights_kernel``, the forward's own expression) against
    ``softmax_weights``, its PyTorch twin: random logits and lse over an odd count of tokens (not a multiple of the
    kernel's token block), both layouts; fp32 rounding apart, every weight written."""
    from kernels.msar_attn import fused

    g = torch.Generator().manual_seed(3)
    m, S, B, T = 3, 5, 2, 139
    logits = torch.randn(m, S, B, T, generator=g) * 4
    lse = torch.logsumexp(logits, dim=1) + 0.1 * torch.randn(m, B, T, generator=g)
    got = fused.rebuild_weights(logits, lse, lean=lean, glue="triton")
    want = fused.softmax_weights(logits, lse, lean=lean)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(fused.rebuild_weights(logits, lse, lean=lean, glue="torch"), want)


def test_recompute_streams_is_for_the_fused_backend():
    x, taps, queries, key_gains, doc_ids, phi, alpha, bias = make_inputs(2, 1, 5, 8, (2,), True)
    with pytest.raises(ValueError, match="recompute_streams=True applies to the fused backend"):
        msar(x, taps, queries, key_gains, doc_ids, phi, alpha, bias, backend="torch", recompute_streams=True)


def test_fields_replace_every_tile_choice(monkeypatch):
    """``fused.FIELDS`` (a setting of the code for timing a candidate end to end) replaces those fields of every tile
    choice and nothing else; empty, the tiles are ``_tiles``'. A throughput row names it as a Python dict literal."""
    import dataclasses

    from benchmarks.throughput import code_settings
    from kernels.msar_attn import fused

    plain = fused._blocks(1024, 512, 4, 12)
    assert plain == fused._tiles(1024, 512, 4, 12) and plain.stats_pairs
    ((obj, attr, value),) = code_settings("msar_block@py:kernels.msar_attn.fused.FIELDS={'stats_pairs':False}")
    assert (obj, attr, value) == (fused, "FIELDS", {"stats_pairs": False})
    monkeypatch.setattr(fused, "FIELDS", value)
    assert fused._blocks(1024, 512, 4, 12) == dataclasses.replace(plain, stats_pairs=False)
