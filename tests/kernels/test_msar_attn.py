"""The fused MSAR retrieval (conv views + depth attention) against its reference, and the reference
against the formula of SPEC §4 written out. On CPU the Triton kernels run under TRITON_INTERPRET=1
(set by the root conftest before any kernel import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.msar_attn import msar_attn
from kernels.msar_attn import reference

ROOT = Path(__file__).resolve().parents[2]
# the CPU tests run the Triton kernels on CPU tensors: only under the interpreter
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")

# (id, S, B, T, d, kernels, key_norm, gains)
CASES = [
    ("S1-B1-T7-d8-k2", 1, 1, 7, 8, (2,), True, True),
    ("S3-B2-T33-d24-k3,5", 3, 2, 33, 24, (3, 5), True, True),
    ("S3-B2-T33-d24-k4,8,12-nogain", 3, 2, 33, 24, (4, 8, 12), True, False),
    ("S3-B1-T33-d8-k4,8,12-rawkeys", 3, 1, 33, 8, (4, 8, 12), False, True),
    ("S1-B2-T7-d24-k3,5-rawkeys-nogain", 1, 2, 7, 24, (3, 5), False, False),
    ("S3-B2-T7-d8-k12-longer-than-T", 3, 2, 7, 8, (12,), True, True),
]
IDS = [c[0] for c in CASES]


def doc_ids_for(B, T, generator, device="cpu"):
    """Several documents per row: random boundaries plus one forced in the middle."""
    starts = torch.rand(B, T, generator=generator) < 0.2
    starts[:, T // 2] = True
    starts[:, 0] = False
    return torch.cumsum(starts.long(), dim=1).to(device)


def make_inputs(S, B, T, d, kernels, gains, *, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device, dtype)

    m = 1 + len(kernels)
    x = rand(S, B, T, d, scale=2.0)
    taps = [rand(k, d, scale=0.5) for k in kernels]
    queries = rand(m, d)
    key_gains = rand(m, d, scale=0.3, shift=1.0) if gains else None
    return x, taps, queries, key_gains, doc_ids_for(B, T, g, device)


def leaves(x, taps, queries, key_gains):
    return [t.requires_grad_() for t in (x, queries, key_gains, *taps) if t is not None]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# --- the fused kernel against the reference -------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_matches_reference(case):
    _, S, B, T, d, kernels, key_norm, gains = case
    x, taps, queries, key_gains, doc_ids = make_inputs(S, B, T, d, kernels, gains)
    used = leaves(x, taps, queries, key_gains)
    results = {}
    for backend in ("triton", "torch"):
        results[backend] = msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm,
                                     return_weights=True, backend=backend)
    (out, w), (ref_out, ref_w) = results["triton"], results["torch"]
    assert out.shape == ref_out.shape == (1 + len(kernels), B, T, d) and out.dtype == x.dtype
    assert w.shape == ref_w.shape and w.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(w, ref_w) < 1e-5

    # random upstream gradients (a ones_like gradient would hide errors of the softmax backward)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * up).sum(), used)
    ref_grads = torch.autograd.grad((ref_out * up).sum(), used)
    names = ["x", "queries", *(["key_gains"] if gains else []), *(f"taps[{i}]" for i in range(len(kernels)))]
    for name, a, b in zip(names, grads, ref_grads):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-4, f"{name}: relative error {rel_err(a, b):.2e}"


@needs_triton
def test_triton_small_blocks_several_chunks(monkeypatch):
    """GPU-like geometry under the interpreter: token blocks of 4, two blocks per backward program,
    so blocks straddle documents, the last chunk is partial and partial sums are reduced."""
    from kernels.msar_attn import fused

    monkeypatch.setattr(fused, "_blocks", lambda T, d: (4, triton_next_pow2(d), 4, 2))
    x, taps, queries, key_gains, doc_ids = make_inputs(2, 2, 19, 12, (3, 6), True)
    used = leaves(x, taps, queries, key_gains)
    out = msar_attn(x, taps, queries, key_gains, doc_ids, backend="triton")
    ref = msar_attn(x, taps, queries, key_gains, doc_ids, backend="torch")
    assert rel_err(out, ref) < 1e-5
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad((out * up).sum(), used), torch.autograd.grad((ref * up).sum(), used)):
        assert rel_err(a, b) < 1e-4


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


@needs_triton
def test_triton_zero_queries_at_init():
    """The pseudo-queries start at zero (AttnRes §3): uniform weights, and still a query gradient."""
    x, taps, _, key_gains, doc_ids = make_inputs(3, 1, 11, 8, (4,), True)
    queries = torch.zeros(2, 8)
    used = leaves(x, taps, queries, key_gains)
    out, w = msar_attn(x, taps, queries, key_gains, doc_ids, return_weights=True, backend="triton")
    ref = msar_attn(x, taps, queries, key_gains, doc_ids, backend="torch")
    torch.testing.assert_close(w, torch.full_like(w, 1 / 3))
    assert rel_err(out, ref) < 1e-5
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad((out * up).sum(), used), torch.autograd.grad((ref * up).sum(), used)):
        assert rel_err(a, b) < 1e-4


@needs_triton
def test_triton_non_contiguous_inputs():
    x, taps, queries, key_gains, doc_ids = make_inputs(2, 2, 9, 8, (3,), True)
    x_nc = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    taps_nc = [c.t().contiguous().t() for c in taps]
    assert not x_nc.is_contiguous() and not taps_nc[0].is_contiguous()
    out = msar_attn(x_nc, taps_nc, queries, key_gains, doc_ids, backend="triton")
    ref = msar_attn(x, taps, queries, key_gains, doc_ids, backend="torch")
    assert rel_err(out, ref) < 1e-5


# --- the reference itself --------------------------------------------------------------------------
def explicit_loop(x, taps, queries, key_gains, doc_ids, key_norm, eps=1e-6):
    """SPEC §4 written out: every view, source, token and tap by hand (fp64)."""
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


@pytest.mark.parametrize("key_norm", [True, False], ids=["key-norm", "raw-keys"])
def test_reference_equals_explicit_loop(key_norm):
    x, taps, queries, key_gains, doc_ids = make_inputs(2, 2, 6, 5, (2, 3), True, dtype=torch.float64)
    out = reference.msar_attn(x, taps, queries, key_gains, doc_ids, key_norm=key_norm)
    torch.testing.assert_close(out, explicit_loop(x, taps, queries, key_gains, doc_ids, key_norm))


def test_reference_gradcheck_fp64():
    x, taps, queries, key_gains, doc_ids = make_inputs(2, 1, 5, 3, (2, 3), True, dtype=torch.float64)

    def f(x, queries, key_gains, *taps):
        return reference.msar_attn(x, list(taps), queries, key_gains, doc_ids)

    assert torch.autograd.gradcheck(f, tuple(leaves(x, taps, queries, key_gains)))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_causal_and_document_local(backend):
    """Perturbing token t0 of one row changes no output before t0 and none in another document."""
    S, B, T, d = 2, 2, 16, 8
    x, taps, queries, key_gains, _ = make_inputs(S, B, T, d, (3, 5), True)
    doc_ids = torch.tensor([[0] * 6 + [1] * 6 + [2] * 4, [0] * 16])
    out = msar_attn(x, taps, queries, key_gains, doc_ids, backend=backend)
    t0 = 7  # inside document 1 of row 0 (tokens 6..11)
    x2 = x.clone()
    x2[:, 0, t0] += 5.0
    out2 = msar_attn(x2, taps, queries, key_gains, doc_ids, backend=backend)
    changed = (out2 - out).abs().amax(dim=(0, 3)) > 0  # (B, T)
    assert changed[0, t0]
    assert not changed[0, :t0].any(), "an earlier token saw a later one"
    assert not changed[0, 12:].any(), "another document saw the change"
    assert not changed[1].any(), "another row saw the change"


# --- dispatch --------------------------------------------------------------------------------------
def test_unknown_backend_lists_choices():
    x, taps, queries, key_gains, doc_ids = make_inputs(1, 1, 4, 4, (2,), False)
    with pytest.raises(ValueError, match="auto, torch, triton"):
        msar_attn(x, taps, queries, key_gains, doc_ids, backend="cuda")


@pytest.mark.parametrize("what", ["d-too-large", "k-too-large", "fp64", "bad-queries", "bad-doc-ids"])
def test_unsupported_inputs_are_refused(what):
    d = 2048 if what == "d-too-large" else 4
    dtype = torch.float64 if what == "fp64" else torch.float32
    x, taps, queries, key_gains, doc_ids = make_inputs(1, 1, 4, d, (17 if what == "k-too-large" else 2,), True,
                                                       dtype=dtype)
    if what == "bad-queries":
        queries = queries[:1]
    if what == "bad-doc-ids":
        doc_ids = doc_ids[:, :3]
    with pytest.raises(ValueError, match="msar_attn"):
        msar_attn(x, taps, queries, key_gains, doc_ids, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path without the interpreter")
def test_triton_on_cpu_without_interpreter_is_an_error():
    code = ("import torch; from kernels.msar_attn import msar_attn\n"
            "x = torch.randn(1, 1, 4, 4); q = torch.randn(2, 4); c = [torch.randn(2, 4)]\n"
            "d = torch.zeros(1, 4, dtype=torch.long)\n"
            "try:\n    msar_attn(x, c, q, None, d, backend='triton')\n"
            "except RuntimeError as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert "REFUSED" in res.stdout and "TRITON_INTERPRET=1" in res.stdout, res.stdout + res.stderr


def test_auto_is_torch_on_cpu():
    x, taps, queries, key_gains, doc_ids = make_inputs(2, 1, 5, 4, (2,), True)
    a = msar_attn(x, taps, queries, key_gains, doc_ids, backend="auto")
    b = msar_attn(x, taps, queries, key_gains, doc_ids, backend="torch")
    assert torch.equal(a, b)


# --- GPU ------------------------------------------------------------------------------------------
GPU_CASES = [
    ("S5-B4-T1024-d512-k4,8,12", 5, 4, 1024, 512, (4, 8, 12), True, True),
    ("S9-B2-T2048-d1024-k4,8,12", 9, 2, 2048, 1024, (4, 8, 12), True, True),
    ("S3-B2-T333-d200-k3,5-rawkeys", 3, 2, 333, 200, (3, 5), False, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_bf16_matches_fp32_reference(case):
    _, S, B, T, d, kernels, key_norm, gains = case
    x, taps, queries, key_gains, doc_ids = make_inputs(S, B, T, d, kernels, gains, device="cuda")
    bf = [t.bfloat16().requires_grad_() for t in leaves(x, taps, queries, key_gains)]
    # the reference runs in fp32 on the same bf16-rounded inputs: the error is the kernel's alone
    ref_in = [t.detach().float().requires_grad_() for t in bf]
    bx, bq, *rest = bf
    bg, btaps = (rest[0], rest[1:]) if gains else (None, rest)
    rx, rq, *rrest = ref_in
    rg, rtaps = (rrest[0], rrest[1:]) if gains else (None, rrest)
    out, w = msar_attn(bx, btaps, bq, bg, doc_ids, key_norm=key_norm, return_weights=True, backend="triton")
    ref, ref_w = msar_attn(rx, rtaps, rq, rg, doc_ids, key_norm=key_norm, return_weights=True, backend="torch")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2
    assert rel_err(w, ref_w) < 2e-2
    up = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    grads = torch.autograd.grad((out.float() * up).sum(), bf)
    ref_grads = torch.autograd.grad((ref * up).sum(), ref_in)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert rel_err(a, b) < 2e-2, f"input {i}: relative error {rel_err(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp32_matches_reference():
    x, taps, queries, key_gains, doc_ids = make_inputs(3, 2, 257, 96, (4, 8, 12), True, device="cuda")
    used = leaves(x, taps, queries, key_gains)
    out = msar_attn(x, taps, queries, key_gains, doc_ids, backend="triton")
    ref = msar_attn(x, taps, queries, key_gains, doc_ids, backend="torch")
    assert rel_err(out, ref) < 1e-5
    up = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * up).sum(), used), torch.autograd.grad((ref * up).sum(), used)):
        assert rel_err(a, b) < 1e-4
