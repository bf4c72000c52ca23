"""Data parallelism on CPU (gloo): two ranks at half the batch train exactly like one process.

Each rank holds the same seeded LMModule, wrapped in DistributedDataParallel as Lightning wraps it
(honouring the module's list of buffers DDP must leave alone), takes its half of every batch, and
runs the update of `LMModule.optimizer_step`: an optimizer step (SGD here: linear in the gradient,
whereas AdamW's normalisation blows rounding noise in near-zero gradients up to a full step), then
the routing-bias update from the load all-reduced over ranks. The losses (mean over ranks), the
gradients, the routing biases and the weights must match one process on the whole batch, step
after step.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from data.datamodule import StepSampler
from platform.moe import update_biases
from tests.helpers import make_cfg, packed_batch

VOCAB, B, T, STEPS = 67, 4, 40, 3
OVERRIDES = ("model=tiny", "residual=vanilla", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
             f"model.seq_len={T}", "model.n_experts=6", "model.top_k=2", "model.expert_hidden=16",
             "model.bias_update_rate=0.05", "trainer.grad_clip=0")  # a large bias step: routing moves


def make_module():
    from platform.config import residual_config
    from platform.module import LMModule

    cfg = make_cfg(*OVERRIDES)
    torch.manual_seed(0)
    return LMModule(cfg.model, cfg.trainer, residual_config(cfg), vocab_size=VOCAB)


def batches():
    out = []
    for step in range(STEPS):
        tokens, docs = packed_batch(B, T + 1, VOCAB, n_docs=3, seed=100 + step)
        out.append((tokens, docs))
    return out


def train(module, model, rows: slice):
    """STEPS updates on `rows` of every batch; `model` is the module itself or its DDP wrapper."""
    opt = torch.optim.SGD(module.parameters(), lr=0.5)  # linear in the gradient: no amplified rounding (AdamW is)
    moes = [m for _, m in module.model.moe_layers()]
    record = {"loss": [], "grads": [], "load": [], "bias": []}
    for tokens, docs in batches():
        tokens, docs = tokens[rows], docs[rows]
        logits = model(tokens[:, :-1], docs[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # under DDP: gradients averaged over ranks
        mean_loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean_loss)
            mean_loss /= dist.get_world_size()
        record["loss"].append(mean_loss)
        record["grads"].append({n: p.grad.clone() for n, p in module.named_parameters()})
        record["load"].append(torch.stack([m.load.clone() for m in moes]))
        opt.step()
        update_biases(moes)  # what LMModule.optimizer_step does after the optimizer
        record["bias"].append(torch.stack([m.bias.clone() for m in moes]))
    record["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return record


def _rank(rank: int, world: int, init_file: str, out_dir: str, comm: str = "fp32") -> None:
    from platform.train import ddp_comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        module = make_module().train()
        ddp = DistributedDataParallel(module)  # buffers: broadcast from rank 0, except the ignored loads
        if ddp_comm_hook(comm) is not None:  # trainer.ddp_comm, as Lightning's DDP strategy registers it
            ddp.register_comm_hook(None, ddp_comm_hook(comm))
        half = B // world
        record = train(module, ddp, slice(rank * half, (rank + 1) * half))
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        del ddp
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_at_half_batch_equal_one_process(tmp_path):
    module = make_module().train()
    single = train(module, module, slice(0, B))
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        for step in range(STEPS):
            torch.testing.assert_close(r["loss"][step], single["loss"][step], rtol=1e-5, atol=1e-6)
            for name, g in single["grads"][step].items():
                torch.testing.assert_close(r["grads"][step][name], g, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
            torch.testing.assert_close(r["bias"][step], single["bias"][step], rtol=0, atol=0)
        for name, p in single["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=1e-4, atol=1e-6, msg=name)
    for step in range(STEPS):
        # Each rank counted only its own tokens; the update saw their sum, the single process's load.
        assert not torch.equal(ranks[0]["load"][step], ranks[1]["load"][step])
        torch.testing.assert_close(ranks[0]["load"][step] + ranks[1]["load"][step], single["load"][step])
    assert not torch.equal(single["bias"][-1], torch.zeros_like(single["bias"][-1]))


def test_bf16_gradient_all_reduce_rounds_the_average_once(tmp_path):
    """trainer.ddp_comm=bf16: both ranks hold the same averaged gradient, equal to one process's up to
    bf16 rounding (and not bit-equal to it: the hook ran)."""
    module = make_module().train()
    single = train(module, module, slice(0, B))
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), "bf16"), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    rounded = 0
    for name, g in single["grads"][0].items():  # the first step: same weights on both sides
        a, b = ranks[0]["grads"][0][name], ranks[1]["grads"][0][name]
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, g, rtol=1e-2, atol=1e-2 * g.abs().max().item() + 1e-8, msg=name)
        rounded += int(not torch.equal(a, g))
    assert rounded > 0
    torch.testing.assert_close(ranks[0]["loss"][0], single["loss"][0], rtol=1e-5, atol=1e-6)


def test_trainer_strategy_registers_the_bf16_hook_only_for_several_processes():
    from lightning.pytorch.strategies import DDPStrategy

    from platform.train import ddp_comm_hook, trainer_strategy

    t = make_cfg("trainer.ddp_comm=bf16", "trainer.devices=2").trainer
    strategy = trainer_strategy(t)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_comm_hook is ddp_comm_hook("bf16")
    assert trainer_strategy(make_cfg("trainer.ddp_comm=bf16").trainer) == "auto"
    assert trainer_strategy(make_cfg("trainer.devices=2").trainer) == "auto"


@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_of_a_step_are_the_single_process_batch(world):
    """The training sampler gives rank r the r-th slice of what one process takes at world x the batch."""
    one = list(StepSampler(53, 8, seed=3, max_steps=9))
    parts = [list(StepSampler(53, 8 // world, seed=3, max_steps=9, rank=r, world_size=world)) for r in range(world)]
    for step in range(9):
        joined = sum((p[step * (8 // world):(step + 1) * (8 // world)] for p in parts), [])
        assert joined == one[step * 8:(step + 1) * 8]
    assert np.unique(one).size == 53  # and the steps do walk through every window
