"""CUDA-graphed training steps (`trainer.cuda_graphs`, platform/graphs.py) against eager ones (GPU only).

The graph records one batch shape and replays it: the tests feed a different batch every step (the
inputs are copied in), compare losses, gradients and the routing loads with the eager model, and
check gradient accumulation, where the graph's gradient buffers would otherwise be overwritten.
"""

import copy

import pytest
import torch

import residuals
from tests.helpers import build_backbone, packed_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 512


def batches(n, B=4, T=129, seed=0):
    return [tuple(t.cuda() for t in packed_batch(B, T, VOCAB, n_docs=3, seed=seed + i)) for i in range(n)]


def moe_loads(model):
    return torch.cat([m.load for _, m in model.moe_layers()])


@pytest.mark.parametrize("name", residuals.names())
def test_graphed_steps_match_eager_steps(name):
    from platform.graphs import TrainLoss, graphed_loss

    torch.manual_seed(0)
    eager = build_backbone(name, vocab=VOCAB).cuda().train()
    graphed = copy.deepcopy(eager)
    data = batches(3)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (eager, graphed)]
    eager_loss = TrainLoss(eager)
    with autocast:
        graph_loss = graphed_loss(graphed, *data[0])
    # the warm-up and capture passes leave the routing loads as they were
    assert torch.equal(moe_loads(graphed), moe_loads(eager))
    for step, (tokens, docs) in enumerate(data):
        losses, grads = [], []
        g = torch.randn((), device="cuda")  # a random upstream gradient, the same for both
        for model, fn, opt in zip((eager, graphed), (eager_loss, graph_loss), opts):
            with autocast:
                loss = fn(tokens, docs)
            (loss * g).backward()
            losses.append(loss.detach().float())
            grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]))
            # what each replay added to the routing loads: one forward's assignments, like eager
            total = moe_loads(model).sum()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert total == (step + 1) * tokens[:, :-1].numel() * model.cfg.top_k * len(model.moe_layers())
        assert torch.allclose(losses[0], losses[1], rtol=2e-3), (step, losses)
        assert grads[0].shape == grads[1].shape
        rel = (grads[0] - grads[1]).norm() / grads[0].norm()
        assert rel < 3e-2, (step, float(rel))


def _msar_residuals():
    from residuals.msar import Msar

    return [n for n in residuals.names() if issubclass(residuals.get(n), Msar)]


@pytest.mark.parametrize("name", _msar_residuals())
def test_graphed_steps_with_reads_packing_their_own(name, monkeypatch):
    # the generic test above runs the default, Msar.pack_step (since 2026-12-07: what every read takes from its
    # parameters and the document ids made once a step at begin, kernels.msar_attn.pack_reads); this one the reads
    # packing their own (pack_step=False), captured in the graph and replayed as the eager step does
    from residuals.msar import Msar

    monkeypatch.setattr(Msar, "pack_step", False)
    test_graphed_steps_match_eager_steps(name)


def test_graphed_loss_reads_weights_and_routing_biases_changed_in_place():
    from platform.graphs import TrainLoss, graphed_loss

    torch.manual_seed(0)
    model = build_backbone("vanilla", vocab=VOCAB).cuda().train()
    tokens, docs = batches(1)[0]
    with torch.autocast("cuda", dtype=torch.bfloat16):  # the grouped GEMM is capturable in bf16 only
        fn = graphed_loss(model, tokens, docs)
        before = fn(tokens, docs)
        with torch.no_grad():  # in place, as the optimizer and the balancing update do: the replay must see it
            for p in model.parameters():
                p.mul_(1.5)
            for _, moe in model.moe_layers():
                moe.bias.copy_(torch.randn_like(moe.bias))
        after = fn(tokens, docs)
        eager = TrainLoss(model)(tokens, docs)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, eager, rtol=1e-3)


def test_graphed_loss_refuses_another_batch_shape():
    from platform.graphs import graphed_loss

    model = build_backbone("vanilla", vocab=VOCAB).cuda().train()
    tokens, docs = batches(1)[0]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fn = graphed_loss(model, tokens, docs)
    with pytest.raises(ValueError, match=r"captured for batches of shape \(4, 129\), got \(4, 65\)"):
        fn(tokens[:, :65], docs[:, :65])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_run_with_cuda_graphs_matches_eager(accumulate, tmp_path):
    from platform.train import train
    from tests.helpers import make_cfg
    from tests.platform.test_train import FAST, LossRecorder

    runs = {}
    for graphs in (False, True):
        rec = LossRecorder()
        cfg = make_cfg(*FAST, "trainer=gpu", "trainer.compile=false", f"trainer.cuda_graphs={graphs}",
                       "residual=attnres_block", "trainer.max_steps=6", "trainer.val_every=6",
                       f"trainer.accumulate_grad_batches={accumulate}", "mlflow.enabled=false", "seed=3")
        train(cfg, callbacks=[rec], run_dir=tmp_path / f"graphs{graphs}")
        runs[graphs] = rec.losses
    assert sorted(runs[True]) == sorted(runs[False]) and len(runs[True]) >= 6
    for step in runs[False]:
        assert abs(runs[True][step] - runs[False][step]) < 2e-2 * abs(runs[False][step]), (step, runs)
