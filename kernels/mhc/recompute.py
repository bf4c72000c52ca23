"""The streams kept every L_r sublayers and rebuilt in backward (mHC, arXiv 2512.24880, §4.3: recomputation).

Without it every fused write keeps its input streams X_l (N, n, d) for backward: L tensors of n·d per token, most of
mHC's memory over the plain residual. The paper keeps X_l only at the first sublayer of every block of L_r and rebuilds
the others in backward from the writes' small inputs, which backward keeps anyway:

    X_{l+1} = H^res_l X_l + H^post_lᵀ f_l          (the write kernel, one per rebuilt layer)

``StreamRecompute(every=L_r)`` is made once per forward (``residuals/mhc.py``: ``residual.recompute_every``) and passed to
every fused write with its sublayer index. A write of sublayer l then saves X_l only when l % L_r == 0 (and X_{l+1},
which its fused next read needs, only when (l+1) % L_r == 0). In backward a write asks ``streams(l)`` for what it did
not keep: the first request in a block rebuilds the block from its kept X_{l0} upward, one write kernel a layer, and
each rebuilt X is dropped after its last use (the read of its own sublayer, which runs after its write's backward).

Costs: one write kernel per dropped layer in backward (reads n·d + d, writes n·d a token), and up to L_r − 1 rebuilt
streams alive at once. Kept: ⌈L / L_r⌉ streams instead of L. The paper's optimum for the sum of both is
L_r* = √(n·L / (n + 2)) (n = 4: 3 for 16 sublayers, 5 for 32).

The writes' inputs (X_{l0}, f_l, H^post_l, H^res_l) are read from the writes' own saved tensors, held here through
weak references to their autograd nodes: nothing here keeps a tensor alive that backward has released, and a second
backward (``retain_graph=True``) rebuilds again. The rebuilt streams come from the same write kernel, on the same
inputs, as the forward's (unless ``fused.POST_PRE_ONE_PASS`` made them in the read's kernel), so they equal them to
the bit.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

from torch import Tensor


def optimal_every(n: int, n_sublayers: int) -> int:
    """The paper's L_r* = √(n·L / (n + 2)), rounded (n = 4: 3 for 16 sublayers, 5 for 32); 0 (keep every stream)
    where it rounds to 1, which would keep every stream anyway."""
    every = round(math.sqrt(n * n_sublayers / (n + 2)))
    return every if every > 1 else 0


class StreamRecompute:
    """Which streams the fused writes of one forward keep, and the rebuild of the others in backward."""

    def __init__(self, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"mhc: recompute every={every!r} must be an integer >= 1 (1 keeps every stream)")
        self.every = every
        self._writes: dict[int, weakref.ref] = {}  # layer l -> the autograd node of the write X_l -> X_{l+1}
        self._rebuilt: dict[int, Tensor] = {}  # layer -> X_layer (N, n, d), rebuilt, until its last use
        self.rebuilds = 0  # write kernels run to rebuild streams (for tests and benchmarks)

    def keeps(self, layer: int) -> bool:
        """Whether the write that reads X_layer (and the one that makes it) saves it for backward."""
        return layer % self.every == 0

    def record_write(self, layer: int, node) -> None:
        """The write of sublayer ``layer`` ran: its node saved (X_layer or None, f, H^post, H^res) first."""
        self._writes[layer] = weakref.ref(node)

    def _write_inputs(self, layer: int) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
        ref = self._writes.get(layer)
        node = None if ref is None else ref()
        if node is None:
            raise RuntimeError(f"mhc: the streams of sublayer {layer + 1} cannot be rebuilt: the write of sublayer "
                               f"{layer} is not part of a live graph (recorded writes: {sorted(self._writes)})")
        return tuple(node.saved_tensors[:4])

    def streams(self, layer: int, write: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """X_layer (N, n, d): kept, rebuilt before, or rebuilt now from its block's kept streams with ``write``
        (x, f, H^post, H^res) -> X'."""
        if layer in self._rebuilt:
            return self._rebuilt[layer]
        base = layer - layer % self.every
        start = max((k for k in self._rebuilt if base < k < layer), default=base)
        x = self._rebuilt[start] if start != base else self._write_inputs(base)[0]  # X_base: kept by its write
        for k in range(start, layer):
            _, f, h_post, h_res = self._write_inputs(k)
            x = write(x, f, h_post, h_res)  # X_{k+1}
            self._rebuilt[k + 1] = x
            self.rebuilds += 1
        return x

    def release(self, layer: int) -> None:
        """X_layer had its last use (the backward of the read of sublayer ``layer``): drop it if it was rebuilt."""
        self._rebuilt.pop(layer, None)
