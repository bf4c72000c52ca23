"""An external residual plugin, as a researcher would write it outside the repo (used by tests)."""

from dataclasses import dataclass

import torch
from torch import nn

from residuals import Residual, ResidualConfig, register


@register("example_gated")
class ExampleGated(Residual):
    """x_{l+1} = x_l + g_l * f_l(x_l) with a learned scalar gate per sublayer."""

    @dataclass
    class Config(ResidualConfig):
        gate_init: float = 1.0  # initial value of every gate

    def __init__(self, cfg, d_model, n_sublayers):
        super().__init__(cfg, d_model, n_sublayers)
        self.gates = nn.Parameter(torch.full((n_sublayers,), cfg.gate_init))

    def begin(self, embedding, ctx):
        return embedding

    def read(self, state, layer):
        return state

    def write(self, state, layer, out):
        return state + self.gates[layer] * out

    def end(self, state):
        return state
