"""mHC: Manifold-Constrained Hyper-Connections (DeepSeek-AI, arXiv 2512.24880), docs/method.md §2.

The residual stream is widened to n parallel streams X_l ∈ R^{n×d} per token; the embedding is
copied into all of them. Sublayer l reads a non-negative mix of the streams, and its output is
written back with non-negative weights while the streams are mixed by a doubly stochastic matrix:

    X_{l+1} = H^res_l X_l + H^post_lᵀ f_l(H^pre_l X_l)                                (paper Eq. 3)

The coefficients are computed per token from the flattened streams x = vec(X_l) ∈ R^{nd} (Eq. 7-8):

    x' = RMSNorm(x),  z = x' φ_l ∈ R^{n²+2n}
    H^pre  = σ(α^pre_l · z_pre + b^pre_l)                 (1×n)
    H^post = 2σ(α^post_l · z_post + b^post_l)             (1×n)
    H^res  = Sinkhorn-Knopp(α^res_l · mat(z_res) + b^res_l)   (n×n, Eq. 9)

Everything about the coefficients runs in fp32 with autocast off (fp64 when the streams are fp64,
so that gradcheck means something). The streams are stored in ``stream_dtype``: by default
("autocast") bf16 while bf16 autocast is on (``trainer=gpu``) and the embedding's dtype otherwise (fp32
runs stay fp32); "input" keeps the embedding's dtype (fp32 under autocast) everywhere. bf16 halves the
streams' bytes and memory (each write then rounds X_{l+1}, and their gradients, to bf16; all mixing
arithmetic stays fp32, and ``end`` sums the streams in fp32), and trains as fp32 streams do
(docs/kernel_mhc.md).

Initialisation (not fixed by the paper; every choice is a config field):

- α = 0.01 (paper Table 5). b^pre = logit(1/n), so the n read weights sum to 1 and, with identical
  streams, h_l is exactly the single-stream residual. b^post = 0, so H^post = 1 (each stream gets the
  whole output, as in a plain residual). b^res = c·I.
- With φ = 0 and these symmetric biases the model is exactly invariant under permuting the streams,
  and gradient descent preserves that symmetry: every stream stays equal to the plain residual stream
  forever and mHC degenerates to a gated single-stream residual (tests/residuals/test_mhc.py shows it).
  Hence the default φ is small and random (``phi_init_std``), which breaks the symmetry while
  leaving step 0 within ~α·phi_init_std (1%) of the plain residual.
- c (``b_res_diag``) sets how much H^res mixes the streams at step 0: with φ ≈ 0,
  H^res = (e^c I + (J − I)) / (e^c + n − 1), which shrinks any difference between streams by
  λ = (e^c − 1)/(e^c + n − 1) per sublayer. c = 4 gives a near-identity start (n = 4: diagonal
  0.95, λ = 0.93; HC initialises its residual matrix to exactly I), so stream differences survive
  depth and the streams can specialise; c = 1 would give λ = 0.30, re-averaging the streams at
  every sublayer.

Computation: the read of sublayer l (coefficients and h = H^pre X, ``kernels.mhc.mhc_pre``) is done
ahead of time: by ``begin`` for l = 0, and fused into the previous write for l > 0
(``kernels.mhc.mhc_post_pre``: X' = H^res X + H^postᵀ f and the read of X' in one pass over the
streams, the paper's §4.3); ``read`` returns it. The last write is ``kernels.mhc.mhc_post``. Since
``read`` then does no compute, ``model.checkpoint_reads`` recomputes nothing for mHC. ``recompute_every`` = L_r > 0
keeps the streams for backward only at every L_r-th sublayer and rebuilds the others in backward (the paper's §4.3
recomputation, ``kernels/mhc/recompute.py``; fused backend only); by default L_r is the paper's L_r* on the fused
writes. ``backend`` =
"auto" (fused Triton kernels on CUDA, the PyTorch reference elsewhere), "torch" or "triton"; see
docs/kernel_mhc.md.

Parameters that are not matrices (α, biases, the optional norm gain and head) are stored flat (1-D)
so that the platform's "weight decay on matrices only" rule (ndim ≥ 2) leaves them alone; φ, a
projection, is decayed like any other weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from kernels.backend import backend_on
from kernels.mhc import BACKENDS, StreamRecompute, mhc_post, mhc_post_pre, mhc_pre, optimal_every
from kernels.mhc.reference import mhc_coefficients, sinkhorn  # noqa: F401  (the spec; re-exported)

from .attnres import eager
from .base import Context, Residual, ResidualConfig, check_choice, stored_dtype
from .registry import register

OUTPUTS = ("sum", "head")
# residual.stream_dtype, the storage of the n streams (the math is fp32 either way): "input": the embedding's
# dtype (fp32 under bf16-mixed autocast), as the reference and the plain residual keep it; "fp32"; "bf16": half
# the bytes and memory; "autocast" (the default): bf16 while bf16 autocast is on (trainer=gpu), else "input"
STREAM_DTYPES = {"input": None, "fp32": torch.float32, "bf16": torch.bfloat16}
STREAM_CHOICES = (*STREAM_DTYPES, "autocast")
__all__ = ["MHC", "MHCState", "OUTPUTS", "mhc_coefficients", "sinkhorn"]


@dataclass
class MHCState:
    """What mHC carries between sublayers."""

    streams: Tensor  # (B, T, n, d): X_l
    record: bool = False  # ctx.record: keep the coefficients for `MHC.recorded`
    # (layer, H^post, H^res) computed by read() from X_l, consumed by write() for the same layer
    pending: Optional[tuple[int, Tensor, Tensor]] = None
    # (layer, streams, h, H^pre, H^post, H^res): the read of `layer`, done ahead of time by begin() or by
    # the previous write (fused with it); read() returns it when asked for that layer and these streams
    ahead: Optional[tuple[int, Tensor, Tensor, Tensor, Tensor, Tensor]] = None
    trace: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)  # layer -> detached coeffs
    # the embedding's dtype: what read() hands the sublayer when no autocast would cast bf16 streams' h for it
    compute_dtype: Optional[torch.dtype] = None
    # residual.recompute_every > 0 in training: which streams the writes keep, and their rebuild in backward
    recompute: Optional[StreamRecompute] = None
    # every layer's parameters as views made once a forward (MHC.params_once), indexed by layer; empty: sliced per use
    params: tuple = ()


@register("mhc")
class MHC(Residual):
    """n residual streams mixed by input-dependent doubly stochastic matrices (docs/method.md §2)."""

    @dataclass
    class Config(ResidualConfig):
        n: int = 4  # parallel residual streams (expansion rate; paper: 4)
        sinkhorn_iters: int = 20  # Sinkhorn-Knopp iterations (paper: 20)
        alpha_init: float = 0.01  # initial α^pre, α^post, α^res: scale of the input-dependent part
        b_pre: Optional[float] = None  # H^pre bias init; None: logit(1/n), read weights sum to 1 (0 for n=1)
        b_post: float = 0.0  # H^post bias init; 0 gives H^post = 2σ(0) = 1 per stream
        b_res_diag: float = 4.0  # b^res = c·I; c = 4: H^res starts near I (see module docstring)
        phi_init_std: float = 1.0  # φ ~ N(0, phi_init_std²/nd): the std of z at step 0; 0: streams never split
        norm_gain: bool = False  # learnable gain in the RMSNorm over nd (redundant: φ absorbs it)
        output: str = "sum"  # "sum": sum of the n streams | "head": learned weights, init to the sum
        backend: str = "auto"  # "torch" (reference), "triton" (fused kernels/mhc), "auto" (triton on CUDA)
        # storage of the streams: "autocast" (bf16 under bf16 autocast, else the embedding's dtype), "input" (the
        # embedding's dtype: fp32 under autocast), "fp32", "bf16". bf16 on a GPU trains as fp32 does (1,000 steps of
        # data=large, seeds 0 1: worst gap 0.0135 against a spread of 0.0293; docs/kernel_mhc.md)
        stream_dtype: str = "autocast"
        # L_r of the paper's §4.3: keep the streams X_l for backward only where l % L_r == 0 and rebuild the others
        # in backward (one write kernel each, to the bit; fused backend only). 0: keep every X_l. None (the default):
        # the paper's L_r* = √(nL/(n+2)), rounded, where the writes are fused (backend triton, or auto on CUDA), 0 on
        # the reference. H200, `medium` (L_r* = 5), one process (throughput_medium_mhc_recompute.md): peak 52.26 ->
        # 39.97 GiB (1.60x -> 1.22x vanilla's) for 243.2 -> 251.8 ms a step (docs/kernel_mhc.md)
        recompute_every: Optional[int] = None

    def __init__(self, cfg: Config, d_model: int, n_sublayers: int):
        super().__init__(cfg, d_model, n_sublayers)
        self.validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        n, L = cfg.n, n_sublayers
        nd, k = n * d_model, n * n + 2 * n
        phi = torch.zeros(L, nd, k)
        if cfg.phi_init_std > 0:
            nn.init.normal_(phi, std=cfg.phi_init_std / math.sqrt(nd))  # fan-in scaled: z ~ N(0, std²)
        self.phi = nn.Parameter(phi)  # (L, nd, n²+2n), fp32 (paper Eq. 10)
        self.alpha = nn.Parameter(torch.full((L * 3,), float(cfg.alpha_init)))  # (L, 3) flat: pre, post, res
        self.b_pre = nn.Parameter(torch.full((L * n,), self.b_pre_init(cfg)))  # (L, n) flat
        self.b_post = nn.Parameter(torch.full((L * n,), float(cfg.b_post)))  # (L, n) flat
        self.b_res = nn.Parameter((cfg.b_res_diag * torch.eye(n)).repeat(L, 1, 1).flatten())  # (L, n, n) flat
        self.norm_gain = nn.Parameter(torch.ones(L * nd)) if cfg.norm_gain else None  # (L, nd) flat
        self.head = nn.Parameter(torch.ones(n)) if cfg.output == "head" else None  # (n,): init = sum

    @staticmethod
    def b_pre_init(cfg: Config) -> float:
        if cfg.b_pre is not None:
            return float(cfg.b_pre)
        # logit(1/n): the n read weights sum to 1. For n = 1 logit(1) = ∞; use 0 (h = x/2), which the
        # sublayer's own PreNorm undoes.
        return math.log(1.0 / (cfg.n - 1)) if cfg.n > 1 else 0.0

    @classmethod
    def validate(cls, cfg: Config, *, d_model: int, n_sublayers: int) -> None:
        if not isinstance(cfg.n, int) or cfg.n < 1:
            raise ValueError(f"residual.n={cfg.n!r} must be an integer >= 1 (number of streams; paper: 4)")
        if not isinstance(cfg.sinkhorn_iters, int) or cfg.sinkhorn_iters < 1:
            raise ValueError(f"residual.sinkhorn_iters={cfg.sinkhorn_iters!r} must be an integer >= 1 (paper: 20)")
        check_choice(cls.name, "backend", cfg.backend, ("auto", *BACKENDS))
        check_choice(cls.name, "stream_dtype", cfg.stream_dtype, STREAM_CHOICES)
        check_choice(cls.name, "output", cfg.output, OUTPUTS)
        every = cfg.recompute_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise ValueError(f"residual.recompute_every={every!r} must be an integer >= 0 (0 keeps every sublayer's "
                             f"streams; L_r keeps one sublayer's in L_r) or null (the paper's √(nL/(n+2)) on the "
                             f"fused writes)")
        if every and cfg.backend == "torch":
            raise ValueError(f"residual.recompute_every={every}: applies only to the fused writes (residual.backend="
                             f"triton, or auto on CUDA); got backend='torch'")
        if not cfg.phi_init_std >= 0:
            raise ValueError(f"residual.phi_init_std={cfg.phi_init_std!r} must be >= 0")
        for key in ("alpha_init", "b_post", "b_res_diag", "b_pre"):
            value = getattr(cfg, key)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"residual.{key}={value!r} must be a finite number")

    # every layer's parameters (φ, α, b_pre, b_post, b_res, the norm gain) as views made once a forward by one unbind
    # of each parameter (``MHCState.params``), instead of indexed by each read and write: their backward then makes no
    # whole-parameter gradient of zeros with the layer's slice copied in, summed into the parameter's (5 or 6 a
    # layer); each parameter's one unbind stacks the layers' gradients once a step. The same values (as
    # Msar.params_once). One H100, one process (plan msar_views): `small` 26.1-26.2 -> 25.8 ms (0.681x -> 0.691x
    # vanilla's, throughput_small_mhc_views_h100.md), `medium` 220.7 -> 219.9 ms (throughput_medium_views_medium_h100.md)
    params_once: bool = True

    # --- coefficients --------------------------------------------------------------------------
    def layer_params(self, layer: int, state: MHCState | None = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """φ (nd, n²+2n), α (3,), b_pre (n,), b_post (n,), b_res (n, n), norm gain (nd,) or None: the views made once
        a forward where ``state`` holds them (``params_once``), else sliced here."""
        if state is not None and state.params:
            return state.params[layer]
        n, nd = self.cfg.n, self.cfg.n * self.d_model
        gain = None if self.norm_gain is None else self.norm_gain.view(-1, nd)[layer]
        return (self.phi[layer], self.alpha.view(-1, 3)[layer], self.b_pre.view(-1, n)[layer],
                self.b_post.view(-1, n)[layer], self.b_res.view(-1, n, n)[layer], gain)

    def _all_layer_params(self) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None], ...]:
        """``layer_params`` of every layer from one unbind of each parameter."""
        n, nd, layers = self.cfg.n, self.cfg.n * self.d_model, self.n_sublayers
        gains = (None,) * layers if self.norm_gain is None else self.norm_gain.view(-1, nd).unbind(0)
        return tuple(zip(self.phi.unbind(0), self.alpha.view(-1, 3).unbind(0), self.b_pre.view(-1, n).unbind(0),
                         self.b_post.view(-1, n).unbind(0), self.b_res.view(-1, n, n).unbind(0), gains))

    def coefficients(self, streams: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """H^pre (B, T, n), H^post (B, T, n), H^res (B, T, n, n) of sublayer ``layer``, fp32 (the reference)."""
        phi, alpha, b_pre, b_post, b_res, gain = self.layer_params(layer)
        return mhc_coefficients(streams, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=self.cfg.sinkhorn_iters,
                                norm_gain=gain)

    # --- the protocol --------------------------------------------------------------------------
    def begin(self, embedding: Tensor, ctx: Context) -> MHCState:
        b, t, d = embedding.shape
        dtype = stored_dtype(self.cfg.stream_dtype, STREAM_DTYPES, embedding.device.type) or embedding.dtype
        # the embedding in every stream, materialised once: the first read and write (and their saved
        # tensors) share this copy instead of each making its own
        streams = embedding.to(dtype).unsqueeze(-2).expand(b, t, self.cfg.n, d).contiguous()  # (B, T, n, d)
        every = self.stream_recompute_every(embedding.device)
        recompute = StreamRecompute(every) if every and torch.is_grad_enabled() else None
        # where the fused ops are graph breaks (their writes keep only some streams: ``recompute``), one eager call: the
        # views made by autograd's unbind (one backward node a parameter), not traced into a compiled graph whose
        # outputs alias the parameters. Elsewhere the ops are traced with the slices, which the compiled backward sums
        # in its graph: a break here would only split that graph
        params = eager(self._all_layer_params) if self.params_once and recompute is not None else ()
        state = MHCState(streams=streams, record=ctx.record, compute_dtype=embedding.dtype, recompute=recompute,
                         params=params)
        state.ahead = (0, streams, *self._read(streams, 0, state))  # outside any checkpointed read: never recomputed
        return state

    def stream_recompute_every(self, device: torch.device) -> int:
        """L_r on ``device``: ``residual.recompute_every``, or where it is None the paper's L_r* when the writes run
        fused there (backend triton, or auto on CUDA) and 0 (keep every stream) when they run the reference."""
        if self.cfg.recompute_every is not None:
            return self.cfg.recompute_every
        fused = backend_on(self.cfg.backend, device, "mhc") == "triton"
        return optimal_every(self.cfg.n, self.n_sublayers) if fused else 0

    def _read(self, x: Tensor, layer: int, state: MHCState) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # coefficients (computed once, from X_l) and h = H^pre X_l: one pass over the streams when fused
        return mhc_pre(x, *self.layer_params(layer, state), sinkhorn_iters=self.cfg.sinkhorn_iters,
                       backend=self.cfg.backend)  # h (B, T, d) in x's dtype, coefficients fp32

    def checkpoint_read_pays(self, x: Tensor) -> bool:
        return False  # read() only hands over what begin() or the previous write computed

    def read(self, state: MHCState, layer: int) -> Tensor:
        x = state.streams  # (B, T, n, d)
        ahead = state.ahead
        if ahead is not None and ahead[0] == layer and ahead[1] is x:
            h, h_pre, h_post, h_res = ahead[2:]  # done by begin() or fused into the previous write
        else:
            h, h_pre, h_post, h_res = self._read(x, layer, state)
        state.pending = (layer, h_post, h_res)
        if state.record:
            state.trace[layer] = (h_pre.detach(), h_post.detach(), h_res.detach())
        if state.compute_dtype is not None and h.dtype != state.compute_dtype and not torch.is_autocast_enabled(
                h.device.type):
            h = h.to(state.compute_dtype)  # bf16 streams in fp32 training: the sublayer's weights are fp32
        return h

    def write(self, state: MHCState, layer: int, out: Tensor) -> MHCState:
        if state.pending is None or state.pending[0] != layer:
            got = None if state.pending is None else state.pending[0]
            raise RuntimeError(f"mhc.write(layer={layer}) needs read(layer={layer}) first; pending layer: {got}")
        _, h_post, h_res = state.pending
        # X_{l+1} = H^res X_l + H^postᵀ f_l, mixed in fp32, in the streams' dtype: (B, T, n, d)
        recompute = dict(recompute=state.recompute, layer=layer)  # which streams the write keeps (None: all)
        if layer + 1 == self.n_sublayers:
            new = mhc_post(state.streams, out, h_post, h_res, backend=self.cfg.backend, **recompute)
            return MHCState(streams=new, record=state.record, trace=state.trace, compute_dtype=state.compute_dtype,
                            params=state.params)
        # ... and the read of sublayer l+1 in the same pass (paper §4.3); read(l+1) returns it
        new, *next_read = mhc_post_pre(state.streams, out, h_post, h_res, *self.layer_params(layer + 1, state),
                                       sinkhorn_iters=self.cfg.sinkhorn_iters, backend=self.cfg.backend, **recompute)
        return MHCState(streams=new, record=state.record, trace=state.trace, ahead=(layer + 1, new, *next_read),
                        compute_dtype=state.compute_dtype, recompute=state.recompute, params=state.params)

    def end(self, state: MHCState) -> Tensor:
        x = state.streams  # (B, T, n, d)
        if state.record:
            self.recorded = self._summarise(state.trace)
        acc = torch.promote_types(x.dtype, torch.float32)  # bf16 streams are summed in fp32
        if self.head is None:
            return x.sum(-2, dtype=acc)
        with torch.autocast(device_type=x.device.type, enabled=False):  # in fp32, as the sum
            return torch.einsum("n,btnd->btd", self.head.to(acc), x.to(acc))

    def _summarise(self, trace: dict[int, tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
        """Token means of the coefficients per sublayer (rows: sublayers), for heatmaps.

        h_pre, h_post: (L, n). h_res: (L, n*n), row-major, entry i*n+j = weight of stream j in new
        stream i. h_res_composite: (L, n*n), token mean of H^res_{L-1}···H^res_l, the map the residual
        path applies from X_l to X_L (paper Fig. 7-8; its row / column sums are the forward / backward gains).
        """
        n, L = self.cfg.n, self.n_sublayers
        out = {k: torch.full((L, m), float("nan")) for k, m in
               (("h_pre", n), ("h_post", n), ("h_res", n * n), ("h_res_composite", n * n))}
        composite = None
        for layer in sorted(trace, reverse=True):
            h_pre, h_post, h_res = trace[layer]
            composite = h_res if composite is None else composite @ h_res  # (B, T, n, n)
            means = {"h_pre": h_pre, "h_post": h_post, "h_res": h_res.flatten(-2),
                     "h_res_composite": composite.flatten(-2)}
            for key, value in means.items():
                out[key][layer] = value.float().flatten(0, -2).mean(0).cpu()
        return out

    # --- accounting (analytic, per token, forward) ---------------------------------------------
    def extra_flops_per_token(self) -> float:
        """Forward FLOPs per token over the vanilla residual, summed over the model.

        A multiply-add counts 2; σ and exp count 1 per element. Per sublayer: RMSNorm over nd (3nd,
        +nd with a gain), z = x'φ (2·nd·(n²+2n)), α·z + b (2(n²+2n)), σ and the ×2 (3n), exp (n²),
        Sinkhorn in its plain form (per iteration a column and a row pass, each a sum and a divide:
        4n²), h = H^pre X (2nd), H^res X (2n²d), + H^postᵀ out (2nd), minus vanilla's own addition (d).
        Once: the output (sum: (n-1)d; head: (2n-1)d). The log-domain Sinkhorn does a few more
        elementwise ops than counted; they are O(n²) and negligible next to the projection.
        """
        n, d, L, it = self.cfg.n, self.d_model, self.n_sublayers, self.cfg.sinkhorn_iters
        k = n * n + 2 * n
        per_sublayer = (
            3 * n * d + (n * d if self.cfg.norm_gain else 0)
            + 2 * n * d * k
            + 2 * k + 3 * n + n * n + 4 * n * n * it
            + 2 * n * d + 2 * n * n * d + 2 * n * d
            - d
        )
        output = (n - 1) * d if self.cfg.output == "sum" else (2 * n - 1) * d
        return float(L * per_sublayer + output)

    def state_per_token(self) -> float:
        return float(self.cfg.n)  # the n streams, in units of d

    def io_per_sublayer(self, fused: bool = False) -> float:
        """Elements read + written per token per sublayer for the residual path, in units of d.

        Counted as the paper's Table 2 (forward, the sublayer's internal I/O excluded): computing the
        coefficients reads nd and writes n²+2n; H^pre reads nd+n, writes d; H^post reads d+n, writes
        nd; H^res reads nd+n², writes nd; the merge reads 2nd, writes nd. Total (8n+2)d + 2(n²+2n)
        elements: 34d + 48 for n = 4 (docs/method.md §2: "≈ 34d"). ``fused=True``: the paper's kernels (§4.3.1)
        fuse H^post, H^res and the merge into one kernel that reads (n+1)d + n²+n and writes nd, so the
        total is (4n+2)d + 2(n²+2n): 18d + 48 for n = 4. Vanilla is 3d.
        """
        n, d = self.cfg.n, self.d_model
        per_d = 4 * n + 2 if fused else 8 * n + 2
        return per_d + 2 * (n * n + 2 * n) / d
