"""One home for what every entry point shares: the repo root, the offline/telemetry environment
defaults, the environment of a worker process, and a one-line description of the machine.

Import it before MLflow, Hugging Face `datasets` or Lightning: `set_offline_defaults()` must run
before those read their environment. Nothing here imports a heavy library at module level.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent

# Set unless the user set them: no telemetry call from MLflow, no network from Hugging Face.
OFFLINE_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
}

# NVLink multicast must stay off on the GPU hosts we run on (NCCL, torch symmetric memory, NVSHMEM);
# every worker process we start gets these unless the user set them otherwise.
GPU_SAFE_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def set_offline_defaults(environ: dict | None = None) -> None:
    """`setdefault` each of OFFLINE_DEFAULTS in `environ` (default: this process's environment)."""
    target = os.environ if environ is None else environ
    for key, value in OFFLINE_DEFAULTS.items():
        target.setdefault(key, value)


set_offline_defaults()  # importing this module is enough; the call sites also call it to say so


def repo_path(path: str | os.PathLike) -> Path:
    """A user-given path: absolute as is, relative to the repo root otherwise (commands run from it)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this process may hand to workers: CUDA_VISIBLE_DEVICES when set, else every GPU
    torch sees (counted through NVML; CUDA is not initialised here), else none (a CPU machine)."""
    environ = os.environ if environ is None else environ
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch or no driver: a CPU machine
        return []


SHARED_ENV = "PLATFORM_SHARED_BY"  # how many runs share this run's device (runs record it: their timings)


def shared_by(workers: int, gpus: list[str]) -> int:
    """Runs at once on one device when `workers` run side by side: GPUs round robin, else the CPU."""
    return max(1, -(-workers // len(gpus))) if gpus else max(1, workers)


def worker_env(index: int, gpus: list[str], base: Mapping[str, str] | None = None,
               workers: int = 1) -> dict[str, str]:
    """The environment of worker `index` of `workers`: one GPU of `gpus` (round robin) and the GPU-safe
    defaults when there are GPUs; on a CPU machine the same environment (plus the worker index). It
    also says how many runs share the device (`PLATFORM_SHARED_BY`), which each run records."""
    env = dict(os.environ if base is None else base)
    set_offline_defaults(env)
    env["PLATFORM_WORKER_INDEX"] = str(index)
    env[SHARED_ENV] = str(shared_by(workers, gpus))
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
        for key, value in GPU_SAFE_DEFAULTS.items():
            env.setdefault(key, value)
    return env


def check_workers(workers: int, gpus: list[str], devices: int, key: str) -> None:
    """Workers get one GPU each: more workers than GPUs share them round robin (said, not refused);
    a multi-GPU run per worker is refused (`trainer.devices` must be 1)."""
    if workers < 1:
        raise ValueError(f"{key}={workers} must be >= 1")
    if gpus and devices > 1:
        raise ValueError(f"{key}={workers} with trainer.devices={devices}: each worker gets one GPU; "
                         "set trainer.devices=1 (or run one worker)")
    if gpus and workers > len(gpus):
        print(f"note: {key}={workers} workers on {len(gpus)} GPU(s) {','.join(gpus)}: GPUs are shared round robin",
              flush=True)


def run_in_slots(jobs: Sequence[T], workers: int, gpus: list[str],
                 launch: Callable[[T, dict[str, str], bool], int]) -> list[int]:
    """Run ``launch(job, env, parallel)`` for every job, ``workers`` at a time, in order; returns the exit
    codes in job order. A queue of worker slots: slot i's environment holds GPU i (round robin over
    ``gpus``; none on a CPU machine). With one worker the jobs run one after the other and each sees every
    GPU; ``parallel`` says whether others run beside it (e.g. to send its output to a log file)."""
    slots: queue.Queue[int] = queue.Queue()
    for i in range(workers):
        slots.put(i)

    def one(job):
        slot = slots.get()
        try:
            return launch(job, worker_env(slot, gpus if workers > 1 else [], workers=workers), workers > 1)
        finally:
            slots.put(slot)

    if workers == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


def worker_index(environ: Mapping[str, str] | None = None) -> int:
    """This process's worker index (0 when it was not started as a worker)."""
    return int((os.environ if environ is None else environ).get("PLATFORM_WORKER_INDEX", "0"))


def machine_description() -> str:
    """`2x NVIDIA H200` or `16-core CPU (x86_64), torch 2.13.0`: the line reports carry."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    import platform  # this package, which carries the standard library's platform functions

    return f"{os.cpu_count()}-core CPU ({platform.machine()}), torch {torch.__version__}"
