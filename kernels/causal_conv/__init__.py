"""Causal depthwise token convolution with document resets (see ``reference.py``)."""

from __future__ import annotations

from . import reference

BACKENDS = ("torch",)


def causal_conv(x, taps, doc_ids=None, *, backend="auto"):
    """Causal depthwise conv; same signature as :func:`reference.causal_conv` plus ``backend``.

    ``backend``: ``"auto"`` (the best available: ``"torch"`` for now), ``"torch"`` (the reference).
    An unavailable backend is an error, never a silent fallback.
    """
    if backend == "auto":
        backend = "torch"
    if backend == "torch":
        return reference.causal_conv(x, taps, doc_ids)
    if backend == "triton":
        raise NotImplementedError(f"causal_conv: backend 'triton' is not implemented yet; "
                                  f"available backends: {', '.join(BACKENDS)} (or 'auto')")
    raise ValueError(f"causal_conv: unknown backend {backend!r}; choices: auto, {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "causal_conv"]
