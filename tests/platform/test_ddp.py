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

import lightning as L
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


def train(module, model, rows: slice, after_backward=None):
    """STEPS updates on `rows` of every batch; `model` is the module itself or its DDP wrapper;
    `after_backward()` runs between the backward and the optimizer step (trainer.grad_sync=flat's average)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.5)  # linear in the gradient: no amplified rounding (AdamW is)
    moes = [m for _, m in module.model.moe_layers()]
    record = {"loss": [], "grads": [], "load": [], "bias": []}
    for tokens, docs in batches():
        tokens, docs = tokens[rows], docs[rows]
        logits = model(tokens[:, :-1], docs[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # under DDP: gradients averaged over ranks
        if after_backward is not None:
            after_backward()
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


def _rank(rank: int, world: int, init_file: str, out_dir: str, comm: str = "fp32", sync: str = "ddp") -> None:
    from platform.parallel import all_reduce_gradients, broadcast_from_rank0
    from platform.train import ddp_comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        module = make_module().train()
        half = B // world
        rows = slice(rank * half, (rank + 1) * half)
        if sync == "flat":  # trainer.grad_sync=flat: no wrapper; rank 0's weights, then one all-reduce per step
            if rank > 0:  # a rank that starts elsewhere is brought to rank 0's weights
                with torch.no_grad():
                    for p in module.parameters():
                        p.add_(1.0)
            broadcast_from_rank0(module)
            ddp = None
            record = train(module, module, rows, lambda: all_reduce_gradients(module.parameters(), comm))
            # no copy back: every gradient is a view of the one averaged buffer
            record["grad_buffers"] = len({p.grad.untyped_storage().data_ptr() for p in module.parameters()})
        else:
            ddp = DistributedDataParallel(module)  # buffers: broadcast from rank 0, except the ignored loads
            if ddp_comm_hook(comm) is not None:  # trainer.ddp_comm, as Lightning's DDP strategy registers it
                ddp.register_comm_hook(None, ddp_comm_hook(comm))
            record = train(module, ddp, rows)
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        del ddp
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sync", ["ddp", "flat"])
def test_two_gloo_ranks_at_half_batch_equal_one_process(tmp_path, sync):
    """trainer.grad_sync=ddp (DistributedDataParallel) and flat (one all-reduce after the backward)."""
    module = make_module().train()
    single = train(module, module, slice(0, B))
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), "fp32", sync), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        for step in range(STEPS):
            torch.testing.assert_close(r["loss"][step], single["loss"][step], rtol=1e-5, atol=1e-6)
            for name, g in single["grads"][step].items():
                torch.testing.assert_close(r["grads"][step][name], g, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
            torch.testing.assert_close(r["bias"][step], single["bias"][step], rtol=0, atol=0)
        for name, p in single["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=1e-4, atol=1e-6, msg=name)
    if sync == "flat":
        assert all(r["grad_buffers"] == 1 for r in ranks)
    for step in range(STEPS):
        # Each rank counted only its own tokens; the update saw their sum, the single process's load.
        assert not torch.equal(ranks[0]["load"][step], ranks[1]["load"][step])
        torch.testing.assert_close(ranks[0]["load"][step] + ranks[1]["load"][step], single["load"][step])
    assert not torch.equal(single["bias"][-1], torch.zeros_like(single["bias"][-1]))


@pytest.mark.parametrize("sync", ["ddp", "flat"])
def test_bf16_gradient_all_reduce_rounds_the_average_once(tmp_path, sync):
    """trainer.ddp_comm=bf16: both ranks hold the same averaged gradient, equal to one process's up to
    bf16 rounding (and not bit-equal to it: the bf16 all-reduce ran)."""
    module = make_module().train()
    single = train(module, module, slice(0, B))
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), "bf16", sync), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    rounded = 0
    for name, g in single["grads"][0].items():  # the first step: same weights on both sides
        a, b = ranks[0]["grads"][0][name], ranks[1]["grads"][0][name]
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, g, rtol=1e-2, atol=1e-2 * g.abs().max().item() + 1e-8, msg=name)
        rounded += int(not torch.equal(a, g))
    assert rounded > 0
    torch.testing.assert_close(ranks[0]["loss"][0], single["loss"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("comm", ["fp32", "bf16"])
def test_flat_sync_averages_bit_equal_to_ddp(tmp_path, comm):
    """trainer.grad_sync=flat and ddp compute the same average (which is why compare's run matching
    ignores grad_sync): every gradient and weight of every step bit-equal."""
    records = {}
    for sync in ("ddp", "flat"):
        out = tmp_path / sync
        out.mkdir()
        mp.spawn(_rank, args=(2, str(out / "init"), str(out), comm, sync), nprocs=2, join=True)
        records[sync] = torch.load(out / "rank0.pt", weights_only=True)
    for step in range(STEPS):
        for name, g in records["ddp"]["grads"][step].items():
            assert torch.equal(records["flat"]["grads"][step][name], g), f"step {step} {name}"
    for name, p in records["ddp"]["params"].items():
        assert torch.equal(records["flat"]["params"][name], p), name


class RankProbe(L.Callback):
    """Starts rank 1 from other weights; saves each rank's first batch and final weights."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def setup(self, trainer, pl_module, stage):  # before the strategy broadcasts rank 0's weights
        if trainer.global_rank == 1:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(1.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.first = batch["tokens"].clone()

    def on_train_end(self, trainer, pl_module):
        torch.save({"first": self.first, "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()}},
                   os.path.join(self.out_dir, f"lightning_rank{trainer.global_rank}.pt"))


def test_flat_sync_strategy_keeps_lightning_ranks_identical(tmp_path):
    """`FlatSyncDDP` (trainer.grad_sync=flat) under Lightning, two CPU processes: rank 1 starts from other
    weights and every rank trains on its own data with AdamW, yet both end with the same weights (the
    broadcast at start and the average of every step), which moved."""
    from platform.parallel import FlatSyncDDP

    windows = [dict(zip(("tokens", "doc_ids"), (t[0], d[0])))
               for t, d in (packed_batch(1, T + 1, VOCAB, n_docs=3, seed=200 + i) for i in range(16))]
    module = make_module()
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FlatSyncDDP(start_method="spawn"), max_steps=3,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[RankProbe(str(tmp_path))])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(windows, batch_size=2))
    ranks = [torch.load(tmp_path / f"lightning_rank{r}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(ranks[0]["first"], ranks[1]["first"])  # each rank its own slice of the data
    for name, p in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][name], p), name
    assert any(not torch.equal(start[n], p) for n, p in ranks[0]["params"].items())


def test_trainer_strategy_registers_the_bf16_hook_only_for_several_processes():
    from lightning.pytorch.strategies import DDPStrategy

    from platform.train import ddp_comm_hook, trainer_strategy

    t = make_cfg("trainer.ddp_comm=bf16", "trainer.devices=2").trainer
    strategy = trainer_strategy(t)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_comm_hook is ddp_comm_hook("bf16")
    assert trainer_strategy(make_cfg("trainer.ddp_comm=bf16").trainer) == "auto"
    assert trainer_strategy(make_cfg("trainer.devices=2").trainer) == "auto"


def test_trainer_strategy_of_flat_sync():
    from platform.parallel import FlatSyncDDP
    from platform.train import trainer_strategy

    strategy = trainer_strategy(make_cfg("trainer.grad_sync=flat", "trainer.ddp_comm=bf16", "trainer.devices=2").trainer)
    assert isinstance(strategy, FlatSyncDDP) and strategy.comm == "bf16"
    assert trainer_strategy(make_cfg("trainer.grad_sync=flat").trainer) == "auto"  # one process: nothing to average
    # auto: flat with CUDA graphs (a config built here: a CPU refuses trainer.cuda_graphs at composition)
    graphed = make_cfg("trainer.devices=2").trainer
    graphed.cuda_graphs = True
    assert isinstance(trainer_strategy(graphed), FlatSyncDDP) and trainer_strategy(graphed).comm == "fp32"
    assert trainer_strategy(make_cfg("trainer.devices=2", "trainer.grad_sync=auto").trainer) == "auto"  # eager: DDP
    assert not isinstance(trainer_strategy(make_cfg("trainer.devices=2", "trainer.grad_sync=ddp").trainer), FlatSyncDDP)


@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_of_a_step_are_the_single_process_batch(world):
    """The training sampler gives rank r the r-th slice of what one process takes at world x the batch."""
    one = list(StepSampler(53, 8, seed=3, max_steps=9))
    parts = [list(StepSampler(53, 8 // world, seed=3, max_steps=9, rank=r, world_size=world)) for r in range(world)]
    for step in range(9):
        joined = sum((p[step * (8 // world):(step + 1) * (8 // world)] for p in parts), [])
        assert joined == one[step * 8:(step + 1) * 8]
    assert np.unique(one).size == 53  # and the steps do walk through every window
