"""The shared MoE backbone (SPEC §6): a decoder-only LM with a pluggable residual mechanism.

Token embedding, n_blocks Transformer blocks of (attention sublayer, MLP sublayer), final RMSNorm,
LM head. Attention: causal GQA with RoPE through `scaled_dot_product_attention`, never crossing a
document boundary of a packed window. MLP: the first block a dense SwiGLU, the others the MoE of
`platform.moe`. Each sublayer applies its own PreNorm; *what it reads and how its output is
written back* is the residual mechanism's business (`residuals.base.Residual`), and the backbone
never branches on which mechanism it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import residuals
from residuals import Context

from .moe import MoE, SwiGLU


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return residuals.rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (T, hd/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, hd), rotating channel pairs (i, i + hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """PreNorm causal GQA with RoPE."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
        self.doc_mask = cfg.doc_mask
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.hd, bias=False)
        self.wkv = nn.Linear(cfg.d_model, 2 * self.n_kv * self.hd, bias=False)
        self.wo = nn.Linear(self.n_heads * self.hd, cfg.d_model, bias=False)
        cos, sin = rope_tables(cfg.seq_len, self.hd, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, h: Tensor, ctx: Context) -> Tensor:
        B, T, _ = h.shape
        x = self.norm(h)
        q = self.wq(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, H, T, hd)
        k, v = self.wkv(x).view(B, T, 2, self.n_kv, self.hd).permute(2, 0, 3, 1, 4)  # (B, Hkv, T, hd) each
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.doc_mask:
            # Causal and same-document: no token sees a later token or another document.
            same_doc = ctx.doc_ids[:, :, None] == ctx.doc_ids[:, None, :]  # (B, T, T)
            mask = (same_doc & torch.ones(T, T, dtype=torch.bool, device=h.device).tril())[:, None]
            rep = self.n_heads // self.n_kv  # the masked kernels want explicit KV heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class FeedForward(nn.Module):
    """PreNorm MLP sublayer: a dense SwiGLU or an MoE."""

    def __init__(self, cfg, dense: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.dense_hidden) if dense else MoE(
            cfg.d_model, cfg.n_experts, cfg.top_k, cfg.expert_hidden, cfg.n_shared,
            cfg.bias_update_rate, cfg.route_scale, cfg.moe_impl)

    def forward(self, h: Tensor, ctx: Context) -> Tensor:
        return self.mlp(self.norm(h))


class Backbone(nn.Module):
    def __init__(self, cfg, vocab_size: int, residual_cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.sublayers = nn.ModuleList()
        for b in range(cfg.n_blocks):
            self.sublayers.append(Attention(cfg))
            self.sublayers.append(FeedForward(cfg, dense=(b == 0)))
        self.residual = residuals.get(residual_cfg.name)(residual_cfg, cfg.d_model, len(self.sublayers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.cfg.init_std
        for sub in self.sublayers:
            for name, p in sub.named_parameters():
                if p.ndim >= 2:
                    nn.init.normal_(p, std=std)
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.head.weight, std=std)

    def moe_layers(self) -> list[tuple[int, MoE]]:
        return [(i, s.mlp) for i, s in enumerate(self.sublayers) if isinstance(getattr(s, "mlp", None), MoE)]

    def forward(self, tokens: Tensor, doc_ids: Tensor, record: bool = False) -> Tensor:
        """tokens, doc_ids: (B, T) -> logits (B, T, vocab)."""
        ctx = Context(doc_ids=doc_ids, record=record)
        state = self.residual.begin(self.embed(tokens), ctx)  # embedding v_0: (B, T, d)
        recompute = self.cfg.checkpoint_reads and self.training and torch.is_grad_enabled()
        for layer, sublayer in enumerate(self.sublayers):
            if recompute:  # keep only the read's inputs; redo it in backward (views, softmax, ...)
                h = checkpoint(self.residual.read, state, layer, use_reentrant=False)
            else:
                h = self.residual.read(state, layer)  # h_l: (B, T, d)
            state = self.residual.write(state, layer, sublayer(h, ctx))
        return self.head(self.norm(self.residual.end(state)))
