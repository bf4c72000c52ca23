"""Gradient averaging over data-parallel ranks after the backward: one all-reduce per dtype (`trainer.grad_sync=flat`).

PyTorch's DistributedDataParallel averages gradients *during* the backward: autograd hooks fill
25 MB buckets as gradients arrive and launch one all-reduce per bucket, so the communication of the
last layers overlaps the backward of the first. With `trainer.cuda_graphs` that overlap is gone:
the captured backward hands every gradient to autograd at its very end, and what remains of DDP is
its cost, a hook and a bucket copy per parameter run on the host after the replay, with the GPU
waiting (two H200s at `small`: 21.6 ms a step on one GPU, 25.6 on two, and halving the bytes with
a bf16 all-reduce changed nothing; docs/gpu.md).

`trainer.grad_sync=flat` replaces it with what is left to do once the backward has finished:

    flat = cat(every gradient)        one copy kernel      (P,) per dtype
    flat /= world; all_reduce(flat)   one collective       (in bf16 with trainer.ddp_comm=bf16)
    p.grad <- its view of flat        no kernel

`FlatSyncDDP` is Lightning's DDP strategy without the DistributedDataParallel wrapper: the same
process launch, sampler slices, rank-0 broadcast of the weights at start (minus the per-rank
routing loads `LMModule` lists) and collectives, with the average taken in `optimizer_step`,
after the last micro-batch's backward and before Lightning's gradient clipping. Each rank averages
the same numbers in the same order as DDP's buckets do (divide by the world size, then sum), so
both give the same fp32 gradients; the difference is when and in how many messages.
Measured on two H200s at `small`, graphed (`throughput_small_ddp2_sync.md`): scaling efficiency 0.850
with DDP's buckets, 0.894 flat, 0.907 flat with the all-reduce in bf16 (then with a copy back into each
gradient); with the views, 0.907 and 0.917 (`throughput_small_ddp2_sync_views.md`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor


def resolve(grad_sync: str, cuda_graphs: bool) -> str:
    """``trainer.grad_sync`` resolved: ``auto`` is ``flat`` with CUDA graphs (the graphed backward hands
    every gradient over at its end, so DDP's bucket hooks have nothing left to overlap and cost host
    time), else ``ddp``."""
    if grad_sync == "auto":
        return "flat" if cuda_graphs else "ddp"
    return grad_sync


@torch.no_grad()
def all_reduce_gradients(params: Iterable[Tensor], comm: str = "fp32", group=None) -> None:
    """Average the `.grad` of `params` over the ranks of `group`, in place: one flat all-reduce per
    gradient dtype. Every rank must pass the same parameters in the same order; a parameter without a
    gradient on this rank contributes zeros and receives the average (so ranks never diverge).
    ``comm``: "fp32" averages in the gradients' dtype, "bf16" sends bf16 (half the bytes of fp32, a
    relative rounding of 2^-8 on the average, as `trainer.ddp_comm=bf16` does under DDP)."""
    if comm not in ("fp32", "bf16"):
        raise ValueError(f"comm={comm!r}: not a known choice; valid: fp32, bf16")
    params = [p for p in params if p.requires_grad]
    world = dist.get_world_size(group)
    if world == 1 or not params:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for owners in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in owners])  # (P,) one copy
        send = flat.to(torch.bfloat16) if comm == "bf16" else flat
        send.div_(world)  # as DDP: divide, then sum (no AVG on gloo)
        dist.all_reduce(send, group=group)
        if send is not flat:
            flat.copy_(send)
        # each gradient becomes its view of the averaged buffer (no copy back): the optimizer reads
        # the views; the next step's backward writes fresh gradients (or, accumulating, adds into
        # these views in place, and zero_grad zeroes them in place)
        for p, part in zip(owners, flat.split([p.numel() for p in owners])):
            p.grad = part.view_as(p)


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """What DDP's constructor does for the weights: rank 0's parameters and buffers on every rank, except
    those named in the module's ``_ddp_params_and_buffers_to_ignore`` (LMModule: the per-rank routing loads)."""
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(module)


class FlatSyncDDP(DDPStrategy):
    """Lightning's DDP (launch, ranks, samplers, collectives) without the DistributedDataParallel
    wrapper: the weights are broadcast from rank 0 once, and the gradients averaged by
    `all_reduce_gradients` after the backward, before clipping and the optimizer step."""

    def __init__(self, comm: str = "fp32", **kwargs: Any):
        super().__init__(**kwargs)
        self.comm = comm

    def configure_ddp(self) -> None:
        broadcast_from_rank0(self.model)

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        def forward_backward_then_average():
            out = closure()  # the last micro-batch's forward and backward
            all_reduce_gradients([p for group in optimizer.param_groups for p in group["params"]], self.comm)
            return out

        return super().optimizer_step(optimizer, forward_backward_then_average, model, **kwargs)
