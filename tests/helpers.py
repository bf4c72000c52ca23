"""Shared test helpers: config composition and a tiny backbone."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parent.parent


def make_cfg(*overrides: str) -> DictConfig:
    from platform.config import compose

    return compose(*overrides)


def tiny_model_cfg(**changes):
    """A smaller-than-tiny backbone for unit tests."""
    cfg = make_cfg("model=tiny", *[f"model.{k}={v}" for k, v in changes.items()])
    return cfg.model


def build_backbone(residual: str = "vanilla", vocab: int = 97, residual_overrides: tuple = (), **model_changes):
    from platform.config import residual_config
    from platform.model import Backbone

    cfg = make_cfg("model=tiny", f"residual={residual}", *residual_overrides,
                   *[f"model.{k}={v}" for k, v in model_changes.items()])
    return Backbone(cfg.model, vocab, residual_config(cfg))


def packed_batch(B: int, T: int, vocab: int, n_docs: int = 3, seed: int = 0):
    """Random tokens and doc ids with several documents per row (boundaries at random places)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cuts = sorted(torch.randperm(T - 2, generator=g)[: n_docs - 1].add(1).tolist())
        for c in cuts:
            doc_ids[b, c:] += 1
        doc_ids[b] += 10 * b
    return tokens, doc_ids


def perturb_residual_params_alike(ref, other, scale: float = 0.2) -> None:
    """Move ref's residual parameters off their init by random amounts and give other the same values
    (two backbones of one mechanism on different backends, compared away from the init's symmetries)."""
    with torch.no_grad():
        for p_ref, p_other in zip(ref.residual.parameters(), other.residual.parameters(), strict=True):
            p_ref.add_(scale * torch.randn_like(p_ref))
            p_other.copy_(p_ref)


def backward_both_after_equal_outputs(ref, other, tokens, docs, norm_tol: float | None = None):
    """Two backbones with the same parameters: their logits agree (fp32: rtol 1e-4, atol 1e-5; or, with
    ``norm_tol``, within that norm-wise relative error), then one random upstream gradient goes back through
    both. Returns the (name, ref param, other param) triples whose gradients the caller compares with its own
    tolerance."""
    out_ref, out_other = ref(tokens, docs), other(tokens, docs)
    if norm_tol is None:
        torch.testing.assert_close(out_other, out_ref, rtol=1e-4, atol=1e-5)
    else:
        assert rel_err(out_other.detach(), out_ref.detach()) < norm_tol
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    out_other.backward(g)
    return [(n, a, b) for (n, a), (_, b) in zip(ref.named_parameters(), other.named_parameters(), strict=True)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 (b: the reference); for fused-vs-reference comparisons in norm."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def runs_on_and_off(monkeypatch, owner, attr: str, build, tokens, docs, seen: list) -> tuple[tuple, tuple]:
    """A code setting ``owner.attr`` True, then False: each time ``build()`` a backbone (under seed 0), run it forward and
    back with one random upstream gradient. Returns (on, off), each (logits, {name: gradient}, list(seen)); ``seen`` is
    what the caller's spies recorded during that run (cleared before it)."""
    runs = {}
    for value in (True, False):
        monkeypatch.setattr(owner, attr, value)
        seen.clear()
        torch.manual_seed(0)
        model = build()
        out = model(tokens, docs)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        runs[value] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                       list(seen))
    return runs[True], runs[False]
