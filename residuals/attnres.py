"""AttnRes: every sublayer reads a softmax mixture of all earlier sublayer outputs (docs/method.md §3).

Paper: "Attention Residuals", Kimi Team, arXiv 2603.15031.

Sources are v_0 (the token embedding) and every sublayer output v_{i+1} = f_i(h_i) (the output,
not a running sum). Consumer l (sublayer l, and l = L for the final output) owns a pseudo-query
w_l and a key-RMSNorm gain:

    h_l = Σ_{i≤l} softmax_i( w_l · RMSNorm_l(v_i) ) · v_i          (fp32 softmax, no 1/√d)

w_l is zero at init, so at step 0 every h_l is the plain mean of its sources. The ablation fields:
``key_norm`` (raw keys), ``heads`` (channel-split multi-head depth attention, the paper's
16-head ablation) and ``query="input"`` (q_l = w_l + W_l·RMSNorm(latest source), W_l zero-init).

Backends (``residual.backend``): the fused op (``kernels/depth_attn``, docs/kernel_attnres.md) covers
static queries and ``heads=1``, key RMSNorm on or off. It runs the two-phase schedule of the paper:
the consumers of a group (AttnRes: the two sublayers of a Transformer block; Block AttnRes: the S
sublayers of a block) attend every completed source in one batched pass when the group opens
(phase 1, in ``write``), and a consumer with a newer source (AttnRes: the group's first output;
Block AttnRes: the block's partial sum) folds it in by an online-softmax merge (phase 2, in
``read``; Block AttnRes's in the ``write`` that grows the partial, which the same op sums). Sources are written
once into a preallocated buffer and never re-stacked.

This file also holds what the depth-attention variants share (attnres_block, msar, msar_block
build on it): :class:`DepthAttentionResidual` (sources, consumers, recording, accounting, and the
two-phase path behind the hooks ``_two_phase`` and ``_after_read``, which MSAR's ``placement=post``
uses too),
:class:`PseudoQueries` (per consumer and view: w, key gain, optional input projection) and
:class:`DepthAttentionConfig` (the fields they all have).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from kernels.depth_attn import (SourceBuffer, depth_attn, depth_attn_merge, depth_attn_summaries, fold_key_gains,
                                summaries_keep_outputs)
from kernels.msar_attn import BufferedSources

from .base import Context, Residual, ResidualConfig, check_choice, rms_norm, stored_dtype
from .registry import register

QUERY_KINDS = ("static", "input")
# residual.source_dtype (every depth-attention residual): how the completed sources are stored; "stream": the residual
# stream's dtype (fp32 under mixed precision), "bfloat16": half the bytes of every phase-1 read, "autocast": bfloat16
# while bf16 autocast is on (mixed-precision training), else "stream" (fp32 runs stay fp32)
SOURCE_DTYPES = {"stream": None, "bfloat16": torch.bfloat16}
NARROW_CHOICES = (*SOURCE_DTYPES, "autocast")  # residual.source_dtype and DepthAttentionResidual.phase1_dtype
BACKENDS = ("auto", "torch", "triton")  # auto: the fused op on CUDA tensors, the reference elsewhere


@torch.compiler.disable
def eager(fn, *args):
    """``fn(*args)`` run eagerly under torch.compile: the graph breaks at this call and nothing of ``fn`` is traced.

    For reads and writes whose work is fused ops (each a graph break of its own): traced into, every frame
    between the backbone and such an op (read, _retrieve, the op's checks) was compiled once per consumer, on
    guards of the consumer's index and the number of sources, each a graph of a few small ops (msar_block: 12
    graphs at 4 sublayers, 20 at 12; test_model.py). Under ``trainer.compile_scope=model`` the backbone's loop
    over sublayers holds these breaks, so Dynamo runs that loop eagerly whatever the residual does and compiles
    each sublayer as a frame of its own (docs/gpu.md): an eager read or write loses no fusion with a sublayer.
    """
    return fn(*args)


def _shares_storage(t: Tensor, others) -> bool:
    """Whether ``t`` is a view of the same memory as any of ``others`` (e.g. rows of one stacked tensor)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


def depth_attn_flops(n_sources: int, d: int, *, views: int = 1, heads: int = 1, key_norm: bool = True) -> int:
    """Forward FLOPs per token of one consumer's depth attention over ``n_sources`` sources.

    Per view and source: key RMSNorm 4d (square, sum, scale, gain), logit 2d, softmax ~5 per head
    (max, subtract, exp, sum, divide), weighted sum 2d. The RMSNorm is counted per consumer, as the
    reference computes it; a fused kernel can share it across consumers.
    """
    return views * n_sources * ((4 * d if key_norm else 0) + 4 * d + 5 * heads)


@dataclass
class DepthAttentionConfig(ResidualConfig):
    """Fields every depth-attention variant has."""

    key_norm: bool = True  # RMSNorm the keys (learnable gain, init 1); False: keys are the raw sources
    query: str = "static"  # "static": learned w_l; "input": w_l + W_l·RMSNorm(latest source), W_l zero-init
    backend: str = "auto"  # "torch" (reference), "triton" (fused op), "auto" (fused on CUDA, reference on CPU)
    # the two-phase path's merge (phase 2): "auto" (backend's op), "torch" (PyTorch ops: under torch.compile traced and
    # compiled in the read's frame; the reads of the fused merge run as one eager call each), "triton" (the fused merge)
    merge_backend: str = "auto"
    # how completed sources are stored (the buffer's dtype): "stream" (the residual stream's dtype, fp32 under mixed
    # precision) | "bfloat16" (half the bytes of every read of them; for AttnRes slower end to end on an H200 because
    # of the casts: docs/kernel_attnres.md) | "autocast" ("bfloat16" under bf16 autocast, else "stream"; the default of
    # Block AttnRes, MSAR and Block MSAR). The reference path rounds its sources alike. MSAR's fused read also reads
    # the open block's partial in the buffer's dtype, so there the partial is rounded too (and kept for backward in
    # it): docs/kernel_msar.md
    source_dtype: str = "stream"


@dataclass(frozen=True)
class FusedState:
    """Between sublayers on the two-phase path (AttnRes, Block AttnRes, MSAR's placement=post):
    sources in one buffer, and the phase-1 result of the consumers of the current group."""

    ctx: Context
    buffer: SourceBuffer  # completed sources (AttnRes: v_0..v_l; Block AttnRes: b_0..b_{n-1}), (n_max, B, T, d)
    first: int  # the group's first consumer; consumer c reads outs[c - first], lses[c - first]
    outs: tuple[Tensor, ...]  # phase 1, per consumer of the group: normalised output (B, T, d)
    lses: tuple[Tensor, ...]  # phase 1, per consumer: log-sum-exp over the buffered sources (B, T) fp32
    partial: Tensor | None  # the one source not in the buffer pass (merged by phase 2), (B, T, d)
    weights: Tensor | None = None  # phase-1 weights (C, n, B, T) when ctx.record
    backend: str = "triton"  # of the phase-1 and merge ops ("auto": their own dispatch)
    dtype: torch.dtype = torch.float32  # the stream's (the embedding's): what a read returns, whatever the buffer's
    # every consumer's static query with its key gain folded in, q ⊙ g (q·(g ⊙ n) = (q ⊙ g)·n), fp32: one product for
    # all consumers per forward, split per group ((C, d), phase 1's) and per consumer ((d,) views of the group's, its
    # merge's) by views. Per call instead (a product forward, two backward, a stack of each per phase 1) or indexed
    # from the parameters (each read's backward a full-size zero-filled gradient, summed L+1 times), a step launched
    # about 100 small kernels more
    queries: tuple[Tensor, ...] = ()
    groups: tuple[Tensor | None, ...] = ()  # per consumer: its group's (C, d) folded queries if it opens a group
    # the next consumer's h, when the write that summed its partial also merged it (Block AttnRes: ``merge_sum``)
    merged: Tensor | None = None
    # phase 1 keeps ``outs`` for its backward (narrow outputs, ``summaries_keep_outputs``): a merge keeps its o then,
    # not its h (no tensor more; h is freed once its sublayer is done with it)
    outs_kept: bool = False


@dataclass(frozen=True)
class SourceState:
    """Between sublayers of full depth attention: every source so far."""

    ctx: Context
    sources: tuple[Tensor, ...]  # (v_0 = embedding, v_1, ..., v_l), each (B, T, d)
    # with a fused one-pass read (MSAR: ``_buffers_sources``) the sources are rows of one buffer, read in place
    buffer: SourceBuffer | None = None


class PseudoQueries(nn.Module):
    """Per consumer and view: pseudo-query w (zero-init), key-RMSNorm gain (init 1) and, for
    ``query="input"``, a zero-init projection W so that q = w + W·RMSNorm(latest source)."""

    def __init__(self, n_consumers: int, n_views: int, d: int, *, key_norm: bool, query: str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_consumers, n_views, d))  # w: zero -> plain mean at init
        self.key_gain = nn.Parameter(torch.ones(n_consumers, n_views, d)) if key_norm else None
        self.proj = nn.Parameter(torch.zeros(n_consumers, n_views, d, d)) if query == "input" else None

    def forward(self, consumer: int, latest: Tensor) -> Tensor:
        """Queries of one consumer: (V, d), or (V, B, T, d) when input-dependent."""
        w = self.weight[consumer]  # (V, d)
        if self.proj is None:
            return w
        x = rms_norm(latest).to(w.dtype)  # (B, T, d)
        return w[:, None, None, :] + torch.einsum("btd,ved->vbte", x, self.proj[consumer])

    def gain(self, consumer: int) -> Tensor | None:
        return None if self.key_gain is None else self.key_gain[consumer]  # (V, d)

    def flops(self) -> int:
        """Per consumer and token: RMSNorm of the latest source, then W·x + w per view."""
        n_views, d = self.weight.shape[1:]
        return 0 if self.proj is None else 3 * d + n_views * (2 * d * d + d)


class DepthAttentionResidual(Residual):
    """What the depth-attention variants share: the protocol over a list of sources, recording
    of the softmax weights, and accounting. Consumer l < L is sublayer l; consumer L is the final
    output. Subclasses implement ``_retrieve`` and the cost hooks; ``attnres_block.BlockSummaries``
    replaces the full source list with block summaries.
    """

    # the dtype of phase 1's outputs on the two-phase path: "stream" keeps them in the sources' dtype; "bfloat16" halves
    # the bytes of each output (written by phase 1, read by its merge) and of its gradient (written by the merge's
    # backward, read by phase 1's), at one rounding of the output before its merge, and under autocast the merged h
    # reaches the sublayer as the merge made it (``_sublayer_input``); "autocast": "bfloat16" while bf16 autocast is
    # on (mixed-precision training, where the sublayer reads its input through bf16 matmuls anyway), else "stream".
    # A setting of the code, not a config field (the reference path attends over all sources at once and has no
    # phase-1 output to round). "stream" here: full AttnRes is slower with bf16 outputs (its every read merges a
    # buffered row); Block AttnRes's default is "autocast" (docs/kernel_attnres.md).
    phase1_dtype = "stream"
    # where phase 1 keeps its outputs for its backward (``summaries_keep_outputs``), its merges keep the output they
    # read instead of their own h: the same bytes, held anyway, and h is freed once its sublayer is done with it (an
    # eager sublayer keeps an fp32 copy of its input; a compiled one keeps h itself, so there it saves nothing). A setting of the code, so that a benchmark row can
    # hold the merges' h as before (``py:residuals.attnres.DepthAttentionResidual.merges_keep_outputs=False``)
    merges_keep_outputs = True

    def __init__(self, cfg: ResidualConfig, d_model: int, n_sublayers: int):
        super().__init__(cfg, d_model, n_sublayers)
        type(self).validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        self.n_consumers = n_sublayers + 1

    @classmethod
    def validate(cls, cfg: DepthAttentionConfig, *, d_model: int, n_sublayers: int) -> None:
        super().validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        check_choice(cls.name, "query", cfg.query, QUERY_KINDS)
        check_choice(cls.name, "backend", cfg.backend, BACKENDS)
        check_choice(cls.name, "merge_backend", cfg.merge_backend, BACKENDS)
        check_choice(cls.name, "source_dtype", cfg.source_dtype, NARROW_CHOICES)
        if cls.phase1_dtype not in NARROW_CHOICES:  # a setting of the code: checked once, where the config is
            raise ValueError(f"{cls.__name__}.phase1_dtype={cls.phase1_dtype!r}: choose one of "
                             + ", ".join(map(repr, NARROW_CHOICES)))

    @staticmethod
    def covered(cfg: DepthAttentionConfig) -> bool:
        """Whether a fused op computes this configuration (subclasses with one override this; their
        ``validate`` refuses ``backend=triton`` where it is false)."""
        return False

    def fused_covers(self) -> bool:
        return self.covered(self.cfg)

    def _fused(self, x: Tensor) -> bool:
        """Explicit dispatch: "triton" always (validated), "auto" on CUDA where the fused op covers
        the configuration, "torch" never."""
        return self.cfg.backend == "triton" or (self.cfg.backend == "auto" and x.is_cuda and self.fused_covers())

    def checkpoint_read_pays(self, x: Tensor) -> bool:
        return not self._fused(x)  # a fused read stores no views or stacked sources: nothing to save

    def _two_phase(self, x: Tensor) -> str | None:
        """The backend of the two-phase read path (one query per consumer over a source buffer:
        ``FusedState``, begin/read/write/end below), or None for the list-of-sources path
        (``_retrieve``). Subclasses with a depth attention of one query per consumer say when."""
        return None

    def _after_read(self, h: Tensor, consumer: int, ctx: Context) -> Tensor:
        """On the two-phase path, what the consumer reads given the depth attention's h (B, T, d)."""
        return h

    # --- which sources each consumer sees: here every one (full depth attention) ---------------
    def n_sources(self, consumer: int) -> int:
        return consumer + 1  # v_0 .. v_consumer

    def block_of(self, consumer: int) -> int:
        """The block a consumer belongs to (where per-block parameters live): here a Transformer
        block, i.e. an attention + MLP pair; the final output is a block of its own."""
        return consumer // 2

    def initial_state(self, embedding: Tensor, ctx: Context) -> SourceState:
        return SourceState(ctx, (embedding,))

    def sources(self, state: SourceState) -> list[Tensor]:
        return [self._stored(s) for s in state.sources]

    def _stored(self, source: Tensor) -> Tensor:
        """A completed source as the buffer holds it (the list-of-sources path reads this, so both paths see the
        same sources): rounded to ``residual.source_dtype``'s dtype and back to the stream's."""
        dtype = self._source_dtype(source.device.type)
        return source if dtype is None else source.to(dtype).to(source.dtype)

    def _read_partial(self, partial: Tensor) -> Tensor:
        """The open block's partial as a read sees it (Block variants): as it is; MSAR's fused read takes it in the
        buffer's dtype, so MSAR rounds it as ``_stored`` does."""
        return partial

    def _source_dtype(self, device: str) -> torch.dtype | None:
        """The buffer's dtype on ``device`` now (None: the embedding's, the stream's): ``residual.source_dtype``."""
        return stored_dtype(self.cfg.source_dtype, SOURCE_DTYPES, device)

    # --- the protocol --------------------------------------------------------------------------
    def begin(self, embedding: Tensor, ctx: Context):
        if ctx.record:
            self.recorded = {}
        backend = self._two_phase(embedding)
        if backend is None and not self._buffers_sources(embedding):
            return self.initial_state(embedding, ctx)
        # the sources in one buffer: the two-phase path's, or the one a fused one-pass read takes in place
        buffer = SourceBuffer(self._buffer_rows(), embedding, dtype=self._source_dtype(embedding.device.type))
        v0 = buffer.append(embedding)  # v_0 = b_0
        if backend is None:
            return replace(self.initial_state(v0, ctx), buffer=buffer)
        queries, groups = self._folded_queries()
        state = FusedState(ctx, buffer, 0, (), (), None, None, backend, embedding.dtype, queries, groups)
        return self._open_group(state, 0)

    def read(self, state, layer: int) -> Tensor:
        if isinstance(state, FusedState):
            if self._merge_backend(state) == "torch":  # PyTorch ops: traced, compiled with what is around them
                return self._fused_read(state, layer)
            return eager(self._fused_read, state, layer)  # a fused op between graph breaks: one eager call
        if state.buffer is not None:  # a fused one-pass read (MSAR): one eager call
            return eager(self._source_read, state, layer)
        return self._source_read(state, layer)

    def write(self, state, layer: int, out: Tensor):
        if isinstance(state, FusedState):  # a partial sum, or at a group's end the buffer's store and phase 1
            return eager(self._fused_write, state, layer, out)
        if state.buffer is not None:  # written once into the buffer's next row
            return replace(state, sources=state.sources + (state.buffer.append(out),))
        return SourceState(state.ctx, state.sources + (out,))

    def end(self, state) -> Tensor:
        return self.read(state, self.n_sublayers)

    # --- a one-pass read over buffered sources (MSAR's fused read) -------------------------------------
    def _buffers_sources(self, x: Tensor) -> bool:
        """Whether the sources go into one ``SourceBuffer`` (outside the two-phase path): for a fused read
        that takes them in place (``BufferedSources``) instead of a stacked copy per read. None here."""
        return False

    def _source_read(self, state, consumer: int) -> Tensor:
        """The read over a list of sources (or, with a buffer, the fused one-pass read over them)."""
        return self._retrieve(self._read_sources(state), consumer, state.ctx)

    def _read_sources(self, state) -> list[Tensor] | BufferedSources:
        """What a read attends over: ``sources``, or with a buffer the same S tensors as ``BufferedSources``
        (here every source is a row of the buffer; the block variants add the open block's partial)."""
        if state.buffer is None:
            return self.sources(state)
        return BufferedSources(state.buffer, state.sources)

    # --- the two-phase path over a source buffer (docs/method.md §3) ---------------------------------
    def _group_size(self) -> int:
        """Consumers that share a phase-1 pass: the two sublayers of a Transformer block."""
        return 2

    def _buffer_rows(self) -> int:
        return self.n_sublayers + 1  # v_0 .. v_L

    def _group_bounds(self) -> list[tuple[int, int]]:
        """(first, last) consumers of every phase-1 group, in order; the final output is a group of its own."""
        size, L = self._group_size(), self.n_sublayers
        return [(first, min(first + size, L)) for first in range(0, L, size)] + [(L, L + 1)]

    def _folded_queries(self) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
        """Every consumer's q ⊙ g in fp32 (q alone for raw keys) from one product: per consumer a (d,) view, and at
        each group's first consumer the group's (C, d) view (``FusedState.queries``, ``groups``)."""
        gain = self.queries.key_gain
        folded = fold_key_gains(self.queries.weight[:, 0], None if gain is None else gain[:, 0])  # (L+1, d)
        bounds = self._group_bounds()
        groups: list[Tensor | None] = [None] * self.n_consumers
        queries: list[Tensor] = []
        for (first, last), group in zip(bounds, folded.split([last - first for first, last in bounds])):
            groups[first] = group  # (C, d) contiguous
            queries += group.unbind(0)  # C of (d,)
        return tuple(queries), tuple(groups)

    def _open_group(self, state: FusedState, first: int) -> FusedState:
        """Phase 1 for consumers first .. first+C-1 (the final output is a group of its own). The queries come with
        their key gains folded in (``_folded_queries``): the ops take them with no gain of their own."""
        group = state.groups[first]  # (C, d)
        out_dtype = self._phase1_out_dtype(state.buffer.data.device.type)
        res = depth_attn_summaries(state.buffer, group, None, key_norm=self.cfg.key_norm, return_weights=state.ctx.record,
                                   out_dtype=out_dtype, backend=state.backend)
        kept = self.merges_keep_outputs and summaries_keep_outputs(state.buffer, group.shape[0], out_dtype,
                                                                   backend=state.backend)
        return replace(state, first=first, outs=res[0], lses=res[1], partial=None, merged=None,
                       weights=res[2] if state.ctx.record else None, outs_kept=kept)

    def _fused_read(self, state: FusedState, consumer: int) -> Tensor:
        if state.merged is not None:  # merged by the write that summed the partial (`_merge_sum`)
            return self._after_read(self._sublayer_input(state.merged, state), consumer, state.ctx)
        c = consumer - state.first
        out = state.outs[c]  # (B, T, d): attention over the buffered sources
        if state.partial is None:
            if state.ctx.record:
                self._record(state.ctx, consumer, state.weights[c][None])
            h = self._sublayer_input(out, state)  # narrow under autocast: as it is; else in the stream's dtype
            if h is out and not state.outs_kept and _shares_storage(out, state.outs[1:]):
                # a view of the group's phase-1 outputs (C, B, T, d): the consumer's sublayer keeps its input for
                # backward and would keep all C with it, which nothing else needs (the merges keep their output, and
                # phase 1 keeps its outputs only when they are narrower than the sources: ``outs_kept``). The fused
                # phase 1 writes this output to a tensor of its own (``summaries_fwd(first_apart=True)``): no copy.
                h = out.clone()
            return self._after_read(h, consumer, state.ctx)
        h, w = depth_attn_merge(out, state.lses[c], state.partial, state.queries[consumer], None,
                                key_norm=self.cfg.key_norm, keep_out=state.outs_kept, backend=self._merge_backend(state))
        self._record_merge(state, consumer, w)
        return self._after_read(self._sublayer_input(h, state), consumer, state.ctx)

    def _sublayer_input(self, h: Tensor, state: FusedState) -> Tensor:
        """h in the stream's dtype; with narrow phase-1 outputs under autocast, h as it comes, bf16 where the merged
        terms are (cast here it would be one more kernel forward and one backward between the graph breaks of a read,
        where the sublayer's compiled norm reads it in fp32 anyway and autocast rounds what follows). Timed on an H200
        (docs/kernel_attnres.md): without this, the casts cost more than the narrow outputs saved."""
        device = h.device.type
        if self._phase1_out_dtype(device) is not None and torch.is_autocast_enabled(device):
            return h
        return h.to(state.dtype)

    def _phase1_out_dtype(self, device: str) -> torch.dtype | None:
        """The phase-1 outputs' dtype per ``phase1_dtype`` (None: the sources' dtype)."""
        return stored_dtype(self.phase1_dtype, SOURCE_DTYPES, device)

    def _merge_sum(self, state: FusedState, consumer: int, new: Tensor) -> FusedState:
        """The partial grows by ``new`` (B, T, d) and ``consumer`` merges it, in one op (``depth_attn_merge(new=...)``):
        the sum is not a separate add forward, nor an autograd sum of gradients backward. The consumer's h waits in
        ``merged`` for its read."""
        c = consumer - state.first
        h, w, partial = depth_attn_merge(state.outs[c], state.lses[c], state.partial, state.queries[consumer], None,
                                         new=new, key_norm=self.cfg.key_norm, keep_out=state.outs_kept,
                                         backend=self._merge_backend(state))
        self._record_merge(state, consumer, w)
        return replace(state, partial=partial, merged=h)

    def _record_merge(self, state: FusedState, consumer: int, w: Tensor) -> None:
        """Sources [buffered..., partial]: the phase-1 weights rescaled by (1 - w), then the partial's w (B, T)."""
        if state.ctx.record:
            w = w.detach()
            c = consumer - state.first
            self._record(state.ctx, consumer, torch.cat([state.weights[c] * (1 - w), w[None]])[None])

    def _merge_backend(self, state: FusedState) -> str:
        return state.backend if self.cfg.merge_backend == "auto" else self.cfg.merge_backend

    def _fused_write(self, state: FusedState, layer: int, out: Tensor) -> FusedState:
        """Every output is a source. The first output of a group is the second consumer's partial
        (merged by phase 2); after the group's last sublayer the next group opens."""
        row = state.buffer.append(out)  # v_{layer+1}
        if layer + 1 - state.first < self._group_size() and layer + 1 < self.n_sublayers:
            return replace(state, partial=row)
        return self._open_group(state, layer + 1)

    def _retrieve(self, sources: list[Tensor], consumer: int, ctx: Context) -> Tensor:
        """h for ``consumer`` from its sources (each (B, T, d)); returns (B, T, d)."""
        raise NotImplementedError

    def _record(self, ctx: Context, consumer: int, weights: Tensor) -> None:
        """Keep weights (V, S, B, T), averaged over batch and tokens, as column ``consumer`` of
        ``recorded["view{j}"]`` (sources x consumers; zero where a source does not exist)."""
        if not ctx.record:
            return
        shape = (self.n_sources(self.n_sublayers), self.n_consumers)
        for j, w in enumerate(weights.detach().float().mean(dim=(-2, -1))):  # (S,)
            table = self.recorded.setdefault(f"view{j}", torch.zeros(shape, device=w.device))
            table[: w.shape[0], consumer] = w

    # --- accounting ------------------------------------------------------------------------------
    def consumer_flops(self, n_sources: int) -> int:
        """Forward FLOPs per token of one consumer that attends over ``n_sources`` sources."""
        raise NotImplementedError

    def attention_views(self) -> int:
        """Depth-attention results per consumer, each (B, T, d)."""
        return 1

    def retrieval_io(self) -> float:
        """Reads+writes (units of d) per consumer after the depth attention: writing h for AttnRes."""
        return 1.0

    def extra_flops_per_token(self) -> float:
        """Sum of ``consumer_flops`` over the L+1 consumers. The block variants' partial sums stand in
        for vanilla's additions and are not counted; the full variants do not subtract vanilla's
        L·d additions (small next to full AttnRes's ~4(L+1)(L+2)·d)."""
        return float(sum(self.consumer_flops(self.n_sources(c)) for c in range(self.n_consumers)))

    def state_per_token(self) -> float:
        """Single-stream (B, T, d) tensors held between sublayers at the deepest point (the final
        output), in units of d: every source (L+1) here, b_0 + summaries + partial (N+1) for the
        block variants; views are never stored. This counts storage. The paper's I/O figures (5.5d
        for Block AttnRes, 21.5d for MSAR) count reads+writes per sublayer: see io_per_sublayer."""
        return float(self.n_sources(self.n_sublayers))

    def io_per_sublayer(self) -> float:
        """Paper-style reads+writes per sublayer in units of d, averaged over the L sublayers.
        Full depth attention in one pass: read every source, then ``retrieval_io``."""
        reads = sum(self.n_sources(layer) for layer in range(self.n_sublayers)) / self.n_sublayers
        return reads + self.retrieval_io()


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(..., d) -> (heads, ..., d / heads): channel groups become depth-attention views."""
    return x.unflatten(-1, (heads, -1)).movedim(-2, 0)


def merge_heads(x: Tensor) -> Tensor:
    """(heads, ..., d / heads) -> (..., d)."""
    return x.movedim(0, -2).flatten(-2)


@register("attnres")
class AttnRes(DepthAttentionResidual):
    """Full AttnRes: one depth attention per consumer over all L+1 sources (docs/method.md §3)."""

    @dataclass
    class Config(DepthAttentionConfig):
        heads: int = 1  # channel-split heads, each over d/heads channels with its query slice and own key RMSNorm

    @classmethod
    def validate(cls, cfg: Config, *, d_model: int, n_sublayers: int) -> None:
        super().validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        if not (isinstance(cfg.heads, int) and cfg.heads >= 1 and d_model % cfg.heads == 0):
            divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
            raise ValueError(f"residual.heads={cfg.heads!r} must divide d_model={d_model} (channel-split heads); "
                             f"choose one of: {', '.join(map(str, divisors))}")
        if cfg.backend == "triton" and not cls.covered(cfg):
            raise ValueError(f"residual.backend={cfg.backend!r}: the fused depth attention computes one head with "
                             f"static queries; it needs heads=1, query=static (got heads={cfg.heads!r}, "
                             f"query={cfg.query!r}); use residual.backend=torch or auto")

    def __init__(self, cfg: Config, d_model: int, n_sublayers: int):
        super().__init__(cfg, d_model, n_sublayers)
        self.queries = PseudoQueries(self.n_consumers, 1, d_model, key_norm=cfg.key_norm, query=cfg.query)

    # --- backend dispatch ------------------------------------------------------------------------
    @staticmethod
    def covered(cfg: Config) -> bool:
        """Whether the fused op computes this configuration (one head, static queries)."""
        return cfg.heads == 1 and cfg.query == "static"

    def _two_phase(self, x: Tensor) -> str | None:
        return "triton" if self._fused(x) else None  # the fused path: the two-phase schedule

    def _retrieve(self, sources: list[Tensor], consumer: int, ctx: Context) -> Tensor:
        heads = self.cfg.heads
        query = self.queries(consumer, latest=sources[-1])[0]  # (d,) or (B, T, d)
        gain = self.queries.gain(consumer)  # (1, d) or None
        out, weights = depth_attn(
            split_heads(torch.stack(sources), heads),  # (H, S, B, T, d/H)
            split_heads(query, heads),  # (H, d/H) or (H, B, T, d/H)
            None if gain is None else split_heads(gain[0], heads),  # (H, d/H)
            key_norm=self.cfg.key_norm,
            return_weights=True,
            backend="torch",  # the reference path: the fused path is begin/read/write's FusedState
        )  # out (H, B, T, d/H), weights (H, S, B, T)
        self._record(ctx, consumer, weights)
        return merge_heads(out)  # (B, T, d)

    def consumer_flops(self, n_sources: int) -> int:
        cost = depth_attn_flops(n_sources, self.d_model, heads=self.cfg.heads, key_norm=self.cfg.key_norm)
        return cost + self.queries.flops()
