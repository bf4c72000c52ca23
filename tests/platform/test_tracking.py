"""The shared run plumbing: a fresh MLflow SQLite store opened by several processes at once, the
rename map of residuals, and the environment of worker processes."""

import os
import subprocess
import sys
import time

import pytest

from platform import env, tracking
from tests.helpers import ROOT

# Each process imports everything first, then waits for the go file, so that all of them open the
# fresh store within a few milliseconds of each other (where MLflow's own creation races).
OPEN_STORE = """
import sys, time
from pathlib import Path
from omegaconf import OmegaConf
from platform import tracking
import mlflow
uri, go = sys.argv[1], Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
client, _, exp_id = tracking.open_experiment(OmegaConf.create({"mlflow": {"tracking_uri": uri,
                                                                          "experiment": "residuals"}}))
run = client.create_run(exp_id)
client.set_terminated(run.info.run_id, "FINISHED")
print("exp", exp_id)
"""


def test_processes_creating_one_fresh_store_at_once_all_succeed(tmp_path):
    uri, go = f"sqlite:///{tmp_path}/fresh/mlflow.db", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_STORE, uri, str(go)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(4)  # let the imports finish (they are what takes time), then start all at once
    go.touch()
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert len({out.split()[-1] for out, _ in outs}) == 1  # one experiment, created once
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("residuals")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}


def test_rename_map_follows_chains_and_lists_old_names(monkeypatch):
    monkeypatch.setattr(tracking, "RENAMED", {"msar_blk": "msar_block_v1", "msar_block_v1": "msar_block",
                                              "plain": "vanilla"})
    assert tracking.canonical_residual("msar_blk") == "msar_block"
    assert tracking.canonical_residual("msar_block") == "msar_block"
    assert tracking.logged_names("msar_block") == ["msar_block", "msar_blk", "msar_block_v1"]
    assert tracking.logged_names("plain") == ["vanilla", "plain"]
    monkeypatch.setattr(tracking, "RENAMED", {"a": "b", "b": "a"})
    with pytest.raises(ValueError, match="cycle"):
        tracking.canonical_residual("a")


def test_worker_env_gives_one_gpu_each_and_keeps_multicast_off():
    base = {"PATH": "/bin", "NCCL_NVLS_ENABLE": "0"}
    w0, w1, w2 = (env.worker_env(i, ["2", "5"], base) for i in range(3))
    assert (w0["CUDA_VISIBLE_DEVICES"], w1["CUDA_VISIBLE_DEVICES"], w2["CUDA_VISIBLE_DEVICES"]) == ("2", "5", "2")
    for w, i in ((w0, 0), (w1, 1), (w2, 2)):
        assert w["PLATFORM_WORKER_INDEX"] == str(i) and w["MLFLOW_DISABLE_TELEMETRY"] == "true"
        assert (w["NCCL_NVLS_ENABLE"], w["TORCH_SYMM_MEM_DISABLE_MULTICAST"], w["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
    assert {w["PLATFORM_SHARED_BY"] for w in (w0, w1, w2)} == {"1"}  # workers=1 unless said
    assert env.worker_env(0, ["2", "5"], base, workers=3)["PLATFORM_SHARED_BY"] == "2"  # 3 runs on 2 GPUs
    assert env.worker_env(0, [], base, workers=3)["PLATFORM_SHARED_BY"] == "3"  # 3 runs on one CPU
    cpu = env.worker_env(1, [], base)
    assert "CUDA_VISIBLE_DEVICES" not in cpu and "NVSHMEM_DISABLE_NVLS" not in cpu
    assert cpu["PLATFORM_WORKER_INDEX"] == "1" and base == {"PATH": "/bin", "NCCL_NVLS_ENABLE": "0"}
    assert env.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}) == ["3", "1"]
    assert env.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_run_tags_say_what_trained_the_run():
    from platform import tracking
    from platform.env import machine_description

    tags = tracking.run_tags()
    assert tags[tracking.DEVICE_TAG] == machine_description() and tags[tracking.DEVICE_TAG]
    assert tags[tracking.SHARED_TAG] == os.environ.get("PLATFORM_SHARED_BY", "1")
