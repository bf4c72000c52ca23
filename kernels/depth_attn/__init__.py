"""Depth attention: per-view softmax retrieval over a stack of sources (see ``reference.py``)."""

from __future__ import annotations

from . import reference

BACKENDS = ("torch",)


def depth_attn(sources, queries, key_gains=None, *, key_sources=None, key_norm=True, eps=1e-6,
               return_weights=False, backend="auto"):
    """Depth attention; same signature as :func:`reference.depth_attn` plus ``backend``.

    ``backend``: ``"auto"`` (the best available: ``"torch"`` for now), ``"torch"`` (the reference).
    An unavailable backend is an error, never a silent fallback.
    """
    if backend == "auto":
        backend = "torch"
    if backend == "torch":
        return reference.depth_attn(sources, queries, key_gains, key_sources=key_sources,
                                    key_norm=key_norm, eps=eps, return_weights=return_weights)
    if backend == "triton":
        raise NotImplementedError(f"depth_attn: backend 'triton' is not implemented yet; "
                                  f"available backends: {', '.join(BACKENDS)} (or 'auto')")
    raise ValueError(f"depth_attn: unknown backend {backend!r}; choices: auto, {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "depth_attn"]
