"""MSAR: multi-stream depth attention, each stream over its own token-axis view of the sources.

Paper: "Multi-Stream Attention Residuals" (preprint). Only reviews of it are available, so this is
the reconstruction of docs/method.md §4; every choice it leaves open is a field of ``Config``.

View expansion, views j = 0..m-1 (view 0 the identity, m = 1 + len(kernels)):

    E_j(v)[t] = Σ_{τ<k_j} c_τ^{(j)} ⊙ v[t-τ]     causal depthwise conv, reset at document boundaries

Per view, an AttnRes depth attention (own zero-init query and key-RMSNorm gain per consumer):

    r^{(j)} = Σ_i softmax_i( w^{(j)} · RMSNorm(E_j(v_i)) ) · E_j(v_i)

Fusion, mHC's H^pre over the m streams: R = [r^{(0)}; ...; r^{(m-1)}] ∈ R^{m×d},
g = σ(α·RMSNorm(vec R)·φ + b) ∈ R^m, h = Σ_j g_j r^{(j)}, with φ = 0, α = 0.01, b = logit(1/m) at
init, so g = 1/m. Only single-stream sources are stored; views are made on demand from them, per
consumer (E_j is linear, so expanding a block summary is exact: ``msar_block``).

The controls and ablations are fields: ``view="identity"`` (m queries over identical sources:
wo_conv), ``view="scalar"`` (views β_ij·v_i, H^post-style write-back: hpost_streams, whose keys are
identical after RMSNorm since β > 0), ``expand_values=False`` (expanded keys, identity values),
``placement="post"`` (one AttnRes h, then h = Σ_j g_j E_j(h): token mixing without streams).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from kernels.causal_conv import causal_conv
from kernels.depth_attn import depth_attn
from kernels.msar_attn import FUSIONS, MAX_K, BufferedSources
from kernels.msar_attn import msar as msar_fused
from kernels.msar_attn import pack_reads
from kernels.msar_attn.reference import mix

from .attnres import (DepthAttentionConfig, DepthAttentionResidual, PseudoQueries, check_choice, depth_attn_flops,
                      eager)
from .base import Context
from .registry import register

VIEWS = ("conv", "identity", "scalar")
TAPS = ("per_sublayer", "per_block", "shared")
CONV_INITS = ("box", "dirac")
PLACEMENTS = ("streams", "post")


class ConsumerParams(NamedTuple):
    """One consumer's parameters as the fused read takes them: views of the parameters (Msar._consumer_params)."""

    query: Tensor  # (V, d)
    gain: Tensor | None  # (V, d) key-RMSNorm gain, None without key_norm
    taps: tuple[Tensor, ...] | None  # m-1 of (k_j, d) for conv views; None: the read takes ``Msar._view_taps``
    phi: Tensor  # (m·d, m)
    alpha: Tensor  # ()
    bias: Tensor  # (m,)
    packed: object = None  # the read's ``Packed`` (kernels.msar_attn.pack_reads) with ``Msar.pack_step``, else None


@register("msar")
class Msar(DepthAttentionResidual):
    """MSAR over every source (full depth attention, L+1 single-stream sources). With
    ``taps="per_block"`` the consumers of a Transformer block share taps (in msar_block: of a block)."""

    @dataclass
    class Config(DepthAttentionConfig):
        kernels: list[int] = field(default_factory=lambda: [4, 8, 12])  # k_j of views 1..m-1; m = 1 + len
        view: str = "conv"  # "conv": E_j = causal conv; "identity": E_j = id (wo_conv); "scalar": β_ij·v_i
        expand_values: bool = True  # False: keys from the views, values the plain sources
        taps: str = "per_sublayer"  # conv taps per consumer, "per_block" (see block_of), or "shared"
        # "dirac": c_0 = 1, the rest 0 (+ noise), so every view starts as the identity; "box": c_τ = 1/k_j
        # (causal mean). Box made 2 of 3 seeds end worse than vanilla on the H200 (small, 300 steps):
        # see the README's conv-init note and the conv_box ablation.
        conv_init: str = "dirac"
        conv_init_noise: float = 0.01  # std of Gaussian noise added to Dirac taps (breaks the views' symmetry)
        fusion: str = "sigmoid"  # g = σ(α·RMSNorm(vec R)·φ + b), or "softmax" over the m streams
        placement: str = "streams"  # "streams": m depth attentions; "post": one, then Σ_j g_j E_j(h)
        # the fused read keeps no streams R (m, B, T, d) for its mixer's backward and rebuilds them there, one more
        # pass over the sources a read: 2·m·d bytes a token and consumer less (bf16 under bf16-mixed), more time.
        # Fused backend only (backend=torch: recompute its reads with model.checkpoint_reads instead)
        recompute_streams: bool = False
        # the sources' buffer (and the open block's partial, for msar_block) in bf16 under bf16 autocast; the default
        # since 2026-12-05. Full msar on an H100, `medium`, one process (throughput_medium_msar_full_sources_h100.md):
        # 842.8 -> 741.1 ms a step (0.204x -> 0.232x vanilla's), peak 54.13 -> 47.88 GiB; 60 training steps at `small`,
        # seeds 0 and 1, within the run-to-run spread of fp32 sources (worst gap 0.0020 against 0.0576,
        # backend_training_small_msar_bf16_sources_h100.md). Block MSAR's, on an H200: docs/kernel_msar.md
        source_dtype: str = "autocast"

    @classmethod
    def validate(cls, cfg: Config, *, d_model: int, n_sublayers: int) -> None:
        super().validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        for name, choices in (("view", VIEWS), ("taps", TAPS), ("conv_init", CONV_INITS),
                              ("fusion", FUSIONS), ("placement", PLACEMENTS)):
            check_choice(cls.name, name, getattr(cfg, name), choices)
        kernels = list(cfg.kernels)
        if not kernels:
            raise ValueError("residual.kernels=[] leaves one view (m = 1 + len(kernels)) and makes "
                             "b = logit(1/m) infinite; give kernel sizes >= 2, or use residual=attnres")
        if any(not isinstance(k, int) or k < 2 for k in kernels) or len(set(kernels)) != len(kernels):
            raise ValueError(f"residual.kernels={kernels} must be distinct integers >= 2 "
                             f"(view 0 is already the identity, k = 1)")
        if not cfg.conv_init_noise >= 0:
            raise ValueError(f"residual.conv_init_noise={cfg.conv_init_noise!r} must be >= 0")
        if cfg.backend == "triton" and not cls.covered(cfg):
            raise ValueError(f"residual.backend={cfg.backend!r}: the fused kernel computes conv (or identity) views "
                             "attended as keys and values with static queries; it needs view=conv or identity, "
                             f"placement=streams, expand_values=true, query=static and kernels <= {MAX_K} "
                             f"(got view={cfg.view!r}, placement={cfg.placement!r}, "
                             f"expand_values={cfg.expand_values!r}, query={cfg.query!r}, "
                             f"kernels={list(cfg.kernels)}); use residual.backend=torch or auto")
        if cfg.recompute_streams and (cfg.backend == "torch" or not cls.covered(cfg)):
            raise ValueError(f"residual.recompute_streams=true: applies only to the fused read (residual.backend="
                             f"triton, or auto on a GPU, with a configuration the fused op covers), got "
                             f"backend={cfg.backend!r}, view={cfg.view!r}, placement={cfg.placement!r}; the reference "
                             "read recomputes with model.checkpoint_reads=true")
        if cfg.placement == "post" and (cfg.view != "conv" or not cfg.expand_values):
            raise ValueError(f"residual.placement='post' applies the convs to h once: it needs residual.view=conv "
                             f"and residual.expand_values=true, got view={cfg.view!r}, "
                             f"expand_values={cfg.expand_values!r}")

    # the fused read's per-consumer parameters (the query, the key gain, the taps, φ, α, b) as views made once a
    # forward by one unbind of each parameter (``Context.params``), instead of indexed by each read: a read's backward
    # then makes no whole-parameter gradient of zeros with its slice copied in, summed into the parameter's (8 of each a
    # read, about 14 fills, 14 copies and the adds a read at `small`, profile_step_small_graphs_phi_check_h100.md);
    # each parameter's one unbind stacks its consumers' gradients once a step. The same values. One H100, one process
    # (plan msar_views, throughput_small_msar_views_h100.md): msar_block `small` 39.0-39.1 -> 38.5 ms (0.455x ->
    # 0.462x vanilla's); `medium` 368.1 -> 367.3 ms (throughput_medium_views_medium_h100.md; its peaks 44.27 against
    # 45.52 GiB are the rows' order, as in the night's table: the first row after vanilla reads lower)
    params_once: bool = True
    # with params_once, conv views: every fused read's packed taps, folded queries, φᵀ and the step's document window
    # made once a step for every consumer (``pack_reads``, a few kernels a step at ``begin``) instead of by each read
    # (about 6 small kernels a read, about 100 a `small` msar_block step: msar_glue_ops_step_pack_step.md); the same
    # values to the bit. H100, one process, alternating (plan glue_next, throughput_small_glue_next_h100.md): msar_block's
    # graphed `small` step 37.9 / 38.0 -> 37.8 / 37.7 ms; its graphed step replays as the eager one there
    # (the graphed-step test of the time, gpu_tests_glue_both_h100.txt). The default since 2026-12-07;
    # False: each read packs its own
    pack_step: bool = True

    def __init__(self, cfg: Config, d_model: int, n_sublayers: int):
        super().__init__(cfg, d_model, n_sublayers)
        m, d, consumers = 1 + len(cfg.kernels), d_model, self.n_consumers
        self.n_views = m
        self.queries = PseudoQueries(consumers, self.attention_views(), d, key_norm=cfg.key_norm, query=cfg.query)
        if cfg.view == "conv":
            groups = {"per_sublayer": consumers, "per_block": self.block_of(n_sublayers) + 1, "shared": 1}[cfg.taps]
            # view j >= 1: taps (groups, k_j, d)
            self.conv_taps = nn.ParameterList(nn.Parameter(self._initial_taps(groups, k, d)) for k in cfg.kernels)
        elif cfg.view == "scalar":
            # β_ij = 2σ(logit) per source position i and view j >= 1, like mHC's H^post: positive, 1 at init
            self.write_back_logits = nn.Parameter(torch.zeros(self.n_sources(n_sublayers), m - 1))
        self.fusion_proj = nn.Parameter(torch.zeros(consumers, m * d, m))  # φ: zero -> g constant at init
        self.fusion_scale = nn.Parameter(torch.full((consumers,), 0.01))  # α
        # b: σ(b) = 1/m, i.e. b = logit(1/m); softmax is 1/m for any constant b
        bias = -math.log(m - 1) if cfg.fusion == "sigmoid" else 0.0
        self.fusion_bias = nn.Parameter(torch.full((consumers, m), bias))

    @staticmethod
    def covered(cfg: Config) -> bool:
        """Whether the fused op computes this configuration: conv views (any taps placement, any
        init; kernel sizes up to MAX_K) or identity views (taps of size 1 equal to one), attended as
        keys and values with static queries, m attention streams, either fusion."""
        return (cfg.view in ("conv", "identity") and cfg.placement == "streams" and cfg.expand_values
                and cfg.query == "static" and (cfg.view == "identity" or max(cfg.kernels) <= MAX_K))

    def _initial_taps(self, groups: int, k: int, d: int) -> Tensor:
        if self.cfg.conv_init == "box":
            return torch.full((groups, k, d), 1.0 / k)  # causal mean over the last k tokens
        taps = torch.zeros(groups, k, d)
        taps[:, 0] = 1.0  # Dirac: E_j = identity
        return taps + self.cfg.conv_init_noise * torch.randn_like(taps)

    def _tap_group(self, consumer: int) -> int:
        return {"per_sublayer": consumer, "per_block": self.block_of(consumer), "shared": 0}[self.cfg.taps]

    def attention_views(self) -> int:
        return self.n_views if self.cfg.placement == "streams" else 1

    # --- the protocol: the fused read's parameters once a forward ---------------------------------
    def begin(self, embedding: Tensor, ctx: Context):
        state = super().begin(embedding, ctx)
        if self.params_once and self._buffers_sources(embedding):  # the fused one-pass read's state (SourceState,
            # BlockState): one eager call, so that the views are made by autograd's unbind (one backward node a
            # parameter), not traced into a compiled graph whose outputs alias the parameters
            state = eager(self._with_consumer_params, state)
        return state

    def _with_consumer_params(self, state):
        params = self._consumer_params()
        if self.pack_step and self.cfg.view == "conv":
            params = self._packed(params, state.ctx.doc_ids)
        return replace(state, ctx=replace(state.ctx, params=params))

    def _packed(self, params: tuple[ConsumerParams, ...], doc_ids: Tensor) -> tuple[ConsumerParams, ...]:
        """``params`` with each consumer's ``Packed`` (``pack_step``): each view's taps stacked by consumer (C, k_j, d),
        shared groups included, then ``pack_reads`` over every consumer at once."""
        with torch.no_grad():
            taps = [torch.stack([p.taps[j] for p in params]) for j in range(self.n_views - 1)]
            packs = pack_reads(taps, self.queries.weight, self.queries.key_gain, self.fusion_proj, self.fusion_scale,
                               self.fusion_bias, doc_ids)
        return tuple(p._replace(packed=k) for p, k in zip(params, packs))

    def _consumer_params(self) -> tuple[ConsumerParams, ...]:
        """Every consumer's ``ConsumerParams`` from one unbind of each parameter (taps: one per group)."""
        n = self.n_consumers
        gain = self.queries.key_gain
        queries, gains = self.queries.weight.unbind(0), (None,) * n if gain is None else gain.unbind(0)
        groups = [taps.unbind(0) for taps in self.conv_taps] if self.cfg.view == "conv" else None
        phis, alphas, biases = (p.unbind(0) for p in (self.fusion_proj, self.fusion_scale, self.fusion_bias))
        return tuple(ConsumerParams(queries[c], gains[c],
                                    None if groups is None else tuple(g[self._tap_group(c)] for g in groups),
                                    phis[c], alphas[c], biases[c]) for c in range(n))

    def _params(self, consumer: int, ctx: Context) -> ConsumerParams:
        """The fused read's parameters of ``consumer``: made once a forward (``params_once``), or sliced here (the taps
        then by ``_view_taps``)."""
        if ctx.params:
            return ctx.params[consumer]
        return ConsumerParams(self.queries.weight[consumer], self.queries.gain(consumer), None,
                              self.fusion_proj[consumer], self.fusion_scale[consumer], self.fusion_bias[consumer])

    # --- the computation -----------------------------------------------------------------------
    def expand(self, x: Tensor, consumer: int, doc_ids: Tensor) -> Tensor:
        """Views E_j(x) of single-stream tensors x (S, B, T, d), as ``consumer`` sees them:
        (m, S, B, T, d). Linear in x, so the views of a block summary are exact."""
        if self.cfg.view == "identity":
            return x.expand(self.n_views, *x.shape)
        if self.cfg.view == "scalar":
            beta = 2 * torch.sigmoid(self.write_back_logits[: x.shape[0]])  # (S, m-1): these source positions
            return torch.stack([x, *(x * b[:, None, None, None] for b in beta.unbind(1))])
        group = self._tap_group(consumer)
        return torch.stack([x, *(causal_conv(x, taps[group], doc_ids) for taps in self.conv_taps)])

    def _buffers_sources(self, x: Tensor) -> bool:
        # the fused read (placement=streams) takes the sources in place from one buffer: no stacked copy of the
        # S sources per read, forward or backward (57 source copies a forward at `small` in msar_block)
        return self.cfg.placement == "streams" and self._fused(x)

    def _retrieve(self, sources: list[Tensor] | BufferedSources, consumer: int, ctx: Context) -> Tensor:
        if self._fused(sources[0]):  # the whole read in one op, mixer included (validated: see covered)
            p = self._params(consumer, ctx)  # static queries (V, d), gains (V, d) or None, taps, φ, α, b
            taps = list(p.taps) if p.taps is not None else self._view_taps(consumer, sources[0])
            # sources in place (BufferedSources: the buffer's rows and the open block's partial), never stacked
            res = msar_fused(sources, taps, p.query, p.gain, ctx.doc_ids, p.phi, p.alpha, p.bias,
                             key_norm=self.cfg.key_norm, fusion=self.cfg.fusion, return_weights=ctx.record,
                             backend="triton", recompute_streams=self.cfg.recompute_streams,
                             packed=p.packed)  # (B, T, d), with the
            # weights (V, S, B, T) when recording
            if not ctx.record:
                return res
            h, weights = res
            self._record(ctx, consumer, weights)
            return h
        queries = self.queries(consumer, latest=sources[-1])  # (V, d) or (V, B, T, d)
        gain = self.queries.gain(consumer)  # (V, d) or None
        x = torch.stack(sources)  # (S, B, T, d)
        if self.cfg.placement == "post":  # the reference (`auto` reads take the two-phase path: _two_phase)
            h, weights = depth_attn(x, queries, gain, key_norm=self.cfg.key_norm, return_weights=True,
                                    backend="torch")  # (1, B, T, d)
            streams = self.expand(h, consumer, ctx.doc_ids)[:, 0]  # (m, B, T, d): E_j(h)
        else:
            views = self.expand(x, consumer, ctx.doc_ids)  # (m, S, B, T, d)
            values, keys = (views, None) if self.cfg.expand_values else (x, views)
            streams, weights = depth_attn(values, queries, gain, key_sources=keys,
                                          key_norm=self.cfg.key_norm, return_weights=True,
                                          backend="torch")  # (m, B, T, d)
        self._record(ctx, consumer, weights)  # weights (V, S, B, T)
        return self._fuse(streams, consumer)

    def _two_phase(self, x: Tensor) -> str | None:
        """placement=post under `auto`: the one depth attention per consumer takes Block AttnRes's
        two-phase path over a source buffer (no stacked sources per read), its ops' own `auto`
        dispatch (fused on CUDA, references on CPU); ``_after_read`` applies the views and the mixer."""
        return "auto" if self.cfg.placement == "post" and self._post_backend() == "auto" else None

    def _after_read(self, h: Tensor, consumer: int, ctx: Context) -> Tensor:
        """placement=post: the m conv views of h and the mixer, as the MSAR op over the one source h
        (every view's softmax weight is 1, so its streams are exactly E_j(h))."""
        zero = self.queries.weight.new_zeros(self.n_views, h.shape[-1])  # (m, d): one source, no choice
        return msar_fused([h], self._view_taps(consumer, h), zero, None, ctx.doc_ids, self.fusion_proj[consumer],
                          self.fusion_scale[consumer], self.fusion_bias[consumer], key_norm=False,
                          fusion=self.cfg.fusion, backend="auto")  # (B, T, d)

    def checkpoint_read_pays(self, x: Tensor) -> bool:
        # the two-phase post read on CUDA runs fused ops that store no views: nothing to recompute
        return super().checkpoint_read_pays(x) and not (x.is_cuda and self._two_phase(x) is not None)

    def _post_backend(self) -> str:
        """The backend of placement=post's read, two ops: Block AttnRes's depth attention (kernels/depth_attn)
        and then the MSAR op over that one source h (kernels/msar_attn: the m conv views of h and the
        mixer; with one source every view's softmax weight is 1). `auto` hands both to their kernels
        (fused on CUDA, their references on CPU) for static queries and kernel sizes the fused op takes;
        `torch` (and per-token queries) keeps the residual's own reference. (`triton` is refused for post by
        validate: the read is two ops, not one.)"""
        ok = self.cfg.query == "static" and max(self.cfg.kernels) <= MAX_K  # (post implies view=conv: validate)
        return "auto" if self.cfg.backend == "auto" and ok else "torch"

    def _fuse(self, streams: Tensor, consumer: int) -> Tensor:
        """h = Σ_j g_j r^{(j)} with g = σ(α·RMSNorm(vec R)·φ + b) (or softmax); fp32 like mHC's φ
        (fp64 for fp64 streams: the kernel reference's mixer, which the fused op is tested against)."""
        return mix(streams, self.fusion_proj[consumer], self.fusion_scale[consumer], self.fusion_bias[consumer],
                   fusion=self.cfg.fusion)

    def _read_partial(self, partial: Tensor) -> Tensor:
        # the fused one-pass read takes the open block's partial through the buffer's address, in its dtype: the
        # reference rounds it alike (placement=post merges it in its own dtype, as Block AttnRes does)
        return self._stored(partial) if self.cfg.placement == "streams" else partial

    def _view_taps(self, consumer: int, x: Tensor) -> list[Tensor]:
        """The m-1 tap tensors (k_j, d) the fused op convolves with: the consumer's conv taps, or for
        identity views taps of size 1 equal to one (Dirac, no parameters)."""
        if self.cfg.view == "identity":
            return [x.new_ones(1, x.shape[-1])] * (self.n_views - 1)
        group = self._tap_group(consumer)
        return [taps[group] for taps in self.conv_taps]

    # --- accounting ------------------------------------------------------------------------------
    def consumer_flops(self, n_sources: int) -> int:
        m, d, cfg = self.n_views, self.d_model, self.cfg
        expanded = n_sources if cfg.placement == "streams" else 1  # tensors expanded per consumer
        per_tensor = {"conv": sum(2 * k * d for k in cfg.kernels), "scalar": (m - 1) * d, "identity": 0}[cfg.view]
        attention = depth_attn_flops(n_sources, d, views=self.attention_views(), key_norm=cfg.key_norm)
        # RMSNorm(vec R) 3md, ·φ 2md·m, α·z + b and σ ~4m, Σ_j g_j r^{(j)} 2md
        fusion = 3 * m * d + 2 * m * d * m + 4 * m + 2 * m * d
        return expanded * per_tensor + attention + fusion + self.queries.flops()

    def retrieval_io(self) -> float:
        """Streams: write the m streams, read them for RMSNorm·φ and again for Σ g r, write h
        (3m + 1). Post: write the attention's h, read it twice (views made on the fly), write h (4)."""
        return 3.0 * self.n_views + 1 if self.cfg.placement == "streams" else 4.0
