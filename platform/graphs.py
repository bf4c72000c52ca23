"""CUDA graphs for a training step's forward and backward (`trainer.cuda_graphs`).

At `small` a training step launches about 1,200 kernels (1,500-2,300 with a residual variant's own
ops) and the host, not the GPU, sets the pace: the profile (`benchmarks/results/profile_step_small.md`)
shows 22-45 ms of GPU work in a 40-100 ms step. A CUDA graph replays a recorded sequence of kernels
with one launch, so the host cost of the forward and backward no longer depends on how many
kernels they are made of.

`graphed_loss` wraps the model's training loss (next-token cross-entropy) with PyTorch's
`torch.cuda.make_graphed_callables`: after a few warm-up iterations on a side stream (which also
compile every `torch.compile`d sublayer and every Triton kernel; their cached memory is then
released, since a capture cannot release it), it records the forward and the backward as two
graphs in one private memory pool, and returns a function that copies each new
batch into the recorded input buffers and replays them. What this implies, and how it is handled:

- **Static shapes.** The batch shape is fixed at capture; another shape is an error that names both
  (the training loader's windows all have one shape; validation runs the ordinary eager model).
- **No host synchronisation inside** the loss: the MoE dispatch and every fused residual op are
  sync-free (`platform/moe.py`), which is what makes the step capturable at all.
- **State written by the forward** (the MoE layers' routing loads) would be counted by the warm-up
  and capture passes too: every buffer of the model is restored after capture. Each replay then
  updates them as the eager forward does, in place.
- **Gradients.** The graph's parameter gradients live in static buffers that autograd hands to
  `.grad`; with gradient accumulation the next replay would overwrite a gradient before it is added
  to. `LMModule` therefore keeps `.grad` allocated and zeroes it in place when accumulating.
- **Mixed precision.** Capture runs under the caller's autocast state with autocast's weight cache
  off (a cached cast would be recorded once and never refreshed). bf16 only: PyTorch's fp32 and
  fp16 grouped GEMMs copy the group offsets to the host, which a capture refuses (config check).

Data parallelism works: gradients leave the graph through autograd, so DDP's all-reduce hooks fire
as in eager mode, outside the graph, but only once the whole backward has replayed (no overlap of
the all-reduce with the backward: 0.85 scaling on two H200s at `small`). `trainer.grad_sync=auto`
therefore averages a graphed step's gradients after it in one all-reduce instead
(`platform/parallel.py`: 0.907, 0.917 with a bf16 all-reduce; docs/gpu.md).
Measured on an H200 (`throughput_small_graphs_off_on.md`): a `small` vanilla step 36.1 -> 21.5 ms,
Block AttnRes 65.9 -> 24.0 ms; `medium`, already GPU-bound, 2-3%.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn


def next_token_loss(model: nn.Module, tokens: Tensor, doc_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The training objective of a `Backbone`: windows tokens, doc_ids (B, T+1) -> (mean next-token
    cross-entropy (`model.cross_entropy`, compiled with the sublayers), logits (B, T, V), targets (B, T)).
    `LMModule` and `TrainLoss` both compute it here."""
    logits = model(tokens[:, :-1], doc_ids[:, :-1])  # (B, T, V)
    target = tokens[:, 1:]
    return model.cross_entropy(logits, target), logits, target


class TrainLoss(nn.Module):
    """The training objective as a module (what a graph captures): tokens, doc_ids (B, T+1) -> the loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, doc_ids: Tensor) -> Tensor:
        return next_token_loss(self.model, tokens, doc_ids)[0]


def graphed_loss(model: nn.Module, tokens: Tensor, doc_ids: Tensor,
                 warmup: int = 3) -> Callable[[Tensor, Tensor], Tensor]:
    """Capture `TrainLoss(model)` for batches shaped like `tokens` and return it as a function.

    The returned loss is an ordinary autograd leaf of the graph: `loss.backward()` replays the
    recorded backward and accumulates into each parameter's `.grad`. Its value lives in the graph's
    output buffer, so it is cloned for the caller (the next replay overwrites the buffer).
    """
    if tokens.device.type != "cuda":
        raise ValueError(f"trainer.cuda_graphs=true needs the batch on a CUDA device, got {tokens.device}; "
                         "set trainer.cuda_graphs=false on a CPU")
    if not model.training:
        raise ValueError("graphed_loss captures the training forward: call model.train() first")
    loss_module = TrainLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [b.detach().clone() for b in model.buffers()]
    cuda_autocast = torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda") if cuda_autocast else torch.bfloat16
    with torch.autocast("cuda", dtype=dtype, enabled=cuda_autocast, cache_enabled=False):
        # Warm-up on a side stream (compiles, autotunes, lazy initialisations), then give its cached
        # memory back: a capture cannot free cached blocks, so without this the eager warm-up's
        # activations and the graph's would both have to fit (a `medium` MSAR step did not).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                out = loss_module(tokens, doc_ids)
                torch.autograd.grad(out, params, torch.ones_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        del out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graphed = torch.cuda.make_graphed_callables(loss_module, (tokens, doc_ids), num_warmup_iters=0,
                                                    allow_unused_input=True)
    with torch.no_grad():  # undo what the warm-up and capture passes wrote (routing loads)
        for buf, value in zip(model.buffers(), saved):
            buf.copy_(value)
    shape = (tuple(tokens.shape), tuple(doc_ids.shape))

    def loss(tokens: Tensor, doc_ids: Tensor) -> Tensor:
        if (tuple(tokens.shape), tuple(doc_ids.shape)) != shape:
            raise ValueError(f"trainer.cuda_graphs=true: the step was captured for batches of shape {shape[0]}, "
                             f"got {tuple(tokens.shape)}; every training batch must have one shape "
                             "(or set trainer.cuda_graphs=false)")
        return graphed(tokens, doc_ids).clone()

    return loss
