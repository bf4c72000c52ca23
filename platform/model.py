"""The shared MoE backbone (docs/method.md §6): a decoder-only LM with a pluggable residual mechanism.

Token embedding, n_blocks Transformer blocks of (attention sublayer, MLP sublayer), final RMSNorm,
LM head. Attention: causal GQA with RoPE, never crossing a document boundary of a packed window.
MLP: the first block a dense SwiGLU, the others the MoE of `platform.moe`. Each sublayer applies
its own PreNorm; *what it reads and how its output is written back* is the residual mechanism's
business (`residuals.base.Residual`), and the backbone never branches on which mechanism it is.

Attention runs on one of two backends (`model.attention`), dispatched explicitly:
- ``flex``: FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating
  Optimized Attention Kernels") with a block mask built once per batch from the causal and
  same-document predicate, so fully masked 128×128 tiles are skipped; GQA through ``enable_gqa``
  (no repeated KV heads). On CUDA the call is ``torch.compile``d (a fused Triton kernel);
  eager it materialises the scores, and PyTorch has no FlexAttention backward on CPU.
- ``sdpa``: the reference: a dense (B, 1, T, T) boolean mask and explicitly repeated KV heads
  through ``scaled_dot_product_attention``.
``auto`` is ``flex`` on CUDA tensors and ``sdpa`` elsewhere.

Activation memory: ``model.recompute`` re-runs the attention and/or MLP sublayers in backward
instead of keeping their activations (``torch.utils.checkpoint``); ``model.checkpoint_reads`` does
the same for the residual's read. ``Backbone.compile_sublayers`` compiles each sublayer (the part
every residual variant shares); the residual mechanism stays as it is (see docs/gpu.md).
``Backbone.compile_model`` compiles the whole forward below the mask instead, residual included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import residuals
from residuals import Context

from .moe import MoE, SwiGLU

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
RECOMPUTE = ("none", "attention", "mlp", "full")  # which sublayers re-run in backward


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


def attention_backend(choice: str, device: torch.device) -> str:
    """Resolve ``model.attention`` for tensors on ``device``: auto = flex on CUDA, sdpa elsewhere."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention={choice!r} is not valid; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    if choice == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return choice


@dataclass
class AttentionMask:
    """Which keys each query may see, built once per batch and shared by every attention sublayer.

    backend "flex": ``block`` is a FlexAttention BlockMask. backend "sdpa": ``dense`` is a
    (B, 1, T, T) boolean mask, or None for plain causal attention.
    """

    backend: str
    block: Any = None
    dense: Tensor | None = None


_compiled_flex = None


def flex_kernel_options(fwd, bwd) -> dict | None:
    """FlexAttention's ``kernel_options`` from ``model.flex_fwd`` / ``model.flex_bwd`` (None: PyTorch's tiles);
    a bad value is a ConfigError naming it and the valid ones, wherever a model is built."""
    from .config import FLEX_BWD_FIELDS, FLEX_FWD_FIELDS, check_flex_tiles

    check_flex_tiles("model.flex_fwd", list(fwd or ()), FLEX_FWD_FIELDS)
    check_flex_tiles("model.flex_bwd", list(bwd or ()), FLEX_BWD_FIELDS)

    options = {**{f"fwd_{k}": int(v) for k, v in zip(FLEX_FWD_FIELDS, fwd or ())},
               **{f"bwd_{k}": int(v) for k, v in zip(FLEX_BWD_FIELDS, bwd or ())}}
    return options or None


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask, options: dict | None = None) -> Tensor:
    """FlexAttention: a fused kernel on CUDA (compiled), the unfused reference math elsewhere.

    Inside a compiled region (trainer.compile) the enclosing compile generates the fused kernel;
    called eagerly on CUDA it goes through its own compiled wrapper, built on first use.
    """
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":  # the unfused math: no kernel, no tiles
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)


def build_attention_mask(doc_ids: Tensor, backend: str, doc_mask: bool = True) -> AttentionMask:
    """The causal (and, with ``doc_mask``, same-document) mask for doc_ids (B, T), for ``backend``."""
    B, T = doc_ids.shape
    if backend == "sdpa":
        if not doc_mask:
            return AttentionMask("sdpa")
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
        return AttentionMask("sdpa", dense=(same_doc & causal)[:, None])  # (B, 1, T, T)
    if backend != "flex":
        raise ValueError(f"attention backend {backend!r} is not valid; choose flex or sdpa")
    from torch.nn.attention.flex_attention import create_block_mask

    if doc_mask:
        def mask_mod(b, h, q, kv):  # causal and same document: the predicate of the sdpa mask above
            return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])
    else:
        B = None  # one mask broadcast over the batch

        def mask_mod(b, h, q, kv):
            return q >= kv
    # On CUDA the mask itself is built by a compiled kernel: no (B, T, T) tensor is materialised.
    block = create_block_mask(mask_mod, B, None, T, T, device=doc_ids.device, _compile=doc_ids.is_cuda)
    return AttentionMask("flex", block=block)


class Attention(nn.Module):
    """PreNorm causal GQA with RoPE."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.hd, bias=False)
        self.wkv = nn.Linear(cfg.d_model, 2 * self.n_kv * self.hd, bias=False)
        self.wo = nn.Linear(self.n_heads * self.hd, cfg.d_model, bias=False)
        cos, sin = rope_tables(cfg.seq_len, self.hd, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.flex_options = flex_kernel_options(cfg.flex_fwd, cfg.flex_bwd)  # a plain dict for the compiled forward

    def forward(self, h: Tensor, mask: AttentionMask) -> Tensor:
        B, T, _ = h.shape
        x = self.norm(h)
        q = self.wq(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, H, T, hd)
        k, v = self.wkv(x).view(B, T, 2, self.n_kv, self.hd).permute(2, 0, 3, 1, 4)  # (B, Hkv, T, hd) each
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.to(q.dtype)
        if mask.backend == "flex":
            with torch.autocast(h.device.type, enabled=False):  # q, k, v already share the compute dtype
                y = _flex(q, k, v, mask.block, self.flex_options)  # (B, H, T, hd)
        elif mask.dense is not None:
            rep = self.n_heads // self.n_kv  # the masked kernels want explicit KV heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
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
            cfg.bias_update_rate, cfg.route_scale, cfg.moe_impl, cfg.moe_topk)

    def forward(self, h: Tensor, mask: AttentionMask) -> Tensor:
        return self.mlp(self.norm(h))


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Mean next-token cross-entropy in fp32 whatever the logits' dtype: logits (B, T, V), target (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _compile_kwargs(inductor: dict | None, options: dict) -> dict:
    """torch.compile's keyword arguments: static shapes unless asked otherwise, and the Inductor settings
    (a plain dict: torch.compile takes no config node) as its ``options``."""
    kwargs = {"dynamic": False, **options}
    if inductor:
        kwargs["options"] = {**kwargs.get("options", {}), **dict(inductor)}
    return kwargs


class Backbone(nn.Module):
    def __init__(self, cfg, vocab_size: int, residual_cfg):
        super().__init__()
        if cfg.recompute not in RECOMPUTE:
            raise ValueError(f"model.recompute={cfg.recompute!r} is not valid; choose one of: {', '.join(RECOMPUTE)}")
        attention_backend(cfg.attention, torch.device("cpu"))  # a bad name fails here, before any compute
        self.cfg = cfg
        # Plain values read on every forward (a config node is opaque to torch.compile's tracer).
        self.attention, self.recompute, self.doc_mask = str(cfg.attention), str(cfg.recompute), bool(cfg.doc_mask)
        self.checkpoint_reads = bool(cfg.checkpoint_reads)
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.sublayers = nn.ModuleList()
        for b in range(cfg.n_blocks):
            self.sublayers.append(Attention(cfg))
            self.sublayers.append(FeedForward(cfg, dense=(b == 0)))
        self.residual = residuals.get(residual_cfg.name)(residual_cfg, cfg.d_model, len(self.sublayers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.cross_entropy = cross_entropy  # the training loss; compile_sublayers compiles it
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

    def compile_sublayers(self, inductor: dict | None = None, **options) -> None:
        """torch.compile every attention and MLP sublayer in place (parameter names do not change), and
        the loss: compiled, the cast of the (B, T, V) logits to fp32, the log-softmax and its backward are
        fused kernels instead of eager passes over the logits (about 1.3 ms of a 20 ms `small` step).

        Static shapes by default: one specialised graph per (sublayer kind, shape, train/eval), shared
        by all layers of a kind, instead of a dynamic-shape recompile when a second shape appears.
        ``inductor``: Inductor settings (`trainer.compile_options`), torch.compile's ``options``.
        """
        options = _compile_kwargs(inductor, options)
        for sub in self.sublayers:
            sub.compile(**options)
        self.cross_entropy = torch.compile(cross_entropy, **options)

    def compile_model(self, inductor: dict | None = None, **options) -> None:
        """torch.compile the whole forward below the attention mask (embedding, every read, sublayer and
        write, final norm and head: `trunk`) as one graph, and the loss as in `compile_sublayers`.

        Where `compile_sublayers` leaves the residual eager, here its reads and writes are fused with
        the sublayers around them: for vanilla, each residual addition and, in backward, each sum of
        the skip's and the sublayer's gradient of the stream join a neighbouring kernel instead of a
        pass of their own over the (B, T, d) fp32 stream (`trainer.compile_scope=model`, docs/gpu.md).
        A fused Triton residual op is a graph break (it is `torch.compiler.disable`d), so the graph
        is cut around each such call. A recording forward (``record=True``, once at the end of a run) runs
        the uncompiled trunk: no graph of its own for one call, and its side effects stay plain Python.
        ``inductor``: Inductor settings (`trainer.compile_options`), torch.compile's ``options``.
        """
        options = _compile_kwargs(inductor, options)
        # A residual whose fused ops are graph breaks has its read/write frames compiled once per layer (the
        # layer index is a constant of each graph) and per output dtype (bf16 attention, fp32 MoE): Dynamo's
        # default of 8 graphs per frame ran the later layers' frames eager (mhc, attnres on an H200).
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * (len(self.sublayers) + 2))
        self.trunk = torch.compile(self.trunk, **options)
        self.cross_entropy = torch.compile(cross_entropy, **options)

    def compile_as(self, scope: str, inductor: dict | None = None) -> None:
        """Compile as `trainer.compile_scope` says: "model" (`compile_model`) or "sublayers"
        (`compile_sublayers`), with the Inductor settings of `trainer.compile_options`."""
        if scope == "model":
            self.compile_model(inductor)
        else:
            self.compile_sublayers(inductor)

    def _recomputed(self, sublayer: nn.Module) -> bool:
        kind = "attention" if isinstance(sublayer, Attention) else "mlp"
        return self.recompute in (kind, "full")

    def forward(self, tokens: Tensor, doc_ids: Tensor, record: bool = False) -> Tensor:
        """tokens, doc_ids: (B, T) -> logits (B, T, vocab)."""
        mask = build_attention_mask(doc_ids, attention_backend(self.attention, doc_ids.device), self.doc_mask)
        if record:  # the class's own trunk: uncompiled even after compile_model
            return Backbone.trunk(self, tokens, doc_ids, mask, record)
        return self.trunk(tokens, doc_ids, mask, record)

    def trunk(self, tokens: Tensor, doc_ids: Tensor, mask: AttentionMask, record: bool = False) -> Tensor:
        """The forward once the attention mask is built (what `compile_model` compiles): -> logits."""
        ctx = Context(doc_ids=doc_ids, record=record)
        embedding = self.embed(tokens)  # v_0: (B, T, d)
        state = self.residual.begin(embedding, ctx)
        grad = self.training and torch.is_grad_enabled()
        # checkpoint_reads: only where the mechanism's read stores something worth recomputing
        checkpoint_reads = grad and self.checkpoint_reads and self.residual.checkpoint_read_pays(embedding)
        for layer, sublayer in enumerate(self.sublayers):
            if checkpoint_reads:  # keep only the read's inputs; redo it in backward
                h = checkpoint(self.residual.read, state, layer, use_reentrant=False)
            else:
                h = self.residual.read(state, layer)  # h_l: (B, T, d)
            if grad and self._recomputed(sublayer):  # keep h_l only; re-run the sublayer in backward
                out = checkpoint(sublayer, h, mask, use_reentrant=False)
            else:
                out = sublayer(h, mask)
            state = self.residual.write(state, layer, out)
        if self.training:  # once per forward of the model, so a recomputed sublayer is not counted twice
            for _, moe in self.moe_layers():
                moe.accumulate_load()
        return self.head(self.norm(self.residual.end(state)))
