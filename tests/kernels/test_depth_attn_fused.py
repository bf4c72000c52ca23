"""The fused depth attention (kernels/depth_attn/fused.py) against its reference.

Outputs are compared elementwise; gradients by relative error in norm (< 1e-5 in fp32: the query
gradients are sums over every token, in a different order than the reference's).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py): fp32, tight tolerances. The
``gpu`` tests compare bf16 inputs on CUDA with the fp32 reference on the same bf16-rounded inputs.
Every gradient is taken with a random upstream gradient.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from kernels.depth_attn import (SourceBuffer, depth_attn, depth_attn_merge, depth_attn_summaries, reference,
                                summaries_keep_outputs)
from tests.helpers import rel_err

# (id, C queries, n sources, B, T, d, key_norm, gains): odd d and B·T (the interpreter's token block is 32)
CASES = [
    ("C4-n5-d37", 4, 5, 2, 19, 37, True, True),
    ("T1", 3, 3, 1, 1, 16, True, True),
    ("one-source", 4, 1, 2, 7, 24, True, True),
    ("many-sources-C1", 1, 9, 1, 45, 20, True, True),
    ("raw-keys", 3, 4, 2, 17, 33, False, False),
    ("no-gain", 2, 3, 3, 11, 9, True, False),
    ("C6-d64", 6, 4, 1, 40, 64, True, True),
]
IDS = [c[0] for c in CASES]
# backend='triton' on CPU tensors runs only under the interpreter (set by conftest.py without CUDA)
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")


def make_inputs(C, n, B, T, d, gains, *, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, device=device)

    sources = rand(n, B, T, d, scale=2.0) + rand(n, 1, 1, d)  # per-source offsets: logits spread
    partials = rand(C, B, T, d, scale=1.5)  # one per consumer (consumer 0 merges none)
    queries = rand(C, d, scale=0.5)
    key_gains = 1 + 0.3 * rand(C, d) if gains else None
    return sources, partials, queries, key_gains


def two_phase(backend, sources, partials, queries, key_gains, key_norm, out_dtype=None):
    """Block AttnRes for one block: consumer 0 reads phase 1 alone, consumer c > 0 merges partials[c].
    Sources go through a SourceBuffer, as in the residual."""
    buffer = SourceBuffer(sources.shape[0] + 2, sources[0])  # spare rows: only [0, n) are read
    for s in sources.unbind(0):
        buffer.append(s)
    outs, lses, weights = depth_attn_summaries(buffer, queries, key_gains, key_norm=key_norm,
                                               return_weights=True, out_dtype=out_dtype, backend=backend)
    hs, merged_w = [outs[0]], []
    for c in range(1, queries.shape[0]):
        h, w = depth_attn_merge(outs[c], lses[c], partials[c], queries[c],
                                None if key_gains is None else key_gains[c], key_norm=key_norm, backend=backend)
        hs.append(h)
        merged_w.append(w)
    return hs, weights, merged_w


def assert_two_phase_matches_reference(sources, partials, queries, key_gains, key_norm, *, up_seed):
    """two_phase on triton against torch: every consumer's output, the phase-1 and merge weights, and the
    gradients of all inputs under random upstream gradients (seeded by ``up_seed``)."""
    leaves = [t.requires_grad_() for t in (sources, partials, queries, key_gains) if t is not None]
    fused, fused_w, fused_mw = two_phase("triton", sources, partials, queries, key_gains, key_norm)
    ref, ref_w, ref_mw = two_phase("torch", sources, partials, queries, key_gains, key_norm)
    for c, (a, b) in enumerate(zip(fused, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"consumer {c}")
    torch.testing.assert_close(fused_w, ref_w, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_mw, ref_mw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(up_seed)
    ups = [torch.randn(h.shape, generator=g) for h in ref]
    grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(fused, ups)), leaves, allow_unused=True)
    ref_grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(ref, ups)), leaves, allow_unused=True)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        if b is None:  # partials[0]: consumer 0 merges nothing
            assert a is None
            continue
        # fp32 sums over tokens (query gradients): compare in norm, 1e-5 is ~100 ulps
        assert rel_err(a, b) < 1e-5, f"input {i}: relative error {rel_err(a, b):.2e}"


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_pass_matches_reference(case):
    _, C, n, B, T, d, key_norm, gains = case
    sources, _, queries, key_gains = make_inputs(C, n, B, T, d, gains)
    leaves = [t.requires_grad_() for t in (sources, queries, key_gains) if t is not None]
    out, w = depth_attn(sources, queries, key_gains, key_norm=key_norm, return_weights=True, backend="triton")
    ref, ref_w = depth_attn(sources, queries, key_gains, key_norm=key_norm, return_weights=True, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for i, (a, b) in enumerate(zip(torch.autograd.grad((out * up).sum(), leaves),
                                   torch.autograd.grad((ref * up).sum(), leaves))):
        assert rel_err(a, b) < 1e-5, f"input {i}: relative error {rel_err(a, b):.2e}"


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_two_phase_matches_reference(case):
    _, C, n, B, T, d, key_norm, gains = case
    assert_two_phase_matches_reference(*make_inputs(C, n, B, T, d, gains), key_norm, up_seed=2)


@needs_interpreter
@pytest.mark.parametrize("from_logits", [True, False], ids=["forward-logits", "logits-again"])
@pytest.mark.parametrize("once", [False, True], ids=["reduce-a-chunk", "reduce-once"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_split_backward_matches_reference(case, once, from_logits, monkeypatch):
    # The phase-1 backward as two kernels (per-token scalars from chunks of 16 channels, reduced a chunk at a time or
    # once after the last, ``SCORES_ONCE``; the logits and r_s taken from the forward or summed again,
    # ``SCORES_FROM_LOGITS``; then the gradients two sources a load): every output and gradient against the reference,
    # on every case (one source, T = 1, raw keys, 9 sources for one consumer, 6 consumers, d not a multiple of the
    # chunk).
    from kernels.depth_attn import fused

    _, C, n, B, T, d, key_norm, gains = case
    monkeypatch.setattr(fused, "SPLIT_BWD", True)
    monkeypatch.setattr(fused, "SCORES_ONCE", once)
    monkeypatch.setattr(fused, "SCORES_FROM_LOGITS", from_logits)
    assert fused.tiles(n, d, C).bwd_split and fused.scores_from_logits(n, d, C) == from_logits
    assert_two_phase_matches_reference(*make_inputs(C, n, B, T, d, gains, seed=5), key_norm, up_seed=6)


def _spy_launches(monkeypatch, fused, name, record):
    """Replace the kernel ``fused.<name>`` by one that launches it and appends ``record(grid, kwargs)`` of every
    launch to the list returned."""
    launched, kernel = [], getattr(fused, name)
    monkeypatch.setattr(fused, name, type("Spy", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: (launched.append(record(grid, k)),
                                                           kernel[grid](*a, **k))[1]})())
    return launched


@needs_interpreter
@pytest.mark.parametrize("case", CASES + [("C4-n5-T100", 4, 5, 2, 50, 20, True, True)],
                         ids=IDS + ["C4-n5-T100"])
@pytest.mark.parametrize("way", ["ROWS", "PREFETCH", "PREFETCH-all"])
def test_split_gradients_by_rows_or_prefetched_match_reference(case, way, monkeypatch):
    # SPLIT_GRADS_ROWS: the split gradients kernel takes a trip's sources as separate rows (the last trip ragged at an
    # odd count) and keeps each consumer's query-gradient partial apart; SPLIT_GRADS_PREFETCH: it loads each trip's
    # sources a trip ahead (across token blocks too, and past the program's last, where nothing is read), with "all"
    # their scalars too. Every output
    # and gradient against the reference, on every case; two programs under the interpreter (32 tokens a block), so
    # at 100 tokens a program walks two token blocks and adds into its partials twice. The kernel is checked to run
    # that way.
    from kernels.depth_attn import fused

    _, C, n, B, T, d, key_norm, gains = case
    monkeypatch.setattr(fused, "SPLIT_BWD", True)
    name, _, value = way.partition("-")
    monkeypatch.setattr(fused, f"SPLIT_GRADS_{name}", value or True)
    launched = _spy_launches(monkeypatch, fused, "_split_grads_kernel", lambda grid, k: k[name])
    assert_two_phase_matches_reference(*make_inputs(C, n, B, T, d, gains, seed=7), key_norm, up_seed=8)
    assert launched and all(v == (2 if value else True) for v in launched)


@needs_interpreter
@pytest.mark.parametrize("n, C, key_norm", [(5, 4, True), (9, 2, True), (3, 3, False)])
def test_split_backward_takes_the_forward_logits(n, C, key_norm, monkeypatch):
    # Training asks for no weights: the forward then stores its logits and r_s for the split backward alone, which
    # takes them (not summed again) and gives the reference's gradients; 9 sources take two chunks of the forward,
    # whose r_s is stored by its first consumer. The forward's stores against the reference's logits and key norm.
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "SPLIT_BWD", True)
    seen = []
    split_bwd = fused._split_bwd

    def spy(*args):
        seen.append((args[-2], args[-1]))
        return split_bwd(*args)

    monkeypatch.setattr(fused, "_split_bwd", spy)
    sources, _, queries, key_gains = make_inputs(C, n, 2, 23, 19, True, seed=n)
    buffer = SourceBuffer(n + 1, sources[0])
    for s in sources.unbind(0):
        buffer.append(s)
    leaves = [t.requires_grad_() for t in (queries, key_gains)]
    outs, lses = depth_attn_summaries(buffer, queries, key_gains, key_norm=key_norm, backend="triton")
    ref, ref_lse = depth_attn_summaries(buffer, queries, key_gains, key_norm=key_norm, backend="torch")
    for a, b in zip(outs, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(n + 1)
    ups = [torch.randn(o.shape, generator=g) for o in ref]
    ups_lse = [torch.randn(o.shape, generator=g) for o in ref_lse]
    loss = sum((o * u).sum() for o, u in zip(outs, ups)) + sum((o * u).sum() for o, u in zip(lses, ups_lse))
    ref_loss = sum((o * u).sum() for o, u in zip(ref, ups)) + sum((o * u).sum() for o, u in zip(ref_lse, ups_lse))
    for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(ref_loss, leaves)):
        assert rel_err(a, b) < 1e-5
    assert len(seen) == 1 and seen[0][0] is not None and (seen[0][1] is not None) == key_norm
    logits, rstd = seen[0]
    qg = queries.detach() * key_gains.detach()
    x = sources.reshape(n, -1, 19)
    r = torch.rsqrt(x.pow(2).mean(-1) + 1e-6) if key_norm else torch.ones(n, x.shape[1])
    if key_norm:
        torch.testing.assert_close(rstd.reshape(n, -1), r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.reshape(C, n, -1), torch.einsum("cd,snd->csn", qg, x) * r, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=rf"logits must be \({C}, {n}, 2, 23\) with rstd"):  # another call's
        fused.summaries_bwd(sources.detach(), n, qg, torch.stack(ref_lse).detach(), tuple(ups), torch.zeros(C, 2, 23),
                            key_norm=key_norm, eps=1e-6, logits=logits[:, 1:])


@needs_interpreter
@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_forward_in_two_loads_matches_reference(n, monkeypatch):
    # FWD_TAIL: 3 and 5 sources in two loads held in registers (2 + 1, 4 + 1 rows; 6 and 7 keep one load of 8),
    # the online softmax carried from the first to the second: outputs, weights (the logits the tail stores) and every
    # gradient against the reference, at an odd width and token count.
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "FWD_TAIL", True)
    t = fused.tiles(n, 13, 4)
    assert t.one_chunk and (t.block_s, t.tail_s) == {3: (2, 1), 5: (4, 1), 6: (8, 0), 7: (8, 0)}[n]
    assert_two_phase_matches_reference(*make_inputs(4, n, 2, 21, 13, True, seed=n), True, up_seed=n + 1)
    monkeypatch.setattr(fused, "FWD_TAIL", False)
    assert fused.tiles(n, 13, 4).tail_s == 0


@needs_interpreter
@pytest.mark.parametrize("rows, prefetch, n, split", [(1, False, 5, False), (2, True, 6, True), (2, False, 7, True),
                                                      (4, True, 9, True), (4, False, 3, False), (1, True, 1, True),
                                                      (0, False, 10, True)],
                         ids=["1-n5", "2-prefetch-n6-split", "2-n7-split", "4-prefetch-n9-split", "4-n3", "1-prefetch-n1",
                              "chunks-n10-split"])
def test_streamed_forward_matches_reference(rows, prefetch, n, split, monkeypatch):
    # FWD_STREAM: the sources in loads of 1, 2 or 4 rows, each folded into every consumer's online-softmax state
    # (a ragged last load at 5, 7, 9 and 3 sources; with and without the next load in flight): outputs, weights and
    # every gradient against the reference, at an odd width and token count. With the split backward the forward also
    # stores the logits and the key norm's r_s that the split scores kernel takes, so those are checked through it.
    # FWD_STREAM = 0: the kernel of before, its 10 sources chunk by chunk (the rule streams them by default).
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "FWD_STREAM", rows)
    monkeypatch.setattr(fused, "FWD_STREAM_PREFETCH", prefetch)
    monkeypatch.setattr(fused, "FWD_STREAM_FROM", 1)
    monkeypatch.setattr(fused, "SPLIT_BWD", split)
    assert fused.fwd_stream(n) == min(rows, fused._pow2(n))
    assert rows or not fused.tiles(n, 13, 4).one_chunk
    launched = _spy_launches(monkeypatch, fused, "_summaries_fwd_stream_kernel", lambda grid, k: grid)
    assert_two_phase_matches_reference(*make_inputs(4, n, 2, 21, 13, True, seed=n), True, up_seed=n + 1)
    assert bool(launched) == bool(rows), launched


def test_streamed_forward_setting_is_explicit(monkeypatch):
    """``FWD_STREAM`` applies from ``FWD_STREAM_FROM`` sources, at most the sources' power of two a load; a value
    outside the choices is refused with the value and the choices."""
    from kernels.depth_attn import fused

    assert [fused.fwd_stream(n) for n in (1, 5, 8, 9, 17)] == [0, 0, 0, 1, 1]  # the rule: 1 row from 9 sources
    assert fused.FWD_STREAM_PREFETCH is True
    monkeypatch.setattr(fused, "FWD_STREAM", 0)
    assert [fused.fwd_stream(n) for n in (1, 6, 9)] == [0, 0, 0]
    monkeypatch.setattr(fused, "FWD_STREAM", 4)
    monkeypatch.setattr(fused, "FWD_STREAM_FROM", 6)
    assert [fused.fwd_stream(n) for n in (1, 5, 6, 9)] == [0, 0, 4, 4]
    monkeypatch.setattr(fused, "FWD_STREAM_FROM", 1)
    assert [fused.fwd_stream(n) for n in (1, 2, 3, 5)] == [1, 2, 4, 4]
    for bad, match in ((3, r"FWD_STREAM=3: choose 0 .* or 1, 2, 4"), (True, r"FWD_STREAM=True: choose 0")):
        monkeypatch.setattr(fused, "FWD_STREAM", bad)
        with pytest.raises(ValueError, match=match):
            fused.fwd_stream(6)
    monkeypatch.setattr(fused, "FWD_STREAM", 2)
    monkeypatch.setattr(fused, "FWD_STREAM_PREFETCH", "yes")
    with pytest.raises(ValueError, match=r"FWD_STREAM_PREFETCH='yes': choose True or False"):
        fused.fwd_stream(6)
    monkeypatch.setattr(fused, "FWD_STREAM_PREFETCH", False)
    monkeypatch.setattr(fused, "FWD_STREAM_FROM", 0)
    with pytest.raises(ValueError, match=r"FWD_STREAM_FROM=0: choose a source count >= 1"):
        fused.fwd_stream(6)


def test_split_backward_setting_is_explicit(monkeypatch):
    """``SPLIT_BWD`` True or False overrides the rule for every call and keeps the rest of the tiles; anything else is
    refused with its value and the choices, before any launch."""
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "interpreting", lambda: False)
    monkeypatch.setattr(fused, "SPLIT_BWD", True)
    assert fused.tiles(5, 1024, 4) == dataclasses.replace(fused._tiles(5, 1024, tail=True), bwd_split=True)
    assert fused.tiles(5, 1024, 4) is fused.tiles(5, 1024, 4)  # cached with the other tiles, not rebuilt a call
    assert fused.tiles(3, 512, 2).bwd_split
    monkeypatch.setattr(fused, "SPLIT_BWD", None)  # the rule: 2 to 9 sources at d = 1024, whatever the consumers
    assert [n for n in range(1, 18) if fused.tiles(n, 1024, 4).bwd_split] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert fused.tiles(9, 1000, 1).bwd_split and not fused.tiles(6, 512, 4).bwd_split
    assert not fused.tiles(6, 2048, 4).bwd_split
    monkeypatch.setattr(fused, "WIDE_BWD", (8, 8, False, 128))  # the one kernel's tiles set: the rule gives way
    assert fused.tiles(6, 1024, 4) == fused._tiles(6, 1024, (8, 8, False, 128))
    monkeypatch.setattr(fused, "WIDE_BWD", None)
    monkeypatch.setattr(fused, "SPLIT_BWD", False)
    assert not any(fused.tiles(n, d, 4).bwd_split for n in (1, 3, 4, 8, 9) for d in (512, 1024, 2048))
    assert fused.tiles(3, 1024, 4) == fused._tiles(3, 1024, fused.NARROW_WIDE_BWD, tail=True)  # the other rules apply
    monkeypatch.setattr(fused, "SPLIT_BWD", "yes")
    with pytest.raises(ValueError, match=r"SPLIT_BWD='yes': choose None \(the rule\), True or False"):
        fused.tiles(5, 1024, 4)
    # the split scores kernel reduces once from 2 consumers (measured slower for one), unless SCORES_ONCE says
    assert fused.scores_once(4) and fused.scores_once(2) and not fused.scores_once(1)
    assert fused.split_tiles(5, 1024, 4, False)[0][1] != fused.split_tiles(5, 1024, 1, False)[0][1]  # its chunk follows
    # from the forward's logits (one accumulator) chunks of 64 or more; summing them again, 16 from 5 sources on
    assert [fused.split_tiles(n, 1024, 4, True)[0][1] for n in (2, 3, 5, 8)] == [128, 64, 64, 64]
    assert [fused.split_tiles(n, 1024, 4, False)[0][1] for n in (2, 3, 5, 8)] == [128, 64, 16, 16]
    monkeypatch.setattr(fused, "SCORES_ONCE", False)
    assert not fused.scores_once(4)
    monkeypatch.setattr(fused, "SCORES_ONCE", "x")
    with pytest.raises(ValueError, match=r"SCORES_ONCE='x': choose None \(the rule: from 2 consumers\), True or False"):
        fused.scores_once(4)
    # the forward keeps its logits for the split backward only, and only where SCORES_FROM_LOGITS is True
    monkeypatch.setattr(fused, "SPLIT_BWD", True)
    assert fused.scores_from_logits(5, 1024, 4)
    monkeypatch.setattr(fused, "SCORES_FROM_LOGITS", False)
    assert not fused.scores_from_logits(5, 1024, 4)
    monkeypatch.setattr(fused, "SCORES_FROM_LOGITS", True)
    monkeypatch.setattr(fused, "SPLIT_BWD", False)
    assert not fused.scores_from_logits(5, 1024, 4)
    monkeypatch.setattr(fused, "SCORES_FROM_LOGITS", 1.5)
    with pytest.raises(ValueError, match=r"SCORES_FROM_LOGITS=1.5: choose True or False"):
        fused.scores_from_logits(5, 1024, 4)
    # the gradients kernel's sources as rows or in one load: a bool, anything else refused with the choices
    monkeypatch.setattr(fused, "SPLIT_GRADS_ROWS", True)
    assert fused.split_grads_rows()
    monkeypatch.setattr(fused, "SPLIT_GRADS_ROWS", "yes")
    with pytest.raises(ValueError, match=r"SPLIT_GRADS_ROWS='yes': choose True or False"):
        fused.split_grads_rows()
    # prefetching: False, True (the sources) or "all" (their scalars too), and not with the rows, which it does not
    # apply to
    monkeypatch.setattr(fused, "SPLIT_GRADS_ROWS", True)
    monkeypatch.setattr(fused, "SPLIT_GRADS_PREFETCH", True)
    with pytest.raises(ValueError, match=r"SPLIT_GRADS_PREFETCH=True applies to loads .* set one of them"):
        fused.split_grads_prefetch()
    monkeypatch.setattr(fused, "SPLIT_GRADS_ROWS", False)
    assert fused.split_grads_prefetch() == 1
    monkeypatch.setattr(fused, "SPLIT_GRADS_PREFETCH", "all")
    assert fused.split_grads_prefetch() == 2
    monkeypatch.setattr(fused, "SPLIT_GRADS_PREFETCH", False)
    assert fused.split_grads_prefetch() == 0
    for bad in (1, "sources"):
        monkeypatch.setattr(fused, "SPLIT_GRADS_PREFETCH", bad)
        with pytest.raises(ValueError, match=rf"SPLIT_GRADS_PREFETCH={bad!r}: choose False, True \(the sources\) or "
                                             r"'all' \(the sources and the scalars\)"):
            fused.split_grads_prefetch()
    # the gradients kernel's register cap: none unless set, a count from 32 to 255 (never under the interpreter)
    assert fused.split_grads_maxnreg() == 0
    monkeypatch.setattr(fused, "SPLIT_GRADS_MAXNREG", 128)
    assert fused.split_grads_maxnreg() == 128
    for bad in (16, 300, 128.0, True):
        monkeypatch.setattr(fused, "SPLIT_GRADS_MAXNREG", bad)
        with pytest.raises(ValueError, match=rf"SPLIT_GRADS_MAXNREG={bad!r}: choose None \(the compiler's choice\) or a "
                                             "register count from 32 to 255"):
            fused.split_grads_maxnreg()


def test_forward_warps_setting_leaves_the_backward_alone(monkeypatch):
    """``FWD_WARPS`` sets the forward's warps above 512 channels only; the backward keeps the warps it had (one kernel,
    set by ``WIDE_BWD``, or split) and the tiles stay cached; a count that is not a power of two up to 16 is refused
    with its value and the choices."""
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "interpreting", lambda: False)
    before = {(n, d): fused.tiles(n, d, 4) for n in (2, 3, 6, 9) for d in (512, 1024, 2048)}
    monkeypatch.setattr(fused, "FWD_WARPS", 4)
    for (n, d), t in before.items():
        now = fused.tiles(n, d, 4)
        assert now is fused.tiles(n, d, 4)
        assert (now.bwd_warps or now.num_warps) == (t.bwd_warps or t.num_warps), (n, d)
        assert now.num_warps == (t.num_warps if d <= 512 else 4), (n, d)
        assert dataclasses.replace(now, num_warps=t.num_warps, bwd_warps=t.bwd_warps) == t
    monkeypatch.setattr(fused, "WIDE_BWD", (8, 8, False, 128))
    assert fused.tiles(3, 1024, 4).num_warps == 4 and fused.tiles(3, 1024, 4).bwd_warps == 8
    monkeypatch.setattr(fused, "FWD_TAIL", True)  # the forward's two loads: part of the cached tiles' key
    assert [(n, fused.tiles(n, 1024, 4).block_s, fused.tiles(n, 1024, 4).tail_s) for n in (3, 5, 6, 7)] == \
        [(3, 2, 1), (5, 4, 1), (6, 8, 0), (7, 8, 0)]
    monkeypatch.setattr(fused, "FWD_TAIL", False)
    assert fused.tiles(5, 1024, 4).tail_s == 0 and fused.tiles(5, 1024, 4).block_s == 8
    monkeypatch.setattr(fused, "FWD_WARPS", 3)
    with pytest.raises(ValueError, match=r"FWD_WARPS=3: choose None .* or 1, 2, 4, 8, 16"):
        fused.tiles(3, 1024, 4)


def test_row_gradients_take_the_rows_dtype_unless_set_to_fp32(monkeypatch):
    """A buffer's row gradients are in its rows' dtype (bf16 rows: bf16 gradients, as autograd gives a bf16 tensor);
    ``ROW_GRADIENTS="float32"`` keeps fp32 ones; another value is refused with the choices when a buffer is made."""
    from kernels.depth_attn import buffer as buf

    like = torch.zeros(2, 3, 8)
    assert SourceBuffer(4, like, dtype=torch.bfloat16).grads.target(2)[0].dtype == torch.bfloat16
    assert SourceBuffer(4, like).grads.target(2)[0].dtype == torch.float32
    monkeypatch.setattr(buf, "ROW_GRADIENTS", "float32")
    assert SourceBuffer(4, like, dtype=torch.bfloat16).grads.target(2)[0].dtype == torch.float32
    assert SourceBuffer(4, like.double()).grads.target(2)[0].dtype == torch.float32
    monkeypatch.setattr(buf, "ROW_GRADIENTS", "bf16")
    with pytest.raises(ValueError, match=r"ROW_GRADIENTS='bf16': choose one of 'rows', 'float32'"):
        SourceBuffer(4, like, dtype=torch.bfloat16)


@needs_interpreter
@pytest.mark.parametrize("setting", ["rows", "float32"])
def test_bf16_rows_read_by_many_calls_get_their_readers_gradient_sum(setting, monkeypatch):
    """bf16 rows read by three phase-1 calls (2, 3 and 4 sources, as Block AttnRes reads its summaries): each row's
    gradient is the sum of its readers', within bf16 rounding of the fp32 reference on the same rounded sources (one
    rounding a call with bf16 row gradients), and in the setting's dtype."""
    from kernels.depth_attn import buffer as buf

    monkeypatch.setattr(buf, "ROW_GRADIENTS", setting)
    sources, _, queries, _ = make_inputs(2, 4, 2, 9, 24, False, seed=11)
    rounded = sources.bfloat16()
    g = torch.Generator().manual_seed(12)
    ups = [torch.randn(2, 2, 9, 24, generator=g) for _ in range(3)]
    grads = {}
    for backend in ("triton", "torch"):
        leaves = [s.float().requires_grad_() for s in rounded.unbind(0)]
        buffer = SourceBuffer(4, rounded[0], dtype=torch.bfloat16 if backend == "triton" else torch.float32)
        loss = 0
        for k, s in enumerate(leaves):
            buffer.append(s)
            if k >= 1:
                outs, _ = depth_attn_summaries(buffer, queries, key_norm=True, backend=backend)
                loss = loss + (torch.stack(outs).float() * ups[k - 1]).sum()
        grads[backend] = torch.autograd.grad(loss, leaves)
        if backend == "triton":
            assert buffer.grads.data.dtype == (torch.bfloat16 if setting == "rows" else torch.float32)
    tol = 2e-2 if setting == "rows" else 5e-3
    for i, (a, b) in enumerate(zip(grads["triton"], grads["torch"])):
        assert rel_err(a, b) < tol, f"row {i}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize("n, C", [(1, 4), (4, 4), (8, 4), (9, 1), (17, 2)])
def test_split_tiles_hold_every_source_of_a_token(n, C, monkeypatch):
    """The scores kernel reads every source of its tokens at once (its block covers n) in chunks that divide the
    power-of-two width; the gradients kernel takes at most the sources there are."""
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "interpreting", lambda: False)
    (bt_a, chunk, warps_a), (bt_b, block_d, per_load), warps_b = fused.split_tiles(n, 1000, C)
    assert block_d == 1024 and block_d % chunk == 0 and chunk * fused._pow2(n) <= 2048
    assert 1 <= per_load <= fused._pow2(n) and (per_load == 2) == (C >= 3 and n >= 2)
    assert bt_b == 1 and warps_a == warps_b == 4
    monkeypatch.setattr(fused, "SPLIT_TILES", (8, 512, 8, 8, 8))  # a setting: clamped to the width and the sources
    assert fused.split_tiles(n, 1000, C) == ((8, 512, 8), (1, 1024, min(8, fused._pow2(n))), 8)
    monkeypatch.setattr(fused, "SPLIT_TILES", (8, 0, 8, 8, 8))
    with pytest.raises(ValueError, match=r"SPLIT_TILES=\(8, 0, 8, 8, 8\)"):
        fused.split_tiles(n, 1000, C)


@needs_interpreter
@pytest.mark.parametrize("chunks", [(2, 2, True), (8, 2, False), (1, 4, True), (8, 8, False)],
                         ids=["ragged-chunks", "fwd-one-bwd-two-pass-loop", "S1", "one-chunk-loop"])
def test_source_chunking_does_not_change_the_result(monkeypatch, chunks):
    # The kernels load BLOCK_S sources at a time: one chunk (read once), several with a ragged last
    # chunk (online softmax forward, two-pass backward), and a forward in one chunk with a backward
    # in several (the 16-warp tiles on the GPU); the backward unrolls its consumers or loops over
    # them. Every split must give the reference's result.
    from kernels.depth_attn import fused

    fwd_s, bwd_s, unroll = chunks
    n, d = 5, 37
    monkeypatch.setattr(fused, "tiles", lambda n_, d_, c_=None: fused.Tiles(32, fused._pow2(d_), fwd_s, n_ <= fwd_s, 4,
                                                                   bwd_s, n_ <= bwd_s, unroll))
    assert_two_phase_matches_reference(*make_inputs(3, n, 2, 19, d, True, seed=3), True, up_seed=4)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_interpreter),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
@pytest.mark.parametrize("from_outputs", [True, False], ids=["delta-from-outputs", "delta-from-sources"])
def test_bf16_phase_one_outputs_match_the_reference_and_take_bf16_gradients(device, from_outputs, monkeypatch):
    """``out_dtype=torch.bfloat16``: phase 1 writes its outputs in bf16 (fp32 sources) and their gradients come
    back in bf16 (the merge's backward writes them so); the reference rounds its outputs alike. Outputs within a
    bf16 rounding of the reference (the two fp32 results may round to neighbouring bf16 values), every gradient
    within bf16's relative error in norm, and not the fp32 result: the option rounds. With its backward's
    dO_c·o_c from the kept bf16 outputs (``fused.DELTA_FROM_OUTPUTS``, the default) and from a pass over the
    sources (4 sources over 2 loads under the interpreter, d = 37: the two-pass backward)."""
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "DELTA_FROM_OUTPUTS", from_outputs)
    sources, partials, queries, key_gains = make_inputs(3, 4, 2, 13, 37, True, seed=5, device=device)
    leaves = [t.requires_grad_() for t in (sources, partials, queries, key_gains)]
    results = {}
    for backend, out_dtype in (("triton", torch.bfloat16), ("torch", torch.bfloat16), ("torch", None)):
        buffer = SourceBuffer(sources.shape[0], sources[0])
        for s in sources.unbind(0):
            buffer.append(s)
        outs, lses = depth_attn_summaries(buffer, queries, key_gains, out_dtype=out_dtype, backend=backend)
        out_grads = []
        for o in outs:
            o.register_hook(out_grads.append)
        hs = [outs[0].float()] + [depth_attn_merge(outs[c], lses[c], partials[c], queries[c], key_gains[c],
                                                   backend=backend)[0] for c in (1, 2)]
        ups = torch.randn((3, *hs[0].shape), generator=torch.Generator().manual_seed(7)).to(device)
        grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(hs, ups)), leaves)
        results[backend, out_dtype] = outs, hs, grads, out_grads
    (outs, hs, grads, out_grads), (ref_outs, ref_hs, ref_grads, _) = results["triton", torch.bfloat16], \
        results["torch", torch.bfloat16]
    assert {o.dtype for o in outs} == {o.dtype for o in ref_outs} == {torch.bfloat16}
    assert [g.dtype for g in out_grads] == [torch.bfloat16] * 3
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-2)
    for a, b in zip(hs, ref_hs):
        assert a.dtype == torch.float32 and rel_err(a, b) < 4e-3
    for name, a, b in zip(("sources", "partials", "queries", "gains"), grads, ref_grads):
        assert rel_err(a, b) < 1e-2, f"{name}: relative error {rel_err(a, b):.2e}"
    fp32_hs = results["torch", None][1]
    assert min(rel_err(a, b) for a, b in zip(hs[1:], fp32_hs[1:])) > 1e-5  # rounded: not the fp32 merge


@needs_interpreter
@pytest.mark.parametrize("setting, C, d, kept", [("auto", 4, 37, False), ("auto", 1, 37, True), ("auto", 4, 520, True),
                                                 (True, 4, 37, True), (False, 1, 520, False)])
def test_phase_one_keeps_its_outputs_for_the_backward_where_the_setting_says(setting, C, d, kept, monkeypatch):
    """``fused.DELTA_FROM_OUTPUTS``: True (the default) hands the backward the kept bf16 outputs always, False never,
    "auto" above d = 512 or for one consumer (where that was faster alone on an H200, though not in the step). The backward's result is the same
    either way (within the outputs' bf16 rounding)."""
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "DELTA_FROM_OUTPUTS", setting)
    calls = []
    bwd = fused.summaries_bwd
    monkeypatch.setattr(fused, "summaries_bwd", lambda *a, **kw: calls.append(kw.get("out")) or bwd(*a, **kw))
    sources, _, queries, key_gains = make_inputs(C, 5, 1, 3, d, True, seed=3)
    sources.requires_grad_()
    up = torch.randn((C, 1, 3, d), generator=torch.Generator().manual_seed(4))

    def source_grad():
        outs, _ = depth_attn_summaries(sources, queries, key_gains, out_dtype=torch.bfloat16, backend="triton")
        return torch.autograd.grad(sum((o.float() * u).sum() for o, u in zip(outs, up)), [sources])[0]

    ds = source_grad()
    assert len(calls) == 1 and (calls[0] is not None) == kept
    assert fused.delta_from_outputs(C, d) == kept
    assert summaries_keep_outputs(sources, C, torch.bfloat16, backend="triton") == kept  # what a merge is told
    assert not summaries_keep_outputs(sources, C, None, backend="triton")  # outputs in the sources' dtype: not kept
    assert not summaries_keep_outputs(sources, C, torch.bfloat16, backend="torch")
    monkeypatch.setattr(fused, "SPLIT_BWD", True)  # the split backward sums dO·o from the sources: nothing kept
    calls.clear()
    source_grad()
    assert calls == [None] and not summaries_keep_outputs(sources, C, torch.bfloat16, backend="triton")
    monkeypatch.setattr(fused, "SPLIT_BWD", None)
    monkeypatch.setattr(fused, "DELTA_FROM_OUTPUTS", False)
    assert rel_err(ds, source_grad()) < 2e-2  # the outputs' bf16 rounding inside delta_c, at most


def test_an_unknown_delta_setting_names_the_choices(monkeypatch):
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "DELTA_FROM_OUTPUTS", "yes")
    with pytest.raises(ValueError, match=r"DELTA_FROM_OUTPUTS='yes': choose one of True, False, 'auto'"):
        fused.delta_from_outputs(4, 512)


def test_two_phase_reference_is_the_spec():
    # The composition summaries + merge is depth attention over [sources..., partial] (fp64).
    sources, partials, queries, key_gains = make_inputs(3, 4, 2, 5, 7, True)
    sources, partials, queries, key_gains = (t.double() for t in (sources, partials, queries, key_gains))
    for key_norm in (True, False):
        out, lse = reference.summaries(sources, queries, key_gains, key_norm=key_norm)
        for c in range(3):
            h, w = reference.merge(out[c], lse[c], partials[c], queries[c], key_gains[c], key_norm=key_norm)
            spec, spec_w = reference.depth_attn(torch.cat([sources, partials[c][None]]), queries[c:c + 1],
                                                key_gains[c:c + 1], key_norm=key_norm, return_weights=True)
            torch.testing.assert_close(h, spec[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(w, spec_w[0, -1], rtol=1e-12, atol=1e-12)


def test_two_phase_reference_gradcheck():
    g = torch.Generator().manual_seed(0)
    src, p, q, gain = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                       for s in ((3, 1, 2, 5), (1, 2, 5), (2, 5), (2, 5)))

    def f(src, p, q, gain):
        out, lse = reference.summaries(src, q, gain)
        return reference.merge(out[1], lse[1], p, q[1], gain[1])[0], out[0]

    torch.autograd.gradcheck(f, (src, p, q, gain))


@needs_interpreter
@pytest.mark.parametrize("keep_out", [False, True], ids=["keeps-h", "keeps-o"])
@pytest.mark.parametrize("bias", [0.0, 9.0], ids=["mixed", "partial-dominant"])
def test_merge_keeps_only_its_partial_and_its_output(bias, keep_out):
    """The fused merge's backward needs dh·(p − o), which it takes as dh·(p − h)/(1 − w) from its output h (the
    consumer's sublayer input, held by an eager sublayer anyway), or with ``keep_out`` (a caller that holds o anyway)
    from o itself (when o is contiguous: else h, not a copy of o): the large tensors it saves are its partial and
    one of h and o, nothing else. Its gradients
    match the fp64 reference for a random upstream gradient, also when the partial takes nearly all the weight
    (1 − w down to 6e-4, where p − h is small). fp32 keeps dz = w·dh·(p − h) to about eps/(1 − w) relative, as
    it keeps w(1 − w)·dh·(p − o) from the fp32 w (measured at 1 − w = 6e-4: 8.7e-6 against 6.4e-6 for the
    log-sum-exp's gradient)."""
    sources, partials, queries, key_gains = make_inputs(2, 4, 2, 13, 24, True, seed=3)
    partials[1] += bias * queries[1] / queries[1].norm() * 24 ** 0.5  # aligned with the query: a large logit
    out, lse = depth_attn_summaries(sources, queries, key_gains, backend="torch")
    o = out[1].detach().requires_grad_()  # a view of the stacked (C, B, T, d): not contiguous
    lse1 = lse[1].detach().requires_grad_()
    p = partials[1].clone().requires_grad_()
    q = queries[1].clone().requires_grad_()
    gain = key_gains[1].clone().requires_grad_()
    if keep_out:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            h, _ = depth_attn_merge(o, lse1, p, q, gain, keep_out=True, backend="triton")
        assert {t.data_ptr() for t in saved if t.dim() == 3} == {p.data_ptr(), h.data_ptr()}, "a copy of o kept"
        o = out[1].detach().contiguous().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h, w = depth_attn_merge(o, lse1, p, q, gain, keep_out=keep_out, backend="triton")
    large = {t.data_ptr() for t in saved if t.dim() == 3}
    kept = o if keep_out else h
    assert large == {p.data_ptr(), kept.data_ptr()}, "the merge keeps a (B, T, d) tensor other than p and h (or o)"
    if bias:
        assert float(w.max()) > 0.999, float(w.max())
    up = torch.randn(h.shape, generator=torch.Generator().manual_seed(4))
    leaves = (o, lse1, p, q, gain)
    grads = torch.autograd.grad((h * up).sum(), leaves)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    ref_h, _ = reference.merge(*wide)
    ref_grads = torch.autograd.grad((ref_h * up.double()).sum(), wide)
    for name, a, b in zip(("o", "lse", "p", "q", "gain"), grads, ref_grads):
        assert rel_err(a.double(), b) < (3e-5 if bias else 1e-5), f"{name}: relative error {rel_err(a.double(), b):.2e}"


# (id, partial's dtype or None, new's dtype, B, T, d): sums the interpreter computes exactly (its fp32 -> bf16
# conversion truncates, so a sum rounded to bf16 is left to the GPU test)
MERGE_SUM_CASES = [
    ("first-of-block", None, torch.float32, 2, 19, 37),
    ("fp32", torch.float32, torch.float32, 3, 11, 24),
    ("bf16-partial-fp32-output", torch.bfloat16, torch.float32, 1, 33, 40),
    ("fp32-partial-bf16-output", torch.float32, torch.bfloat16, 2, 1, 16),
]


def merge_sum_inputs(prev_dtype, new_dtype, B, T, d, seed=5):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(B, T, d, generator=g).requires_grad_()
    lse = (0.5 * torch.randn(B, T, generator=g)).requires_grad_()
    prev = None if prev_dtype is None else (1.5 * torch.randn(B, T, d, generator=g)).to(prev_dtype).requires_grad_()
    new = torch.randn(B, T, d, generator=g).to(new_dtype).requires_grad_()
    q = (0.5 * torch.randn(d, generator=g)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(d, generator=g)).requires_grad_()
    return o, lse, prev, new, q, gain


@needs_interpreter
@pytest.mark.parametrize("keep_out", [False, True], ids=["keeps-h", "keeps-o"])
@pytest.mark.parametrize("case", MERGE_SUM_CASES, ids=[c[0] for c in MERGE_SUM_CASES])
def test_merge_sum_matches_the_reference(case, keep_out):
    """``depth_attn_merge(new=...)`` (Block AttnRes's running partial summed inside the merge) against the reference:
    h, w and the summed partial p, then every gradient, with random upstream gradients on h and on p, and p read
    again downstream (as the next merge and the block's summary read it): the backward adds p's gradient from its
    other readers into the merge's own and hands the sum to both terms. Without a partial, p is ``new`` itself."""
    _, prev_dtype, new_dtype, B, T, d = case
    o, lse, prev, new, q, gain = merge_sum_inputs(prev_dtype, new_dtype, B, T, d)
    leaves = [t for t in (o, lse, prev, new, q, gain) if t is not None]
    g = torch.Generator().manual_seed(6)
    up_h, up_p = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    results = {}
    for backend in ("triton", "torch"):
        h, w, p = depth_attn_merge(o, lse, prev, q, gain, new=new, keep_out=keep_out, backend=backend)
        loss = (h * up_h).sum() + (p.float() * up_p).sum() + 0.1 * p.float().pow(2).sum()
        results[backend] = (h, w, p, torch.autograd.grad(loss, leaves))
    (h, w, p, grads), (ref_h, ref_w, ref_p, ref_grads) = results["triton"], results["torch"]
    assert p.dtype == ref_p.dtype and h.dtype == ref_h.dtype
    torch.testing.assert_close(p, ref_p, rtol=0, atol=0)  # the same sum, rounded once to the same dtype
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    if prev is None:
        assert p.data_ptr() == new.data_ptr(), "without a partial the op returns new as it is (no copy)"
    names = [n for n, t in zip(("o", "lse", "prev", "new", "q", "gain"), (o, lse, prev, new, q, gain)) if t is not None]
    for name, a, b in zip(names, grads, ref_grads):
        assert a.dtype == b.dtype, name
        assert rel_err(a.float(), b.float()) < 1e-5, f"{name}: relative error {rel_err(a.float(), b.float()):.2e}"


@needs_interpreter
@pytest.mark.parametrize("keep_out", [False, True], ids=["keeps-h", "keeps-o"])
def test_merge_sum_passes_the_partials_gradient_when_h_is_unused(keep_out):
    """Only p read downstream (h takes no gradient, autograd hands the op None for it): the terms get p's gradient
    alone and o, lse no gradient, as in the reference, with either tensor kept (o narrower than h here)."""
    o, lse, prev, new, q, gain = merge_sum_inputs(torch.float32, torch.float32, 2, 5, 16)
    o = o.detach().to(torch.bfloat16).requires_grad_()
    up = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(8))
    res = {}
    for backend in ("triton", "torch"):
        h, _, p = depth_attn_merge(o, lse, prev, q, gain, new=new, keep_out=keep_out, backend=backend)
        assert h.dtype == torch.float32
        res[backend] = torch.autograd.grad((p * up).sum(), [o, lse, prev, new], allow_unused=True,
                                           materialize_grads=True)
    for name, a, b in zip(("o", "lse", "prev", "new"), res["triton"], res["torch"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-6, msg=name)
    assert float(res["triton"][1].abs().max()) == 0 and float(res["triton"][2].abs().max()) > 0


@needs_interpreter
def test_merge_sum_keeps_only_its_sum_and_its_output():
    """The summing merge keeps the (B, T, d) tensors the merge alone keeps, the partial it merged (here the sum,
    which the residual holds as its next partial anyway) and its output h: not the phase-1 output, not the
    terms of the sum."""
    o, lse, prev, new, q, gain = merge_sum_inputs(torch.float32, torch.float32, 2, 7, 24)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h, _, p = depth_attn_merge(o, lse, prev, q, gain, new=new, backend="triton")
    assert {t.data_ptr() for t in saved if t.dim() == 3} == {p.data_ptr(), h.data_ptr()}


def test_merge_without_any_partial_is_refused():
    o, lse, _, new, q, gain = merge_sum_inputs(None, torch.float32, 1, 3, 8)
    with pytest.raises(ValueError, match="partial is None and no new output"):
        depth_attn_merge(o, lse, None, q, gain, backend="torch")
    with pytest.raises(ValueError, match=r"new \(1, 3, 9\)"):
        depth_attn_merge(o, lse, None, q, gain, new=torch.zeros(1, 3, 9), backend="torch")


@needs_interpreter
def test_buffer_rows_are_read_in_place_and_written_once():
    # Phase 1 reads the buffer rows written so far; a later append does not change an earlier
    # result's backward (rows are never modified), and a full buffer is an error.
    sources, _, queries, key_gains = make_inputs(2, 3, 1, 6, 8, True)
    leaf = sources.requires_grad_()
    buffer = SourceBuffer(3, leaf[0])
    for s in leaf[:2].unbind(0):
        buffer.append(s)
    outs, _ = depth_attn_summaries(buffer, queries, key_gains, backend="triton")
    buffer.append(leaf[2] * 3)  # written after the phase-1 call above
    ref = depth_attn(leaf[:2], queries, key_gains, backend="torch")
    up = torch.randn(ref.shape)
    (a,) = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, up)), leaf)
    (b,) = torch.autograd.grad((ref * up).sum(), leaf)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="all 3 rows are written"):
        buffer.append(leaf[0])


def growing_reads(backend, leaf, queries, key_gains):
    """The full-AttnRes pattern over a buffer: row i is written, then read by a phase-1 call over
    rows [0, i+1) (so row 0 has every call as a reader) and, for odd i, by a merge as its partial,
    and row 1 also by a plain PyTorch op. Returns every output (outputs, merges, the op)."""
    n = leaf.shape[0]
    buffer = SourceBuffer(n + 1, leaf[0])  # a spare row: never written, never read
    outs = []
    for i in range(n):
        row = buffer.append(leaf[i] * (1 + i))  # each row a function of a leaf: gradients go through it
        o, lse = depth_attn_summaries(buffer, queries, key_gains, backend=backend)
        outs += o
        if i % 2:
            outs.append(depth_attn_merge(o[0], lse[0], row, queries[0], None if key_gains is None else key_gains[0],
                                         backend=backend)[0])
        if i == 1:
            outs.append(row.square())
    return outs


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_interpreter),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_rows_read_by_many_calls_get_the_sum_of_their_readers_gradients(device):
    # Each phase-1 backward adds its rows' gradient into the buffer's RowGradients (rows a later call's
    # backward reached already) or writes it (rows it reaches first); a row's gradient is that sum plus
    # what its other readers (a merge, a PyTorch op) hand autograd. Against the reference on random
    # upstream gradients, twice through the same graph (retain_graph: the second pass starts from zero).
    sources, _, queries, key_gains = make_inputs(3, 5, 2, 19, 37, True, seed=5, device=device)
    leaves = [sources.requires_grad_(), queries.requires_grad_(), key_gains.requires_grad_()]
    fused = growing_reads("triton", *leaves)
    ref = growing_reads("torch", *leaves)
    g = torch.Generator(device).manual_seed(6)
    ups = [torch.randn(h.shape, generator=g, device=device) for h in ref]
    loss = sum((h * u).sum() for h, u in zip(fused, ups))
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    ref_grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(ref, ups)), leaves)
    for i, (a, a2, b) in enumerate(zip(first, second, ref_grads)):
        assert rel_err(a, b) < (1e-5 if device == "cpu" else 1e-4), f"input {i}: relative error {rel_err(a, b):.2e}"
        torch.testing.assert_close(a2, a, rtol=0, atol=0, msg=f"input {i}: second backward")


@needs_interpreter
@pytest.mark.parametrize("way", ["one-chunk", "chunks-of-2", "split", "split-rows", "split-prefetch",
                                 "split-prefetch-all"])
def test_summaries_backward_adds_into_the_rows_it_is_told_to(monkeypatch, way):
    # summaries_bwd with a gradient buffer: rows [0, n_add) get the buffer's earlier content plus this
    # call's gradient, rows [n_add, n) this call's gradient alone, rows past n are untouched (n = 5: the last load of
    # 2 ragged); with every source in one chunk, in chunks of 2 (the two-pass backward), and split (its gradients
    # kernel in loads of 2 sources, as rows, ``SPLIT_GRADS_ROWS``, or loaded a trip ahead with their scalars or not,
    # ``SPLIT_GRADS_PREFETCH``).
    from kernels.depth_attn import fused

    if way == "chunks-of-2":
        monkeypatch.setattr(fused, "tiles", lambda n_, d_, c_=None: fused.Tiles(32, fused._pow2(d_), 8, True, 4, 2, False,
                                                                       False))
    monkeypatch.setattr(fused, "SPLIT_BWD", way.startswith("split"))
    monkeypatch.setattr(fused, "SPLIT_GRADS_ROWS", way == "split-rows")
    monkeypatch.setattr(fused, "SPLIT_GRADS_PREFETCH", {"split-prefetch": True, "split-prefetch-all": "all"}.get(way, False))

    n, n_max, B, T, d = 5, 7, 2, 19, 37
    sources, _, queries, _ = make_inputs(3, n_max, B, T, d, False, seed=7)
    g = torch.Generator().manual_seed(8)
    out, lse, _, _ = fused.summaries_fwd(sources, n, queries, key_norm=True, eps=1e-6, store_logits=False)
    douts = tuple(torch.randn(out[0].shape, generator=g) for _ in range(3))
    dlse = torch.randn(lse.shape, generator=g)
    fresh, dqg = fused.summaries_bwd(sources, n, queries, lse, douts, dlse, key_norm=True, eps=1e-6)
    for n_add in (0, 1, 4, 5):
        before = torch.randn(n_max, B, T, d, generator=g)
        dst = before.clone()
        _, dqg2 = fused.summaries_bwd(sources, n, queries, lse, douts, dlse, key_norm=True, eps=1e-6, dsrc=dst,
                                      n_add=n_add)
        torch.testing.assert_close(dst[:n_add], before[:n_add] + fresh[:n_add], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dst[n_add:n], fresh[n_add:], rtol=0, atol=0)
        assert torch.equal(dst[n:], before[n:]) and torch.equal(dqg2, dqg)
    with pytest.raises(ValueError, match="n_add=6"):
        fused.summaries_bwd(sources, n, queries, lse, douts, dlse, key_norm=True, eps=1e-6, dsrc=before, n_add=6)


@needs_interpreter
def test_summaries_backward_takes_delta_from_the_outputs_it_is_given(monkeypatch):
    """``summaries_bwd(out=)``: dO_c·o_c from the given outputs instead of a first pass over the sources (the
    two-pass backward, chunks of 2 sources). Given the forward's own fp32 outputs it agrees with the pass over
    the sources to fp32 rounding; given other outputs it differs (they are what it reads); a misshapen one is
    an error naming the shape wanted."""
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "tiles", lambda n_, d_, c_=None: fused.Tiles(32, fused._pow2(d_), 8, True, 4, 2, False, True))
    n, B, T, d = 5, 2, 19, 37
    sources, _, queries, _ = make_inputs(3, n, B, T, d, False, seed=11)
    g = torch.Generator().manual_seed(12)
    out, lse, _, _ = fused.summaries_fwd(sources, n, queries, key_norm=True, eps=1e-6, store_logits=False)
    douts = tuple(torch.randn(out[0].shape, generator=g) for _ in range(3))
    dlse = torch.randn(lse.shape, generator=g)
    kw = dict(key_norm=True, eps=1e-6)
    ref_dsrc, ref_dqg = fused.summaries_bwd(sources, n, queries, lse, douts, dlse, **kw)
    dsrc, dqg = fused.summaries_bwd(sources, n, queries, lse, douts, dlse, out=out, **kw)
    assert rel_err(dsrc, ref_dsrc) < 1e-5 and rel_err(dqg, ref_dqg) < 1e-5, (rel_err(dsrc, ref_dsrc), rel_err(dqg, ref_dqg))
    other, _ = fused.summaries_bwd(sources, n, queries, lse, douts, dlse, out=out * 1.5, **kw)
    assert rel_err(other, ref_dsrc) > 1e-2
    with pytest.raises(ValueError, match=r"out must be the contiguous outputs \(3, 2, 19, 37\)"):
        fused.summaries_bwd(sources, n, queries, lse, douts, dlse, out=out[:2], **kw)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_buffer_sums_in_the_terms_precision_and_routes_gradients(device):
    # A bf16 block summary stored in an fp32 buffer (bf16-mixed training: the embedding is fp32):
    # summed in bf16 like the reference's partial + out, then cast (one kernel: the add's out= is the fp32 row);
    # gradients reach both terms in bf16 (one cast, shared).
    g = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(2, 33, 65, generator=g, device=device).bfloat16().requires_grad_() for _ in range(2))
    assert not torch.equal((a + b).float(), a.float() + b.float())  # the bf16 rounding of the sum shows
    buffer = SourceBuffer(2, torch.zeros(2, 33, 65, device=device))
    buffer.append(torch.zeros(2, 33, 65, device=device))
    row = buffer.append(a, b)
    assert row.dtype == torch.float32 and torch.equal(row, (a + b).float())
    up = torch.randn(row.shape, generator=g, device=device)
    da, db = torch.autograd.grad((row * up).sum(), (a, b))
    assert da.dtype == db.dtype == torch.bfloat16 and torch.equal(da, up.bfloat16()) and torch.equal(db, da)


def test_unsupported_inputs_are_refused(monkeypatch):
    sources, partials, queries, key_gains = make_inputs(2, 3, 1, 4, 8, True)
    with pytest.raises(ValueError, match="float64"):
        depth_attn(sources.double(), queries.double(), backend="triton")
    with pytest.raises(ValueError, match="static"):
        depth_attn(sources, queries[:, None, None].expand(2, 1, 4, 8), backend="triton")
    with pytest.raises(ValueError, match="shared sources"):
        depth_attn(sources[None].expand(2, -1, -1, -1, -1), queries, backend="triton")
    with pytest.raises(ValueError, match=r"next_pow2\(queries\)·next_pow2\(d\) <= 32768, got 2 queries and d=20000"):
        depth_attn(torch.zeros(1, 1, 1, 20000), torch.zeros(2, 20000), backend="triton")
    with pytest.raises(ValueError, match="no source yet"):
        depth_attn_summaries(SourceBuffer(2, sources[0]), queries, backend="triton")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        depth_attn_merge(sources[0], sources[0, ..., 0], partials[0], queries[0], backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        depth_attn_summaries(sources, queries, backend="triton")
    outs, _ = depth_attn_summaries(sources, queries, backend="auto")  # CPU: the reference
    torch.testing.assert_close(torch.stack(outs), depth_attn(sources, queries, backend="torch"))


# --- GPU ------------------------------------------------------------------------------------------
GPU_CASES = [
    ("block-C4-n5-B4-T1024-d512", 4, 5, 4, 1024, 512, True, True),
    ("block-C4-n9-B2-T2048-d1024", 4, 9, 2, 2048, 1024, True, True),
    ("block-C4-n5-B1-T2048-d2048", 4, 5, 1, 2048, 2048, True, True),
    ("full-C2-n17-B2-T777-d200-rawkeys", 2, 17, 2, 777, 200, False, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [None, True, "once", "split-rows", "split-prefetch", "split-prefetch-all", False,
                                   "fwd-stream1", "fwd-stream2-prefetch"],
                         ids=["rule", "split", "split-once", "split-rows", "split-prefetch", "split-prefetch-all",
                              "one-kernel", "fwd-stream1", "fwd-stream2-prefetch"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_bf16_matches_fp32_reference(case, split, monkeypatch):
    # bf16 sources and partials, fp32 queries/gains (parameters); relative error < 1e-2 for h and
    # every gradient against the fp32 reference on the same bf16-rounded inputs; the phase-1 backward as the rule
    # picks it (and its scores as scores_once does), split in two kernels (its scores reduced a chunk at a time, or
    # once: SCORES_ONCE), the split's gradients kernel over its sources as rows (SPLIT_GRADS_ROWS) or loading them a
    # trip ahead (SPLIT_GRADS_PREFETCH), and the one kernel of before; the rule's backward after the forward with its
    # sources streamed 1 or 2 rows a load (FWD_STREAM, the second with the next load in flight) at every source count.
    from kernels.depth_attn import fused

    if split in ("fwd-stream1", "fwd-stream2-prefetch"):
        monkeypatch.setattr(fused, "FWD_STREAM", 1 if split == "fwd-stream1" else 2)
        monkeypatch.setattr(fused, "FWD_STREAM_PREFETCH", split.endswith("prefetch"))
        monkeypatch.setattr(fused, "FWD_STREAM_FROM", 1)
        split = None

    named = ("split-rows", "split-prefetch", "split-prefetch-all")
    monkeypatch.setattr(fused, "SPLIT_BWD", True if split in ("once", *named) else split)
    monkeypatch.setattr(fused, "SCORES_ONCE", True if split == "once" else None if split in (None, *named) else False)
    monkeypatch.setattr(fused, "SPLIT_GRADS_ROWS", split == "split-rows")
    monkeypatch.setattr(fused, "SPLIT_GRADS_PREFETCH", {"split-prefetch": True, "split-prefetch-all": "all"}.get(split, False))
    _, C, n, B, T, d, key_norm, gains = case
    sources, partials, queries, key_gains = make_inputs(C, n, B, T, d, gains, device="cuda")
    bf = [sources.bfloat16().requires_grad_(), partials.bfloat16().requires_grad_(),
          queries.requires_grad_(), *([key_gains.requires_grad_()] if gains else [])]
    ref_in = [t.detach().float().requires_grad_() for t in bf]
    fused, _, _ = two_phase("triton", bf[0], bf[1], bf[2], bf[3] if gains else None, key_norm)
    ref, _, _ = two_phase("torch", ref_in[0], ref_in[1], ref_in[2], ref_in[3] if gains else None, key_norm)
    assert all(h.dtype == torch.bfloat16 for h in fused)
    for c, (a, b) in enumerate(zip(fused, ref)):
        assert rel_err(a, b) < 1e-2, f"consumer {c}: {rel_err(a, b):.2e}"
    g = torch.Generator("cuda").manual_seed(1)
    ups = [torch.randn(h.shape, device="cuda", generator=g) for h in ref]
    grads = torch.autograd.grad(sum((h.float() * u).sum() for h, u in zip(fused, ups)), bf)
    ref_grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(ref, ups)), ref_in)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert rel_err(a, b) < 1e-2, f"input {i}: relative error {rel_err(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtypes", [(None, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.float32)], ids=["first-bf16", "bf16", "bf16-fp32", "fp32"])
def test_gpu_merge_sum_matches_the_reference(dtypes):
    """The summing merge on the GPU, in the dtypes training meets (bf16 attention outputs, fp32 MoE outputs): the sum p
    rounds as PyTorch's add does (equal), h and every gradient within 1e-2 (bf16 terms) or 1e-5 (fp32) in norm of
    the reference on the same inputs, with random upstream gradients on h and p."""
    B, T, d = 2, 333, 512
    g = torch.Generator("cuda").manual_seed(7)
    o = torch.randn(B, T, d, device="cuda", generator=g).requires_grad_()
    lse = torch.randn(B, T, device="cuda", generator=g).requires_grad_()
    prev = None if dtypes[0] is None else torch.randn(B, T, d, device="cuda", generator=g).to(dtypes[0]).requires_grad_()
    new = torch.randn(B, T, d, device="cuda", generator=g).to(dtypes[1]).requires_grad_()
    q = (0.1 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    leaves = [t for t in (o, lse, prev, new, q, gain) if t is not None]
    up_h, up_p = torch.randn(B, T, d, device="cuda", generator=g), torch.randn(B, T, d, device="cuda", generator=g)
    res = {}
    for backend in ("triton", "torch"):
        h, w, p = depth_attn_merge(o, lse, prev, q, gain, new=new, backend=backend)
        res[backend] = (h, p, torch.autograd.grad((h * up_h).sum() + (p.float() * up_p).sum(), leaves))
    tol = 1e-2 if torch.bfloat16 in dtypes else 1e-5
    torch.testing.assert_close(res["triton"][1], res["torch"][1], rtol=0, atol=0)
    assert rel_err(res["triton"][0], res["torch"][0]) < tol
    for i, (a, b) in enumerate(zip(res["triton"][2], res["torch"][2])):
        assert rel_err(a.float(), b.float()) < tol, f"input {i}: relative error {rel_err(a.float(), b.float()):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [False, True], ids=["one-kernel", "split"])
def test_gpu_fp32_matches_reference(split, monkeypatch):
    from kernels.depth_attn import fused

    monkeypatch.setattr(fused, "SPLIT_BWD", split)
    sources, partials, queries, key_gains = make_inputs(4, 5, 2, 333, 768, True, device="cuda")
    leaves = [t.requires_grad_() for t in (sources, partials, queries, key_gains)]
    fused, _, _ = two_phase("triton", *leaves, True)
    ref, _, _ = two_phase("torch", *leaves, True)
    for a, b in zip(fused, ref):
        assert rel_err(a, b) < 1e-5
    ups = [torch.randn_like(h) for h in ref]
    grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(fused, ups)), leaves)
    ref_grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(ref, ups)), leaves)
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) < 1e-4


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(__import__("triton").__file__),
                                                    "backends", "nvidia", "bin", "ptxas")),
                    reason="the triton wheel has no ptxas")
def test_kernels_compile_for_sm90_with_the_gpu_tiles():
    """Every depth-attention kernel compiles for an H100/H200 with the tiles ``fused.tiles`` and
    ``fused._row_tiles`` pick on a GPU (Triton's NVIDIA backend and ptxas, no GPU needed), at the widths of
    `small` and `medium` (the split backward's kernels at `medium`): catches GPU-only compile errors on CPU CI. Phase 1
    at d = 512 runs one warp a token,
    so its reductions over d need no shared memory, and its backward (one source a load) spills nothing (with two
    sources a load it spilled 332 bytes at block-small and was 0.336 against 0.272 ms on an H200), nor when it takes
    dO·o from the outputs (``DELTA_FROM_OUT``); spills elsewhere stay at a few hundred bytes."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.depth_attn_ptxas", "--shapes", "block-small", "full-small",
                          "block-medium", "--sass"], cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if "registers" in line]
    # 3 shapes x (phase 1 fwd, bwd, bwd taking dO·o from the outputs, merge fwd, bwd, each alone and summing), and
    # block-medium's split backward (5 sources at d = 1024: the rule takes it), its scores kernel taking the forward's
    # logits and summing them again, and its gradients kernel in one load of a trip's sources, as rows
    # (``SPLIT_GRADS_ROWS``) and loading a trip ahead its sources or its scalars too (``SPLIT_GRADS_PREFETCH``, under
    # the launch's cap), without spills; block-medium's forward with its sources streamed (``FWD_STREAM``) 1 or 2 rows
    # a load, with the next load in flight or not
    assert len(lines) == 31, res.stdout
    stream = [line for line in lines if "phase 1 forward, streamed" in line]
    assert [line.split(" {")[0] for line in stream] == ["phase 1 forward, streamed 1 a load",
                                                        "phase 1 forward, streamed 1 a load, prefetched",
                                                        "phase 1 forward, streamed 2 a load",
                                                        "phase 1 forward, streamed 2 a load, prefetched"], res.stdout
    # one row a load holds far fewer registers than every source at once (8 programs an SM instead of 6 at 5 sources)
    assert all(" 0 bytes spill stores" in line for line in stream), res.stdout
    regs = {line.split(" {")[0]: int(re.search(r"Used (\d+) registers", line).group(1)) for line in lines
            if "phase 1 forward" in line and "warps=2" in line}
    assert regs["phase 1 forward, streamed 1 a load"] <= 128 < regs["phase 1 forward"], res.stdout
    split = [line for line in lines if "phase 1 backward, split" in line]
    assert [line.split(" {")[0] for line in split] == [
        "phase 1 backward, split: scores", "phase 1 backward, split: scores, logits summed again",
        "phase 1 backward, split: gradients", "phase 1 backward, split: gradients, sources as rows",
        "phase 1 backward, split: gradients, prefetched",
        "phase 1 backward, split: gradients, prefetched with its scalars"], res.stdout
    assert all("Used 168 registers" in line for line in split if "prefetched" in line), res.stdout  # the cap holds
    assert all(" 0 bytes spill stores" in line for line in split), res.stdout
    # --sass: each kernel's loops follow its line (the phase-1 backward loops over its sources and consumers)
    after = res.stdout.split("phase 1 backward", 1)[1].split("merge forward", 1)[0]
    assert re.search(r"loop depth \d+: \d+ instructions \(fp32 \d+", after), res.stdout
    assert max(int(re.search(r"(\d+) bytes spill stores", line).group(1)) for line in lines) <= 512, res.stdout
    small_phase1 = lines[:3] + lines[7:10]  # block-small and full-small, phase 1
    assert all("warps=1" in line and " 0 bytes spill stores" in line for line in small_phase1), res.stdout
    # the reductions over d are shuffles; taking dO·o from the outputs may move its (C, T) sums once a token (16 bytes
    # at block-small's C = 4)
    shared = [int(re.search(r"shared (\d+) B", line).group(1)) for line in small_phase1]
    assert shared[:2] == shared[3:5] == [0, 0] and max(shared[2], shared[5]) <= 16, res.stdout


def test_wide_backward_tiles_apply_above_512_channels_and_name_a_bad_setting(monkeypatch):
    """``WIDE_BWD`` (sources per load, warps, consumers unrolled, register cap) sets the phase-1 backward's tiles where a
    token takes two or more warps (d > 512), leaves the forward's and d <= 512 alone, and a malformed value is refused
    with its text before any launch."""
    from kernels.depth_attn import fused

    gpu = fused._tiles(6, 1024)
    wide = fused._tiles(6, 1024, (8, 8, False, 128))
    assert (wide.bwd_block_s, wide.bwd_one_chunk, wide.bwd_warps, wide.bwd_maxnreg, wide.bwd_unroll_c) == \
        (8, True, 8, 128, False)
    assert (wide.block_t, wide.block_s, wide.one_chunk, wide.num_warps) == \
        (gpu.block_t, gpu.block_s, gpu.one_chunk, gpu.num_warps)  # the forward's tiles unchanged
    assert fused._tiles(3, 1024, (2, 4, True, 0)).bwd_one_chunk is False  # 3 sources over two loads of 2
    assert fused._tiles(2, 1024, (8, 8, False, 128)).bwd_block_s == 2  # never more than the sources
    monkeypatch.setattr(fused, "interpreting", lambda: False)
    monkeypatch.setattr(fused, "SPLIT_BWD", False)  # the one kernel's tiles (the split's rule: its own test)
    monkeypatch.setattr(fused, "FWD_TAIL", False)  # the forward's one load, as _tiles gives it unless told (own test)
    # unset: one load of 4 over 4 warps (NARROW_WIDE_BWD) for 3 or 4 sources of at most 4 consumers at d = 1024 alone
    narrow = fused._tiles(3, 1024, fused.NARROW_WIDE_BWD)
    assert (narrow.bwd_block_s, narrow.bwd_one_chunk, narrow.bwd_warps, narrow.bwd_maxnreg) == (4, True, 4, 168)
    assert fused.tiles(3, 1024, 4) == narrow and fused.tiles(4, 1024, 2).bwd_warps == 4
    assert fused.tiles(4, 1024, 8) == fused.tiles(4, 1024) == fused._tiles(4, 1024)  # more consumers: not measured
    assert fused.tiles(5, 1024, 4) == fused._tiles(5, 1024) and fused.tiles(2, 1024, 4) == fused._tiles(2, 1024)
    assert fused.tiles(3, 2048, 4) == fused._tiles(3, 2048) and fused.tiles(3, 512, 4) == fused._tiles(3, 512)
    monkeypatch.setattr(fused, "WIDE_BWD", (8, 8, False, 128))
    assert fused.tiles(6, 1024) == wide and fused.tiles(6, 512) == fused._tiles(6, 512)
    assert fused.tiles(3, 1024, 4) == fused._tiles(3, 1024, (8, 8, False, 128))  # a setting wins over the rule
    monkeypatch.setattr(fused, "WIDE_BWD", (8, 0, False, 128))
    with pytest.raises(ValueError, match=r"WIDE_BWD=\(8, 0, False, 128\)"):
        fused.tiles(6, 1024)
