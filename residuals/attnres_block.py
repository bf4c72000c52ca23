"""Block AttnRes: depth attention over block summaries instead of every sublayer output (docs/method.md §3).

Paper: "Attention Residuals", Kimi Team, arXiv 2603.15031 (Block AttnRes).

The L sublayers form N = L / S blocks of S sublayers. Between sublayers the state is b_0 = the
embedding (a permanent source, never summed into a block), the completed block summaries
b_1 .. b_{n-1} (plain sums of their sublayers' outputs) and the running partial sum of the current
block. Sublayer i of block n attends over [b_0, ..., b_{n-1}, partial] (no partial at the block's
first sublayer); the final output attends over [b_0, ..., b_N]. Persistent state: N+1 tensors.
With ``query="input"`` the latest source is the last of that list (the partial, or at a block start
the newest summary).

S must be even, so block boundaries fall between Transformer blocks. S = 1 is allowed as the
special case N = L: every summary is then a single sublayer output and this is full AttnRes
exactly (``tests/residuals/test_attnres.py`` checks outputs and gradients).

:class:`BlockSummaries` turns any :class:`~residuals.attnres.DepthAttentionResidual` into its block
form (``msar_block`` uses it too); :class:`BlockFields` adds ``block_size`` to its config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from kernels.depth_attn import SourceBuffer
from kernels.msar_attn import BufferedSources

from .attnres import AttnRes, FusedState
from .base import Context
from .registry import register


@dataclass
class BlockFields:
    """Config fields of the block variants (mixed into their Config)."""

    block_size: int = 4  # sublayers per block S: even and dividing the sublayer count, or 1 (full AttnRes)


@dataclass(frozen=True)
class BlockState:
    """Between sublayers of a block variant: single-stream block summaries only."""

    ctx: Context
    summaries: tuple[Tensor, ...]  # (b_0 = embedding, b_1, ..., b_{n-1}), each (B, T, d)
    partial: Tensor | None  # (B, T, d): sum of the current block's outputs so far; None at a block start
    buffer: SourceBuffer | None = None  # the summaries as rows of one buffer (a fused read takes them in place)
    # the partial in the buffer's dtype, as a fused read over the buffer takes it, cast by the write that sums it
    # (``BlockSummaries.cast_partial_in_write``); None: the read casts it
    partial_read: Tensor | None = None


class BlockSummaries:
    """Mixin, first among the bases: ``class X(BlockSummaries, SomeDepthAttentionResidual)``.
    Replaces the full list of sources with [b_0, completed summaries, partial]."""

    # the two-phase path with a fused merge: the write sums the partial inside the next consumer's merge (one op,
    # forward and backward); False sums it by a separate add and merges in the read, as up to 2026-12-02 night (kept to
    # time the two in one process: `benchmarks.throughput --residuals attnres_block@py:...BlockSummaries.sum_in_merge=False`)
    sum_in_merge: bool = True
    # a fused read over the buffer (msar_block) takes the open block's partial in the buffer's dtype (bf16 under
    # autocast): True casts it in the write that sums it, where the compiled graph fuses the cast with the sum (and,
    # backward, the gradient's cast back with the partial's other gradients); False casts it in each read, eagerly,
    # one copy forward and one backward a read (msar_block at `small`: about 32 copy kernels a step, 0.67 ms,
    # profile_step_small_graphs_phi_check_h100.md). The same values either way. Timed 2026-12-06 (last session, one
    # H100, one process, plan msar_views): msar_block `small` 39.0-39.1 -> 38.9 ms alone, 38.5 -> 38.5 ms with
    # Msar.params_once (throughput_small_msar_views_h100.md): no gain worth a default, kept off
    cast_partial_in_write: bool = False

    @classmethod
    def validate(cls, cfg, *, d_model: int, n_sublayers: int) -> None:
        super().validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        valid = [1] + [s for s in range(2, n_sublayers + 1, 2) if n_sublayers % s == 0]
        if cfg.block_size not in valid:
            raise ValueError(
                f"residual.block_size={cfg.block_size!r} must be even (blocks end between Transformer blocks) "
                f"and divide n_sublayers={n_sublayers}, or be 1 (full depth attention); "
                f"choose one of: {', '.join(map(str, valid))}")

    @property
    def n_blocks(self) -> int:
        return self.n_sublayers // self.cfg.block_size

    def n_sources(self, consumer: int) -> int:
        if consumer == self.n_sublayers:
            return 1 + self.n_blocks  # b_0 .. b_N
        size = self.cfg.block_size
        return 1 + consumer // size + (consumer % size > 0)  # b_0, completed summaries, partial

    def block_of(self, consumer: int) -> int:
        return consumer // self.cfg.block_size  # the final output is a block of its own

    def initial_state(self, embedding: Tensor, ctx: Context) -> BlockState:
        return BlockState(ctx, (embedding,), None)

    def sources(self, state: BlockState) -> list[Tensor]:
        # the summaries as the buffer stores them (`_stored`); the partial is not buffered (as a read sees it)
        partial = [] if state.partial is None else [self._read_partial(state.partial)]
        return [*map(self._stored, state.summaries), *partial]

    def _read_sources(self, state) -> list[Tensor] | BufferedSources:
        if state.buffer is None:
            return self.sources(state)
        # the partial is not buffered; the read takes it cast by the write when that cast it
        partial = state.partial if state.partial_read is None else state.partial_read
        return BufferedSources(state.buffer, state.summaries, partial)

    def write(self, state, layer: int, out: Tensor):
        if isinstance(state, FusedState):
            return super().write(state, layer, out)  # the two-phase path's write: one eager call
        if state.buffer is not None and not (layer + 1) % self.cfg.block_size:  # b_n written once into the buffer
            row = state.buffer.append(*((out,) if state.partial is None else (state.partial, out)))
            return replace(state, summaries=state.summaries + (row,), partial=None, partial_read=None)
        partial = out if state.partial is None else state.partial + out  # (B, T, d)
        if (layer + 1) % self.cfg.block_size:
            return replace(state, partial=partial, partial_read=self._partial_read(state, partial))
        return BlockState(state.ctx, state.summaries + (partial,), None)  # block complete: b_n

    def _partial_read(self, state: BlockState, partial: Tensor) -> Tensor | None:
        """The open block's partial as a fused read over the buffer takes it (the buffer's dtype), cast here with
        ``cast_partial_in_write``; None where the read takes the partial as it is."""
        if state.buffer is None or not self.cast_partial_in_write or partial.dtype == state.buffer.data.dtype:
            return None
        return partial.to(state.buffer.data.dtype)

    # --- the two-phase path (residuals/attnres.py): phase 1 when a block opens, merge per sublayer ----
    def _group_size(self) -> int:
        return self.cfg.block_size  # the S consumers of a block attend [b_0, ..., b_{n-1}] at once

    def _buffer_rows(self) -> int:
        return self.n_blocks + 1  # b_0 .. b_N

    def _fused_write(self, state: FusedState, layer: int, out: Tensor) -> FusedState:
        if (layer + 1) % self.cfg.block_size:  # block open: the partial sum grows
            if self.sum_in_merge and self._merge_backend(state) != "torch":  # one op sums it, merges it for the next
                return self._merge_sum(state, layer + 1, out)
            partial = out if state.partial is None else state.partial + out  # (B, T, d)
            return replace(state, partial=partial)
        terms = (out,) if state.partial is None else (state.partial, out)
        state.buffer.append(*terms)  # b_n = partial + out, written once into the buffer
        return self._open_group(state, layer + 1)

    def io_per_sublayer(self) -> float:
        """Two-phase computation (docs/method.md §3), reads+writes per sublayer in units of d. Phase 1 reads
        the cached summaries once for the S queries of a block: the paper's N/S. Phase 2, per
        sublayer: read each attention view's phase-1 result, the partial and the new output, write
        the partial (3), then ``retrieval_io``. Block AttnRes: N/S + 5, the paper's (N/S + 5)·d."""
        return self.n_blocks / self.cfg.block_size + self.attention_views() + 3 + self.retrieval_io()


@register("attnres_block")
class AttnResBlock(BlockSummaries, AttnRes):
    """Block AttnRes: AttnRes over [b_0, completed block summaries, partial] (docs/method.md §3)."""

    # phase-1 outputs in bf16 under bf16 autocast, fp32 runs unchanged (``DepthAttentionResidual.phase1_dtype``). H200,
    # one process: `small` 0.866x -> 0.915x vanilla, `medium` 0.894x -> 0.921x (peak 39.19 -> 37.90 GiB); 300 steps,
    # seeds 0-2, eager and compiled, within the fp32 outputs' spread (docs/kernel_attnres.md)
    phase1_dtype = "autocast"

    @dataclass
    class Config(BlockFields, AttnRes.Config):
        """AttnRes's fields plus ``block_size``."""

        # the sources (b_0 and the block summaries) in bf16 under bf16 autocast: one rounding of each as stored, as
        # phase 1's outputs are rounded already; phase 1 then keeps no outputs for its backward (they are no narrower
        # than the sources) and its groups' outputs are freed after their merges. H200, `medium`, one process: peak
        # 37.84 -> 35.61 GiB (1.16x -> 1.09x vanilla's) at 0.936x -> 0.935x vanilla's speed (docs/kernel_attnres.md)
        source_dtype: str = "autocast"
