"""The residual protocol, and the vanilla PreNorm residual.

A residual mechanism decides what each sublayer reads and how its output is folded back in
(cf. the read/write view of hyper-connections). The backbone calls, for every sublayer l::

    state = res.begin(embedding, ctx)          # once
    h = res.read(state, l)                     # (B, T, d): the sublayer's input h_l
    state = res.write(state, l, sublayer(h))   # fold v_l = f_l(h_l) back in
    x = res.end(state)                         # once: what the final RMSNorm and LM head see

One mechanism instance serves the whole model (it owns the per-sublayer parameters and whatever
state it carries across depth: streams, lists of sources, block summaries). The backbone never
branches on a variant's name; everything a variant needs arrives through ``ctx``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .registry import register


@dataclass
class ResidualConfig:
    """Fields common to every variant. Subclasses add their own (typed, with defaults)."""

    name: str = "???"


@dataclass
class Context:
    """What a mechanism may use besides the sublayer outputs."""

    doc_ids: Tensor  # (B, T) int64: document of each token; token-axis ops stop at boundaries
    record: bool = False  # keep depth-attention weights for inspection (see Residual.recorded)
    # the mechanism's per-consumer parameters as views made once a forward (Msar.params_once), indexed by consumer;
    # empty: each read slices its own
    params: tuple = ()


class Residual(nn.Module):
    """Base class of residual mechanisms. Subclass, add a nested ``Config``, ``@register`` it."""

    name: ClassVar[str] = "?"
    Config: ClassVar[type[ResidualConfig]] = ResidualConfig

    def __init__(self, cfg: ResidualConfig, d_model: int, n_sublayers: int):
        super().__init__()
        self.cfg, self.d_model, self.n_sublayers = cfg, d_model, n_sublayers
        self.recorded: dict[str, Tensor] = {}  # filled when ctx.record: name -> (sources, consumers)

    @classmethod
    def validate(cls, cfg: ResidualConfig, *, d_model: int, n_sublayers: int) -> None:
        """Raise ValueError (naming the bad value and the valid range) before any compute."""

    # --- the protocol -------------------------------------------------------------------------
    def begin(self, embedding: Tensor, ctx: Context) -> Any:
        raise NotImplementedError

    def read(self, state: Any, layer: int) -> Tensor:
        raise NotImplementedError

    def write(self, state: Any, layer: int, out: Tensor) -> Any:
        raise NotImplementedError

    def end(self, state: Any) -> Tensor:
        raise NotImplementedError

    def checkpoint_read_pays(self, x: Tensor) -> bool:
        """Whether recomputing ``read`` in backward (``model.checkpoint_reads``) saves memory here:
        true where a read stores large intermediates (the references' stacked sources and views),
        false where it stores nothing worth recomputing (a fused op, an identity read). ``x``: the
        embedding, for the device the read runs on."""
        return True

    # --- accounting (analytic, per token, forward) --------------------------------------------
    def extra_flops_per_token(self) -> float:
        """FLOPs per token beyond the vanilla residual's additions, forward pass."""
        return 0.0

    def state_per_token(self) -> float:
        """Persistent per-token state carried between sublayers, in units of d (at the deepest point)."""
        return 1.0

    def io_per_sublayer(self) -> float:
        """Paper-style residual I/O per token per sublayer, reads + writes, in units of d.

        PreNorm: read x_l (d) and f_l(x_l) (d), write x_{l+1} (d) = 3d (docs/method.md §1).
        """
        return 3.0


@register("vanilla")
class Vanilla(Residual):
    """PreNorm residual: x_{l+1} = x_l + f_l(x_l) (docs/method.md §1). The sublayer applies its own norm."""

    @dataclass
    class Config(ResidualConfig):
        pass

    def begin(self, embedding: Tensor, ctx: Context) -> Tensor:
        return embedding  # (B, T, d)

    def read(self, state: Tensor, layer: int) -> Tensor:
        return state

    def write(self, state: Tensor, layer: int, out: Tensor) -> Tensor:
        return state + out

    def end(self, state: Tensor) -> Tensor:
        return state

    def checkpoint_read_pays(self, x: Tensor) -> bool:
        return False  # the read is the state itself


def check_choice(owner: str, field: str, value: object, choices: Sequence[object]) -> None:
    """ValueError naming the config key, the bad value and the choices (``owner``: the variant)."""
    if value not in choices:
        raise ValueError(f"residual.{field}={value!r} is not valid for residual={owner}; "
                         f"choose one of: {', '.join(map(str, choices))}")


def stored_dtype(setting: str, table: Mapping[str, torch.dtype | None], device: str) -> torch.dtype | None:
    """The dtype a residual's storage setting (mHC's ``stream_dtype``, the depth-attention residuals' ``source_dtype``)
    stands for on ``device`` now, None for the input's own: ``table[setting]``, and "autocast" bf16 while bf16 autocast
    is on there (mixed-precision training, ``trainer=gpu``), so that fp32 runs stay fp32."""
    if setting == "autocast":
        on = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
        return torch.bfloat16 if on else None
    return table[setting]


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last axis, shared by the variants; cast back to x's dtype.

    Computed in at least fp32 (16-bit inputs are upcast) and in fp64 for fp64 inputs, so that fp64
    gradchecks of the variants that use it are exact."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    return y.to(x.dtype)
