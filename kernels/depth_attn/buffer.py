"""Preallocated storage for the sources of depth attention, so reads never re-stack them.

Every source (a block summary, or a sublayer output in full AttnRes) is written once into row i of
one (n_max, B, T, d) tensor when it is complete, and never modified afterwards. The fused phase-1
kernel reads rows [0, n) of that tensor in place; autograd sees each row as a view produced by
``StoreFunction`` whose gradient flows to the terms it was summed from. Pure PyTorch (no Triton).

A row is read by every later phase-1 call, so its gradient is a sum over those calls. Summed by
autograd that is one extra pass over a (B, T, d) tensor per extra reader (64 a backward in
full AttnRes at 16 sublayers); instead the phase-1 backward kernel accumulates into
:class:`RowGradients`, one (n_max, B, T, d) tensor in the rows' dtype (``ROW_GRADIENTS``), and the row's
``StoreFunction`` takes its gradient from there. Each call adds its fp32 sum into a row once, rounded to the row's
dtype: a bf16 row (Block AttnRes's sources under autocast) gets a bf16 gradient, as autograd gives any bf16 tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor


# The dtype of a buffer's row gradients: "rows" (the buffer's own: bf16 rows take bf16 gradients, half the bytes that
# every phase-1 backward reads and writes back) or "float32" (the default before 2026-12-03: each call's sum added
# in fp32). A module setting so that a benchmark row or arm can take either
# (``py:kernels.depth_attn.buffer.ROW_GRADIENTS=float32``); read when a buffer is made.
ROW_GRADIENTS = "rows"
ROW_GRADIENT_CHOICES = ("rows", "float32")


def row_gradient_dtype(rows: torch.dtype) -> torch.dtype:
    """The gradients' dtype for rows of ``rows`` dtype per ``ROW_GRADIENTS``."""
    if ROW_GRADIENTS not in ROW_GRADIENT_CHOICES:
        raise ValueError(f"buffer.ROW_GRADIENTS={ROW_GRADIENTS!r}: choose one of "
                         + ", ".join(map(repr, ROW_GRADIENT_CHOICES)))
    return rows if ROW_GRADIENTS == "rows" else torch.float32


class RowGradients:
    """The gradients of a buffer's rows, accumulated in place by the phase-1 backward kernel.

    Rows [0, ``rows``) hold a gradient so far; the others are stale. Every phase-1 call reads a prefix
    [0, n) of the buffer, and its backward writes the rows it is the first to reach and adds into the
    rest (``target``). A row's ``StoreFunction`` runs after every reader of it (autograd orders it so)
    and ``take``s the finished sum; the rows from there on count as stale again, so a second backward
    through the same graph (``retain_graph``) starts from zero. Holds no reference to the buffer's rows
    (no reference cycle through the autograd graph)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32):
        self.shape, self.device, self.dtype = shape, device, dtype
        self.data: Tensor | None = None  # (n_max, B, T, d) in ``dtype``, allocated by the first backward
        self.rows = 0

    def target(self, n: int) -> tuple[Tensor, int]:
        """For a phase-1 backward over rows [0, n): the gradient tensor and how many of its rows to add into."""
        if self.data is None:
            self.data = torch.empty(self.shape, device=self.device, dtype=self.dtype)
        n_add = min(n, self.rows)
        self.rows = max(self.rows, n)
        return self.data, n_add

    def take(self, row: int, grad: Tensor | None) -> Tensor | None:
        """Row ``row``'s gradient: what the kernels accumulated plus ``grad`` (from its other readers)."""
        acc = self.data[row] if self.data is not None and row < self.rows else None
        self.rows = min(self.rows, row)
        if acc is None:
            return grad
        return acc if grad is None else acc + grad


class StoreFunction(torch.autograd.Function):
    """``apply(holder, row, *terms)``: holder[0].data[row] = Σ terms (cast to the buffer's dtype), returned
    as an alias of that row; its gradient (the fused phase-1 readers' sum in holder[0].grads, plus any
    gradient autograd hands it) goes to every term. The buffer is passed inside a list so that
    autograd does not take it as an input: it is storage, and each row is written once."""

    @staticmethod
    def forward(ctx, holder, row, *terms):
        dst = holder[0].data[row]
        if len(terms) == 1:
            dst.copy_(terms[0])
        elif len(terms) == 2 and terms[0].dtype == terms[1].dtype:
            # the block summary b_n = partial + last output, summed in the terms' dtype and cast into the row by one
            # kernel (an add's result is rounded to its inputs' dtype before it is stored into a wider ``out``)
            torch.add(terms[0], terms[1], out=dst)
        else:  # sum in the terms' own precision, as the reference does, then cast like torch.stack
            dst.copy_(sum(terms[1:], terms[0]))
        ctx.dtypes = [t.dtype for t in terms]
        ctx.grads, ctx.row = holder[0].grads, row
        ctx.set_materialize_grads(False)  # the fused readers hand back no gradient: it is in ctx.grads
        # an alias of the row that autograd does not know as a view of the buffer: a view would make
        # autograd refuse it once a later row is written in place (the row itself never changes)
        return torch.empty(0, dtype=dst.dtype, device=dst.device).set_(
            dst.untyped_storage(), dst.storage_offset(), dst.shape, dst.stride())

    @staticmethod
    def backward(ctx, grad):
        grad = ctx.grads.take(ctx.row, grad)
        if grad is None:
            return (None, None, *(None for _ in ctx.dtypes))
        cast = {grad.dtype: grad}  # one cast per dtype: terms of one dtype share it (autograd does not write into it)
        for dt in ctx.dtypes:
            if dt not in cast:
                cast[dt] = grad.to(dt)
        return (None, None, *(cast[dt] for dt in ctx.dtypes))


class SourceBuffer:
    """Sources of depth attention in one preallocated (n_max, B, T, d) tensor.

    ``append(*terms)`` writes Σ terms into the next row and returns it (a differentiable alias of the row);
    ``rows`` lists the views written so far. The dtype is fixed at construction (the first source's,
    e.g. the embedding's): later sources are cast to it, as ``torch.stack`` would promote them."""

    def __init__(self, n_max: int, like: Tensor, dtype: torch.dtype | None = None):
        self.data = torch.empty(n_max, *like.shape, device=like.device, dtype=dtype or like.dtype)
        self.stream_dtype = like.dtype  # the sources' dtype as their writers hold them, whatever the rows store
        self.rows: list[Tensor] = []
        self.grads = RowGradients(tuple(self.data.shape), like.device, row_gradient_dtype(self.data.dtype))

    def __len__(self) -> int:
        return len(self.rows)

    @torch.compiler.disable  # storage bookkeeping: a graph break under torch.compile
    def append(self, *terms: Tensor) -> Tensor:
        if len(self.rows) == self.data.shape[0]:
            raise ValueError(f"SourceBuffer: all {self.data.shape[0]} rows are written")
        shape = tuple(self.data.shape[1:])
        for t in terms:
            if tuple(t.shape) != shape:
                raise ValueError(f"SourceBuffer: a source must be {shape}, got {tuple(t.shape)}")
        row = StoreFunction.apply([self], len(self.rows), *terms)
        self.rows.append(row)
        return row
