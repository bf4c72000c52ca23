"""Typed configuration: the schema of every config node, registered in Hydra's ConfigStore.

Typed nodes make a misspelt key fail at composition (on the command line and inside presets).
Residual nodes are generated from the residual registry, so the `residual=` options never drift
from the code; ablation presets are generated from the ablation registry.
:func:`validate` checks every value that composition cannot (divisibility, ranges, choices) and
raises before any compute, naming the bad value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from data.config import DataConfig
from data.config import validate as validate_data

from .env import REPO_ROOT  # noqa: F401 - re-exported: platform.config.REPO_ROOT
from .errors import ConfigError


@dataclass
class ModelConfig:
    """Sizes of the shared MoE backbone (docs/method.md §6). `conf/model/*.yaml` fill these in."""

    name: str = "tiny"
    d_model: int = 64  # hidden size d
    n_blocks: int = 4  # Transformer blocks; sublayers L = 2 * n_blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (GQA); divides n_heads
    seq_len: int = 128  # tokens per training window
    dense_hidden: int = 192  # SwiGLU hidden size of the first (dense) block
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # routed experts per token
    n_shared: int = 1  # shared experts (always on)
    expert_hidden: int = 64  # SwiGLU hidden size of each (fine-grained) expert
    bias_update_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimizer step
    route_scale: float = 1.0  # multiplies the renormalised gates
    rope_theta: float = 10000.0
    init_std: float = 0.02
    norm_eps: float = 1e-6
    moe_impl: str = "grouped_mm"  # "grouped_mm" (one grouped GEMM per projection) | "sliced" (reference)
    moe_topk: str = "argmax"  # the router's expert choice: "argmax" (k argmax rounds, fused by Inductor) | "topk"
    doc_mask: bool = True  # attention never crosses a document boundary in packed windows
    checkpoint_reads: bool = False  # recompute the residual's read in backward where it stores views (reference reads; never a fused op)
    attention: str = "auto"  # "flex" (FlexAttention, block mask) | "sdpa" (dense-mask reference) | "auto" (flex on CUDA)
    recompute: str = "none"  # sublayers re-run in backward: "none" | "attention" | "mlp" | "full"
    # FlexAttention's kernel tiles on CUDA (`python -m benchmarks.flex_tiles` times them); empty: PyTorch's
    # defaults. forward: [BLOCK_M, BLOCK_N, warps, stages]; backward: [BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2,
    # warps, stages]. Block sizes divide the block mask's 128-token tiles.
    flex_fwd: list[int] = field(default_factory=list)
    flex_bwd: list[int] = field(default_factory=list)


@dataclass
class TrainerConfig:
    """Optimisation and hardware. `conf/trainer/{cpu,gpu}.yaml`."""

    accelerator: str = "cpu"  # "cpu" | "gpu" | "auto"
    devices: int = 1
    num_nodes: int = 1  # hosts of `devices` GPUs each (torchrun or SLURM starts one process per GPU)
    precision: str = "32-true"  # "32-true" | "bf16-mixed" | "16-mixed"
    max_steps: int = 300
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    accumulate_grad_batches: int = 1
    val_every: int = 50  # steps between validations
    val_batches: int = 8  # batches per validation
    log_every: int = 10  # steps between logged train metrics
    ckpt_every: int = 100  # steps between checkpoints (last.ckpt is always kept)
    progress_bar: bool = True
    threads: int = 0  # CPU intra-op threads (0: leave torch's default)
    compile: bool = False  # torch.compile each attention and MLP sublayer and the loss (the residual stays eager)
    # what trainer.compile compiles: "sublayers" (each sublayer and the loss; the residual eager) | "model"
    # (the whole forward below the attention mask, residual included, and the loss: docs/gpu.md)
    compile_scope: str = "sublayers"
    # Inductor settings for that compile, passed as torch.compile(options=...), e.g.
    # +trainer.compile_options.combo_kernels=true; keys are torch._inductor.config's (checked before any compute)
    compile_options: dict[str, Any] = field(default_factory=dict)
    cuda_graphs: bool = False  # replay the training forward + backward as CUDA graphs (platform/graphs.py; GPU only)
    ddp_comm: str = "fp32"  # gradient all-reduce under DDP: "fp32" (exact) | "bf16" (half the bytes; docs/gpu.md)
    # how several processes average gradients: "ddp" (DistributedDataParallel's buckets, during the backward) |
    # "flat" (one all-reduce after the backward: platform/parallel.py) | "auto" (flat with cuda_graphs, whose
    # backward hands over every gradient at its end, else ddp; docs/gpu.md)
    grad_sync: str = "auto"


@dataclass
class MlflowConfig:
    enabled: bool = True
    tracking_uri: Optional[str] = None  # default: sqlite:///<repo>/mlruns/mlflow.db
    experiment: str = "residuals"
    run_name: Optional[str] = None
    depth_heatmaps: bool = True  # log depth-attention heatmaps at the end of a run


@dataclass
class AblationInfo:
    """Filled by an ablation preset (`ablation=<name>`): what it answers and against what."""

    name: str = MISSING
    question: str = MISSING
    baseline: str = MISSING  # the residual / ablation it is compared with
    changes: str = MISSING  # human-readable summary of the config it changes
    paper: str = ""  # the paper's reported number, where there is one


@dataclass
class SweepParam:
    """One searched config value (`conf/sweep/*.yaml`, under `sweep.params.<name>`; see platform/sweep/space.py)."""

    key: str = MISSING  # the config key it sets, e.g. "trainer.lr" or "residual.kernels"
    type: str = MISSING  # "int" | "float" | "categorical" | "kernel_set"
    low: Optional[float] = None  # int/float: bounds (inclusive); kernel_set: smallest kernel size
    high: Optional[float] = None  # int/float: bounds (inclusive); kernel_set: largest kernel size
    step: Optional[float] = None  # int/float: grid step (int default 1)
    log: bool = False  # int/float/kernel_set: sample on a log scale
    choices: Optional[list[Any]] = None  # categorical: the values; kernel_set: explicit sets (else all valid)
    streams: Optional[list[int]] = None  # kernel_set: [min m, max m], m = 1 + len(kernels)


@dataclass
class SweepConfig:
    """An Optuna study (`python -m platform.sweep sweep=<preset>`); presets live in `conf/sweep/`."""

    study_name: str = MISSING
    storage: Optional[str] = None  # any SQLAlchemy URL; default sqlite:///<repo>/mlruns/optuna.db
    n_trials: int = 20  # finished trials (complete + pruned + failed) the study should reach
    timeout: Optional[float] = None  # seconds for this invocation; no new trial starts after it
    sampler: str = "tpe"  # "tpe" | "random" | "grid"
    pruner: str = "median"  # "median" | "none"
    seed: int = 0  # sampler seed (offset by the number of existing trials on resume)
    startup_trials: int = 4  # TPE: random trials before the model-based ones
    pruner_startup_trials: int = 3  # median pruner: complete trials before any pruning
    pruner_warmup_steps: int = 0  # median pruner: no pruning before this step
    heartbeat_s: int = 60  # trials silent for 2x this are failed, any host (0: off; same-host deaths: by pid)
    max_failures: int = 3  # stop after this many consecutive failed trials
    out_dir: Optional[str] = None  # trial run dirs, plots, report; default outputs/sweeps/<study_name>
    report: Optional[str] = None  # also write the study's markdown table here
    workers: int = 1  # worker processes running this study in parallel (one per GPU; N processes on CPU)
    # The search space, by Optuna parameter name; each entry is a SweepParam, checked by platform.sweep before
    # any trial (typed as Any so that `+sweep.params.<name>={...}` can add one from the command line).
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    residual: Any = MISSING  # a typed node generated from the residual registry
    ablation: Optional[AblationInfo] = None
    sweep: Optional[SweepConfig] = None  # set by a sweep preset (`sweep=<name>`)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    seed: int = 0
    resume: Optional[str] = None  # a checkpoint path, a run dir, or "last"
    plugins: list[str] = field(default_factory=list)  # modules that register extra residuals
    name: Optional[str] = None  # run name suffix (defaults to residual[+ablation])
    # Extra Lightning callbacks, each a Hydra node {_target_: import.path, arg: value}; added to the
    # platform's own (checkpointing, progress bar). See docs/running.md.
    callbacks: list[Any] = field(default_factory=list)


def register_configs() -> None:
    """Store the schemas and the registry-generated nodes in Hydra's ConfigStore (idempotent)."""
    import ablations
    import residuals

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    for name in residuals.names():
        cs.store(group="residual", name=name, node=residuals.config_for(name))
    for ab in ablations.all_ablations():
        cs.store(group="ablation", name=ab.name, node=ab.preset(), package="_global_")


def tracking_uri(cfg: DictConfig | None = None) -> str:
    uri = cfg.mlflow.tracking_uri if cfg is not None else None
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO_ROOT / 'mlruns' / 'mlflow.db'}"


COMPILE_SCOPES = ("sublayers", "model")  # trainer.compile_scope
FLEX_FWD_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")  # model.flex_fwd
FLEX_BWD_FIELDS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")  # model.flex_bwd


def check_flex_tiles(key: str, value: list, fields: tuple[str, ...]) -> None:
    """[] or one value per field: block sizes 16..128 (dividing the block mask's 128-token tiles), warps 1..16
    (powers of 2), stages 1..6.

    The mask's tile itself stays 128: with 64-token mask tiles (more masked tiles skipped) PyTorch 2.11's flex
    backward has no kernel on an H200 (it filters its own default tile, 128 wide, against the mask's before
    applying these options; tried 2026-12-01)."""
    if not value:
        return
    if len(value) != len(fields):
        raise ConfigError(key, value, f"needs {len(fields)} values", f"[] (PyTorch's tiles) or [{', '.join(fields)}]")
    for name, v in zip(fields, value):
        ok = (v in (16, 32, 64, 128) if name.startswith("BLOCK") else v in (1, 2, 4, 8, 16)
              if name == "num_warps" else 1 <= v <= 6)
        if not ok:
            valid = ("16, 32, 64 or 128" if name.startswith("BLOCK") else "1, 2, 4, 8 or 16"
                     if name == "num_warps" else "1..6")
            raise ConfigError(key, value, f"{name}={v} is not valid", f"{name} in {valid}")


def _choice(what: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(what, value, "not a known choice", list(choices))


def check_compile_options(options: dict) -> None:
    """`trainer.compile_options`: every key must be one of Inductor's settings (torch._inductor.config), so
    a misspelt option fails here instead of at the first compiled call (or, for some, silently)."""
    if not options:
        return
    import difflib

    from torch._inductor import config as inductor_config

    known = set(inductor_config.get_config_copy())
    for key in options:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=5)
            raise ConfigError(f"trainer.compile_options.{key}", options[key], "not an Inductor setting",
                              (f"one of torch._inductor.config's settings, e.g. {', '.join(near)}" if near else
                               "a key of torch._inductor.config"))


def _finite(key: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number", "a finite number")


def valid_heads(m) -> list[int]:
    """n_heads values that work with this d_model and n_kv_heads: divide d_model, even head dim, GQA."""
    return [h for h in range(1, m.d_model + 1)
            if m.d_model % h == 0 and (m.d_model // h) % 2 == 0 and h % m.n_kv_heads == 0]


def validate(cfg: DictConfig) -> None:
    """Check what composition cannot, before any compute. Raises ConfigError (a ValueError) naming
    the key, its value, why and the valid choices."""
    import residuals

    from .model import ATTENTION_BACKENDS, RECOMPUTE
    from .moe import MOE_IMPLS, MOE_TOPK

    m, t = cfg.model, cfg.trainer
    for key in ("d_model", "n_blocks", "n_heads", "n_kv_heads", "seq_len", "dense_hidden", "n_experts",
                "top_k", "expert_hidden"):
        if m[key] < 1:
            raise ConfigError(f"model.{key}", m[key], "must be a positive integer", ">= 1")
    if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
        why = (f"does not divide model.d_model={m.d_model}" if m.d_model % m.n_heads else
               f"gives an odd head dim {m.d_model // m.n_heads} (RoPE needs an even one)")
        raise ConfigError("model.n_heads", m.n_heads, why,
                          f"{valid_heads(m)} (with d_model={m.d_model}, n_kv_heads={m.n_kv_heads})")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads} (GQA)",
                          [h for h in range(1, m.n_heads + 1) if m.n_heads % h == 0])
    if not 1 <= m.top_k <= m.n_experts:
        raise ConfigError("model.top_k", m.top_k, f"must be between 1 and model.n_experts={m.n_experts}",
                          f"1..{m.n_experts}")
    if m.n_shared < 0:
        raise ConfigError("model.n_shared", m.n_shared, "must be >= 0", ">= 0")
    _choice("model.moe_impl", m.moe_impl, MOE_IMPLS)
    _choice("model.moe_topk", m.moe_topk, MOE_TOPK)
    if m.moe_impl == "grouped_mm" and (m.d_model % 8 or m.expert_hidden % 8):
        key = "model.d_model" if m.d_model % 8 else "model.expert_hidden"
        raise ConfigError(key, m[key.split(".")[1]], "model.moe_impl=grouped_mm needs multiples of 8 "
                          "(grouped GEMM alignment)", "a multiple of 8, or model.moe_impl=sliced")
    _choice("model.attention", m.attention, ATTENTION_BACKENDS)
    _choice("model.recompute", m.recompute, RECOMPUTE)
    check_flex_tiles("model.flex_fwd", list(m.flex_fwd), FLEX_FWD_FIELDS)
    check_flex_tiles("model.flex_bwd", list(m.flex_bwd), FLEX_BWD_FIELDS)
    _choice("trainer.accelerator", t.accelerator, ("cpu", "gpu", "auto"))
    if m.attention == "flex" and t.accelerator == "cpu":
        raise ConfigError("model.attention", m.attention, "FlexAttention has no backward on the CPU in PyTorch, "
                          "and trainer.accelerator=cpu", "sdpa or auto on a CPU; flex with trainer=gpu")
    _choice("trainer.precision", t.precision, ("32-true", "bf16-mixed", "16-mixed", "bf16-true"))
    _choice("trainer.ddp_comm", t.ddp_comm, ("fp32", "bf16"))
    _choice("trainer.grad_sync", t.grad_sync, ("auto", "ddp", "flat"))
    _choice("trainer.compile_scope", t.compile_scope, COMPILE_SCOPES)
    check_compile_options(dict(t.compile_options))
    if t.cuda_graphs and t.accelerator == "cpu":
        raise ConfigError("trainer.cuda_graphs", t.cuda_graphs, "CUDA graphs need a GPU, and trainer.accelerator=cpu",
                          "false on a CPU; true with trainer=gpu")
    if t.cuda_graphs and m.moe_impl != "grouped_mm":
        raise ConfigError("trainer.cuda_graphs", t.cuda_graphs, f"model.moe_impl={m.moe_impl} reads the expert "
                          "group sizes back to the host, which a CUDA graph cannot record",
                          "false, or model.moe_impl=grouped_mm")
    if t.compile and m.moe_impl == "grouped_mm" and not t.precision.startswith("bf16"):
        # torch.compile traces torch._grouped_mm with fake tensors, whose shape rule takes bf16 only: fp32 failed
        # at the first step with "Expected inputs of BF16 type" (eager runs it in fp32)
        raise ConfigError("trainer.compile", t.compile, f"trainer.precision={t.precision}: torch.compile traces the "
                          "grouped GEMM (model.moe_impl=grouped_mm) in bf16 only",
                          "false, trainer.precision=bf16-mixed / bf16-true, or model.moe_impl=sliced")
    if t.cuda_graphs and not t.precision.startswith("bf16"):
        raise ConfigError("trainer.cuda_graphs", t.cuda_graphs, f"trainer.precision={t.precision}: the grouped GEMM "
                          "outside bf16 copies its group offsets to the host, which a CUDA graph cannot record",
                          "false, or trainer.precision=bf16-mixed / bf16-true")
    for key in ("devices", "max_steps", "val_every", "val_batches", "log_every", "ckpt_every",
                "accumulate_grad_batches"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}", t[key], "must be a positive integer", ">= 1")
    for key in ("warmup_steps", "threads"):
        if t[key] < 0:
            raise ConfigError(f"trainer.{key}", t[key], "must be >= 0", ">= 0" + (" (0: torch's default)"
                                                                                   if key == "threads" else ""))
    for key in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip"):
        _finite(f"trainer.{key}", t[key])
    if t.lr <= 0:
        raise ConfigError("trainer.lr", t.lr, "must be > 0", "a finite number > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("trainer.min_lr_ratio", t.min_lr_ratio, "must lie in [0, 1]", "[0, 1]")
    if t.weight_decay < 0:
        raise ConfigError("trainer.weight_decay", t.weight_decay, "must be >= 0", ">= 0 (0: off)")
    if t.grad_clip < 0:
        raise ConfigError("trainer.grad_clip", t.grad_clip, "must be >= 0", ">= 0 (0: no clipping)")
    for key in ("beta1", "beta2"):
        if not 0 <= t[key] < 1:
            raise ConfigError(f"trainer.{key}", t[key], "an Adam beta must lie in [0, 1)", "[0, 1)")
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError("seed", cfg.seed, "must be a non-negative 32-bit integer", f"0..{2**32 - 1}")
    if cfg.get("sweep") is not None and cfg.sweep.storage:
        check_tracking_uri(cfg.sweep.storage, "sweep.storage", storage=True)
    validate_data(cfg.data)
    res_cls = residuals.get(cfg.residual.name)
    res_cfg = residual_config(cfg)
    res_cls.validate(res_cfg, d_model=m.d_model, n_sublayers=2 * m.n_blocks)


def check_environment(cfg: DictConfig) -> None:
    """What this machine must offer the config: a GPU for accelerator=gpu or backend=triton, enough
    devices, a well-formed MLflow tracking URI. Runs before any MLflow run is opened."""
    import torch

    t = cfg.trainer
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if t.accelerator == "gpu" and n_gpus == 0:
        raise ConfigError("trainer.accelerator", "gpu", "no CUDA device on this machine", "cpu, auto")
    if t.accelerator == "gpu" and t.devices > n_gpus:
        raise ConfigError("trainer.devices", t.devices, f"this machine has {n_gpus} GPU(s)", f"1..{n_gpus}")
    if t.cuda_graphs and n_gpus == 0:
        raise ConfigError("trainer.cuda_graphs", t.cuda_graphs, "no CUDA device on this machine", "false")
    if t.precision == "16-mixed" and (t.accelerator == "cpu" or n_gpus == 0):
        raise ConfigError("trainer.precision", t.precision, "fp16 mixed precision needs a GPU",
                          "32-true, bf16-mixed, bf16-true")
    backend = cfg.residual.get("backend") if hasattr(cfg.residual, "get") else None
    if backend == "triton" and n_gpus == 0 and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("residual.backend", "triton", "the Triton kernels need a CUDA device "
                          "(or TRITON_INTERPRET=1, the slow interpreter)", "auto, torch")
    if cfg.mlflow.enabled:
        check_tracking_uri(tracking_uri(cfg), "mlflow.tracking_uri")


def check_tracking_uri(uri: str, key: str, storage: bool = False) -> None:
    """A URI MLflow can open (or, with `storage`, an SQLAlchemy URL for Optuna): sqlite:///<file> (its
    folder exists or can be made), http(s)://host, or a database URL. The libraries' own errors for a
    malformed one are pages long and do not name the key."""
    from urllib.parse import urlparse

    schemes = ("sqlite", "postgresql", "mysql", "mssql", "oracle") if storage else (
        "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "file")
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    valid = ("sqlite:///<path>/optuna.db, postgresql://<user>@<host>/<db>, mysql://..." if storage else
             "sqlite:///<path>/mlflow.db, http(s)://<host>:<port>, postgresql://..., mysql://...")
    if scheme not in schemes:
        raise ConfigError(key, uri, f"unknown scheme {parsed.scheme!r}" if parsed.scheme else "no scheme", valid)
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///") or len(uri) <= len("sqlite:///"):
            raise ConfigError(key, uri, "a SQLite URL is sqlite:/// followed by a file path", valid)
        folder = Path(uri[len("sqlite:///"):]).parent
        probe = folder
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir() or not os.access(probe, os.W_OK):
            raise ConfigError(key, uri, f"cannot create the database folder {folder}", valid)
    elif scheme in ("http", "https", "postgresql", "mysql", "mssql", "oracle") and not parsed.hostname:
        from urllib.parse import parse_qs

        socket_dir = parse_qs(parsed.query).get("host", [""])[0]  # postgresql://user@/db?host=/run/socket-dir
        if not (scheme == "postgresql" and socket_dir.startswith("/")):
            raise ConfigError(key, uri, "no host in the URL (nor a socket folder in ?host=/...)", valid)


def residual_config(cfg: DictConfig):
    """The residual node as its registered dataclass (fields checked against the variant's Config)."""
    import residuals

    cls = residuals.get(cfg.residual.name).Config
    node = OmegaConf.to_container(cfg.residual, resolve=True)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(node) - known
    if unknown:
        raise ValueError(f"residual {cfg.residual.name!r} has no field(s) {sorted(unknown)}; fields: {sorted(known)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))


def compose(*overrides: str) -> DictConfig:
    """Compose the config like the command line does (Hydra's Compose API), without running."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))
