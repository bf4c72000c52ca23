"""What each residual costs: `python -m platform.accounting [--models tiny small medium]`.

For every registered residual and model size: extra parameters over vanilla (absolute, % of total
and % of activated), analytic extra forward FLOPs per token (% of the backbone's), persistent
per-token state between sublayers and paper-style I/O per sublayer (units of d). Writes the table
to benchmarks/results/accounting.md.

Also the two ceilings MFU is measured against (`peak_rates`): the bf16 matmul rate measured on the
device, and the datasheet's dense bf16 peak. Model FLOPs follow the PaLM convention (Chowdhery et
al. 2022, App. B): 2 per multiply-add of the weights a token touches, attention at full causal
context (document masking skips some of it; it still counts), backward = 2x forward, and no
recomputation counted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .env import REPO_ROOT

# What a residual costs over vanilla, as sweeps record it on every trial (user attrs, `cost/*` metrics).
COST_KEYS = ("extra_params", "extra_params_pct", "extra_active_pct", "extra_flops", "extra_flops_pct")


def token_budget(cfg) -> int:
    """Training tokens of a run: optimizer steps x micro-batches per step x devices x batch x seq_len."""
    t = cfg.trainer
    return int(t.max_steps * t.accumulate_grad_batches * t.devices * cfg.data.batch_size * cfg.model.seq_len)


def backbone_flops_per_token(m, vocab: int) -> float:
    """Forward FLOPs per token of the vanilla backbone (2 per multiply-add), attention at full context."""
    d, hd = m.d_model, m.d_model // m.n_heads
    attn = 2 * d * (m.n_heads * hd) * 2 + 2 * d * (2 * m.n_kv_heads * hd) + 2 * d * m.seq_len  # proj + QK/AV (causal avg)
    dense = 3 * 2 * d * m.dense_hidden
    moe = 3 * 2 * d * m.expert_hidden * (m.n_shared + m.top_k) + 2 * d * m.n_experts
    return m.n_blocks * attn + dense + (m.n_blocks - 1) * moe + 2 * d * vocab


def forward_flops_per_token(model, m, vocab: int) -> float:
    """Forward FLOPs per token of this model: the backbone plus its residual mechanism's extra."""
    return backbone_flops_per_token(m, vocab) + float(model.residual.extra_flops_per_token())


# Dense (not sparsity-doubled) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s, by a
# substring of torch.cuda.get_device_name(). H100 and H200 SXM share the same tensor cores.
DATASHEET_BF16_DENSE = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
_measured: dict[str, float] = {}


def datasheet_rate(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_BF16_DENSE.items() if k in name), None)


def measure_bf16_matmul_rate(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an n×n×n bf16 matrix product on this GPU (median of `reps`, CUDA events), once per device."""
    key = str(device)
    if key not in _measured:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del a, b
        _measured[key] = 2 * n ** 3 / sorted(times)[len(times) // 2]
    return _measured[key]


def peak_rates(device: torch.device) -> tuple[float | None, float | None]:
    """(measured bf16 matmul FLOP/s, datasheet dense bf16 FLOP/s) of `device`; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    return measure_bf16_matmul_rate(device), datasheet_rate(device)


def active_params(model, m) -> int:
    """Parameters a token touches: all but the routed experts it is not sent to."""
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * m.d_model * m.expert_hidden
    return total - (m.n_blocks - 1) * (m.n_experts - m.top_k) * per_expert


def residual_cost(model, m, vocab: int) -> dict:
    """The one computation of what a backbone's residual costs over vanilla (COST_KEYS and more):
    extra parameters (absolute, % of the rest, % of the activated rest), extra forward FLOPs per token
    (absolute, % of the backbone's), per-token state and I/O per sublayer (units of d)."""
    res = model.residual
    extra = sum(p.numel() for p in res.parameters())
    total = sum(p.numel() for p in model.parameters())
    base_flops = backbone_flops_per_token(m, vocab)
    return {"total_params": total, "extra_params": extra, "extra_params_pct": 100 * extra / (total - extra),
            "extra_active_pct": 100 * extra / (active_params(model, m) - extra),
            "backbone_flops": base_flops, "extra_flops": res.extra_flops_per_token(),
            "extra_flops_pct": 100 * res.extra_flops_per_token() / base_flops,
            "state_d": res.state_per_token(), "io_d": res.io_per_sublayer(), "sublayers": 2 * m.n_blocks}


def run_params(model, m, vocab: int) -> dict:
    """The cost params every training run logs to MLflow (from `residual_cost`, under the run's names)."""
    c = residual_cost(model, m, vocab)
    return {"params/total": c["total_params"], "params/residual_extra": c["extra_params"],
            "params/residual_extra_pct": round(c["extra_params_pct"], 4),
            "flops/backbone_per_token": int(c["backbone_flops"]), "flops/residual_extra_per_token": int(c["extra_flops"]),
            "flops/residual_extra_pct": round(c["extra_flops_pct"], 4),
            "state/per_token_d": c["state_d"], "io/per_sublayer_d": round(c["io_d"], 3)}


def meta_model(model_name: str, residual: str, vocab: int = 4096, extra_overrides: tuple = ()):
    """(model, config) of a composed config, the model on the meta device (sizes only: no memory, no init cost)."""
    from .config import compose, residual_config
    from .model import Backbone

    cfg = compose(f"model={model_name}", f"residual={residual}", *extra_overrides)
    with torch.device("meta"):
        model = Backbone(cfg.model, vocab, residual_config(cfg))
    return model, cfg


def account(model_name: str, residual: str, vocab: int = 4096, extra_overrides: tuple = ()) -> dict:
    """`residual_cost` of a composed config, on a meta-device model (``meta_model``)."""
    model, cfg = meta_model(model_name, residual, vocab, extra_overrides)
    return {"model": model_name, "residual": residual, **residual_cost(model, cfg.model, vocab)}


def table(models: list[str], names: list[str]) -> str:
    lines = ["| model | residual | extra params | % total | % active | extra FLOPs/token | % FLOPs | "
             "state (d) | I/O per sublayer (d) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in models:
        for n in names:
            a = account(m, n)
            lines.append(f"| {m} (L={a['sublayers']}) | {n} | {a['extra_params']:,} | {a['extra_params_pct']:.3f} | "
                         f"{a['extra_active_pct']:.3f} | {a['extra_flops']:,.0f} | {a['extra_flops_pct']:.3f} | "
                         f"{a['state_d']:g} | {a['io_d']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    import residuals

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["tiny", "small", "medium"])
    p.add_argument("--residuals", nargs="*", default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "accounting.md"))
    a = p.parse_args(argv)
    names = a.residuals or residuals.names()
    text = table(a.models, names)
    header = ("# Residual accounting (analytic; `python -m platform.accounting`)\n\n"
              "Paper: MSAR +0.3% activated params, +0.5% FLOPs; I/O per sublayer 5.5d (Block AttnRes) vs "
              "21.5d (MSAR); mHC n=4 ~34d. State = per-token tensors of size d held between sublayers "
              "at the deepest point (not the same convention as I/O, which counts reads + writes per sublayer).\n\n")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(header + text)
    print(header + text)
    return text


if __name__ == "__main__":
    main()
