"""GPU checks (skipped without CUDA): grouped GEMM in bf16, a bf16 training step per residual."""

import math

import pytest
import torch

import residuals
from tests.helpers import build_backbone, make_cfg, packed_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_grouped_mm_bf16_matches_sliced_on_gpu():
    from platform.moe import MoE

    torch.manual_seed(0)
    fast = MoE(256, 16, 4, 128, 1, 1e-3, impl="grouped_mm").cuda()
    for p in fast.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ref = MoE(256, 16, 4, 128, 1, 1e-3, impl="sliced").cuda()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(4099, 256, device="cuda")
    g = torch.randn(4099, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, y2 = fast(x), ref(x)
    rel = (y.float() - y2.float()).norm() / y2.float().norm()
    assert rel < 2e-2, rel
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (fast(x1).float() * g).sum().backward()
        (ref(x2).float() * g).sum().backward()
    assert (x1.grad - x2.grad).norm() / x2.grad.norm() < 3e-2


@pytest.mark.parametrize("name", residuals.names())
def test_bf16_step_every_residual(name):
    model = build_backbone(name, vocab=512).cuda()
    tokens, docs = packed_batch(4, 128, 512)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens.cuda(), docs.cuda())
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.cuda().roll(-1, 1).flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["msar_block", "attnres_block", "mhc"])
def test_fused_backend_run_finishes_and_records_depth_weights_on_gpu(name, tmp_path):
    # residual.backend=triton used to train to the end and then fail in the end-of-run recording
    # (Lightning leaves the module on the CPU after fit; the fused op runs on CUDA only), marking the
    # run FAILED. Recording now runs where the run trained.
    import mlflow

    from platform.train import train
    from tests.platform.test_train import FAST

    cfg = make_cfg(*FAST, "trainer=gpu", "trainer.compile=false", f"residual={name}", "residual.backend=triton",
                   "trainer.max_steps=3", "trainer.val_every=3", "mlflow.depth_heatmaps=true",
                   f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db")
    result = train(cfg, run_dir=tmp_path / "run")
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert run.info.status == "FINISHED", run.info.status
    assert any(a.path.endswith("depth_attention.json") for a in client.list_artifacts(run.info.run_id, "plots"))
    assert math.isfinite(result.val_loss)


@pytest.mark.parametrize("name", ["vanilla", "attnres_block", "mhc", "msar_block"])
def test_training_run_compiled_whole_matches_eager_on_gpu(name, tmp_path):
    """trainer=gpu as shipped (the whole forward compiled, trainer.compile_scope=model, its Inductor settings,
    CUDA graphs) trains to the losses of the same run uncompiled, step by step; attnres_block's, mhc's and
    msar_block's fused ops are graph breaks (mhc's write compiled per layer; msar_block's sources in a buffer
    that the op reads in place)."""
    from platform.train import train
    from tests.platform.test_train import FAST, LossRecorder

    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        rec = LossRecorder()
        cfg = make_cfg(*FAST, "trainer=gpu", f"trainer.compile={compiled}", "trainer.compile_scope=model",
                       f"residual={name}", "trainer.max_steps=6", "trainer.val_every=6", "mlflow.enabled=false",
                       "seed=3")
        train(cfg, callbacks=[rec], run_dir=tmp_path / f"compiled{compiled}")
        runs[compiled] = rec.losses
    assert sorted(runs[True]) == sorted(runs[False]) and len(runs[True]) >= 6
    for step in runs[False]:
        assert abs(runs[True][step] - runs[False][step]) < 2e-2 * abs(runs[False][step]), (step, runs)
