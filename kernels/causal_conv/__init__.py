"""Causal depthwise token convolution with document resets (see ``reference.py``).

Only a PyTorch reference: the fused MSAR op (``kernels.msar_attn``) makes its conv views inside its
own kernel, so there is no standalone Triton conv.
"""

from __future__ import annotations

from . import reference

BACKENDS = ("torch",)


def causal_conv(x, taps, doc_ids=None, *, backend="auto"):
    """Causal depthwise conv; same signature as :func:`reference.causal_conv` plus ``backend``.

    ``backend``: ``"auto"`` or ``"torch"`` (the reference, the only implementation). Anything else
    is an error naming the choices.
    """
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"causal_conv: unknown backend {backend!r}; choices: auto, {', '.join(BACKENDS)}")
    return reference.causal_conv(x, taps, doc_ids)


__all__ = ["BACKENDS", "causal_conv"]
