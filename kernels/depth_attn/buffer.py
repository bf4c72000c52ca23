"""Preallocated storage for the sources of depth attention, so reads never re-stack them.

Every source (a block summary, or a sublayer output in full AttnRes) is written once into row i of
one (n_max, B, T, d) tensor when it is complete, and never modified afterwards. The fused phase-1
kernel reads rows [0, n) of that tensor in place; autograd sees each row as a view produced by
``StoreFunction`` whose gradient flows to the terms it was summed from. Pure PyTorch (no Triton).
"""

from __future__ import annotations

import torch
from torch import Tensor


class StoreFunction(torch.autograd.Function):
    """``apply(holder, row, *terms)``: holder[0][row] = Σ terms (cast to the buffer's dtype), returned
    as an alias of that row; its gradient goes to every term. The buffer is passed inside a list so
    that autograd does not take it as an input: it is storage, and each row is written once."""

    @staticmethod
    def forward(ctx, holder, row, *terms):
        dst = holder[0][row]
        if len(terms) == 1:
            dst.copy_(terms[0])
        elif all(t.dtype == dst.dtype for t in terms):
            torch.add(terms[0], terms[1], out=dst)  # the block summary b_n = partial + last output
            for t in terms[2:]:
                dst.add_(t)
        else:  # sum in the terms' own precision, as the reference does, then cast like torch.stack
            dst.copy_(sum(terms[1:], terms[0]))
        ctx.dtypes = [t.dtype for t in terms]
        # an alias of the row that autograd does not know as a view of the buffer: a view would make
        # autograd refuse it once a later row is written in place (the row itself never changes)
        return torch.empty(0, dtype=dst.dtype, device=dst.device).set_(
            dst.untyped_storage(), dst.storage_offset(), dst.shape, dst.stride())

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *(grad if dt == grad.dtype else grad.to(dt) for dt in ctx.dtypes))


class SourceBuffer:
    """Sources of depth attention in one preallocated (n_max, B, T, d) tensor.

    ``append(*terms)`` writes Σ terms into the next row and returns it (a differentiable alias of the row);
    ``rows`` lists the views written so far. The dtype is fixed at construction (the first source's,
    e.g. the embedding's): later sources are cast to it, as ``torch.stack`` would promote them."""

    def __init__(self, n_max: int, like: Tensor, dtype: torch.dtype | None = None):
        self.data = torch.empty(n_max, *like.shape, device=like.device, dtype=dtype or like.dtype)
        self.rows: list[Tensor] = []

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
        row = StoreFunction.apply([self.data], len(self.rows), *terms)
        self.rows.append(row)
        return row
