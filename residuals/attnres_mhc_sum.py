"""attnres_mhc_sum: AttnRes and mHC both on, their contributions summed (docs/method.md §5 ablation).

The paper's control for MSAR ("is MSAR just depth attention plus multiple streams?"; 1.861 at 10B,
not the same as MSAR). Built by composing the two registered mechanisms, never by copying them:
each runs exactly as on its own, on its own state, and sees every sublayer output.

    h_l  = w_a · attnres.read(l) + w_m · mhc.read(l)       (default w_a = w_m = 1: the plain sum)
    write: the output v_l = f_l(h_l) goes to both (a new AttnRes source; mHC's H^postᵀ v_l)
    end  = w_a · attnres.end + w_m · mhc.end

The default is the plain sum, as the paper describes the ablation. Scales are left as they come:
at step 0 mHC's read is the running residual sum while AttnRes's is the mean of its sources, and
mHC's "sum" output is n times its stream, so mHC dominates both h_l and the final output; the
sublayers' PreNorm and the final RMSNorm remove only the overall scale. ``attnres_weight`` /
``mhc_weight`` rebalance (0.5 / 0.5: the average; 1 / 0: AttnRes alone).

Overrides reach the parts through the nested nodes: ``residual.mhc.n=2``,
``residual.attnres.key_norm=false``.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from . import attnres as _attnres  # noqa: F401  (registers "attnres" before the look-up below)
from . import mhc as _mhc  # noqa: F401  (registers "mhc")
from .base import Context, Residual, ResidualConfig
from .registry import config_for, get, register

AttnResConfig = get("attnres").Config
MHCConfig = get("mhc").Config
PARTS = ("attnres", "mhc")


@register("attnres_mhc_sum")
class AttnResMHCSum(Residual):
    """AttnRes + mHC, each on its own state; the sublayer reads the (weighted) sum of both reads."""

    @dataclass
    class Config(ResidualConfig):
        attnres: AttnResConfig = field(default_factory=lambda: config_for("attnres"))  # the AttnRes part
        mhc: MHCConfig = field(default_factory=lambda: config_for("mhc"))  # the mHC part
        attnres_weight: float = 1.0  # w_a on AttnRes's read and output
        mhc_weight: float = 1.0  # w_m on mHC's read and output

    def __init__(self, cfg: Config, d_model: int, n_sublayers: int):
        super().__init__(cfg, d_model, n_sublayers)
        self.validate(cfg, d_model=d_model, n_sublayers=n_sublayers)
        self.attnres = get("attnres")(cfg.attnres, d_model, n_sublayers)
        self.mhc = get("mhc")(cfg.mhc, d_model, n_sublayers)
        self._record = False  # ctx.record of the current forward: merge the parts' recordings in end()

    @classmethod
    def validate(cls, cfg: Config, *, d_model: int, n_sublayers: int) -> None:
        for part in PARTS:
            try:
                get(part).validate(getattr(cfg, part), d_model=d_model, n_sublayers=n_sublayers)
            except ValueError as e:  # say which part: residual.n=0 -> residual.mhc.n=0
                msg = str(e)
                msg = (f"residual.{part}.{msg[len('residual.'):]}" if msg.startswith("residual.")
                       else f"residual.{part}: {msg}")
                raise ValueError(msg) from e
        for key in ("attnres_weight", "mhc_weight"):
            value = getattr(cfg, key)
            if not math.isfinite(value):
                raise ValueError(f"residual.{key}={value!r} must be a finite number")

    def _mix(self, a: Tensor, m: Tensor) -> Tensor:
        w_a, w_m = self.cfg.attnres_weight, self.cfg.mhc_weight
        if w_a == 1.0 and w_m == 1.0:
            return a + m
        return w_a * a + w_m * m

    # --- the protocol --------------------------------------------------------------------------
    def begin(self, embedding: Tensor, ctx: Context) -> tuple[Any, Any]:
        self._record = ctx.record
        return self.attnres.begin(embedding, ctx), self.mhc.begin(embedding, ctx)

    def read(self, state: tuple[Any, Any], layer: int) -> Tensor:
        a_state, m_state = state
        return self._mix(self.attnres.read(a_state, layer), self.mhc.read(m_state, layer))  # (B, T, d)

    def write(self, state: tuple[Any, Any], layer: int, out: Tensor) -> tuple[Any, Any]:
        a_state, m_state = state
        return self.attnres.write(a_state, layer, out), self.mhc.write(m_state, layer, out)

    def end(self, state: tuple[Any, Any]) -> Tensor:
        a_state, m_state = state
        out = self._mix(self.attnres.end(a_state), self.mhc.end(m_state))
        if self._record:
            self.recorded = {f"{part}.{key}": value for part in PARTS
                             for key, value in getattr(self, part).recorded.items()}
        return out

    # --- accounting: the two parts plus the sum --------------------------------------------------
    def extra_flops_per_token(self) -> float:
        """Both parts' FLOPs, plus combining the two results for the L reads and the output:
        d for the addition, d more per weight that is not 1."""
        per_combine = self.d_model * (1 + (self.cfg.attnres_weight != 1.0) + (self.cfg.mhc_weight != 1.0))
        parts = self.attnres.extra_flops_per_token() + self.mhc.extra_flops_per_token()
        return float(parts + (self.n_sublayers + 1) * per_combine)

    def state_per_token(self) -> float:
        return self.attnres.state_per_token() + self.mhc.state_per_token()

    def io_per_sublayer(self) -> float:
        """Both parts' reads+writes per sublayer (units of d), plus reading the two reads and
        writing their sum (3d); an implementation fusing the sum into one part saves the 3d."""
        return self.attnres.io_per_sublayer() + self.mhc.io_per_sublayer() + 3.0
