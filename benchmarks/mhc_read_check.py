"""Which of mHC's read-forward results does a block configuration get wrong, and where in the block?

    python -m benchmarks.mhc_read_check                      # GPU: small and medium, the candidate blocks below
    python -m benchmarks.mhc_read_check --blocks 32,64,4,2 64,64,4,1 --sums fp32 bf16x3
    python -m benchmarks.mhc_read_check --shapes small --blocks 64,64,4,1 64,64,4,2 --iters 0 1 20 --sinkhorn tile token

The read of bf16 streams on tensor cores (``fused.pre_fwd`` with PRE_PROJ="bf16x3") at each ``pre_fwd_tc`` block
configuration (BLOCK_T, BLOCK_D, warps, stages), against the fp64 reference of the same inputs
(``reference.mhc_coefficients``). For each result (z, r, H^pre, H^post, H^res, h): the relative L2 error and the
largest absolute error; whether two launches agree bit for bit (a race shows as launches that differ); how many
tokens are off by more than 10x the first (default) configuration's worst error on that result (for h, by more
than rounding to bf16 explains), and their positions in the block (token index modulo BLOCK_T). A right
configuration matches the reference as closely as the default does; a wrong one that is wrong on some rows of its
tile points at them. ``--iters`` and ``--sinkhorn`` narrow down what a race needs: the racing blocks (64, 64, 4, 2)
without the Sinkhorn iterations, or with one thread a token for them (no shared memory or barriers there).
Writes benchmarks/results/mhc_read_check<tag>.md. On a CPU (``--device cpu``, under
``TRITON_INTERPRET=1``) the interpreter's blocks replace the candidates: the check of the script itself.
"""

from __future__ import annotations

import argparse
from collections import Counter
from unittest.mock import patch

import torch

from benchmarks.ops_mhc import ITERS, SHAPES
from benchmarks.roofline import Table, held, require_device

# the read forward's candidates: the default, 64 tokens (wgmma, fast, off on the GPU in the 2026-12-06 sweep) at two
# and one stage, at 64 and 32 channels, and at 8 warps (two warp groups)
DEFAULT_BLOCKS = ["32,64,4,2", "64,64,4,2", "64,64,4,1", "64,32,4,2", "64,32,4,1", "64,64,8,2"]
RESULTS = ("z", "r", "H^pre", "H^post", "H^res", "h")
EPS = 1e-6


def make_read_inputs(B: int, T: int, n: int, d: int, seed: int, device: str) -> dict:
    """bf16 streams and fp32 parameters of one read, with a norm gain (folded into φ' on the tensor-core path)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*shape, device=device, generator=g)

    k = n * n + 2 * n
    return {"x": rand(B * T, n, d).to(torch.bfloat16), "phi": rand(n * d, k, scale=(n * d) ** -0.5),
            "gain": rand(n * d, scale=0.1, shift=1.0), "alpha": rand(3, scale=0.2, shift=0.8),
            "b_pre": rand(n, scale=0.5), "b_post": rand(n, scale=0.5),
            "b_res": rand(n, n, scale=0.5) + 2.0 * torch.eye(n, device=device)}


def reference_read(p: dict, iters: int = ITERS) -> dict:
    """z, r, H^pre, H^post, H^res and h in fp64 from the same (bf16) streams, ``iters`` Sinkhorn iterations."""
    from kernels.mhc import reference

    x = p["x"].double()
    N, n, d = x.shape
    flat = x.reshape(N, n * d)
    r = torch.rsqrt(flat.pow(2).mean(-1) + EPS)
    z = (flat * r[:, None] * p["gain"].double()) @ p["phi"].double()
    h_pre, h_post, h_res = reference.mhc_coefficients(
        x, p["phi"].double(), p["alpha"].double(), p["b_pre"].double(), p["b_post"].double(), p["b_res"].double(),
        sinkhorn_iters=iters, norm_gain=p["gain"].double(), eps=EPS)
    h = (h_pre.unsqueeze(-2) @ x).squeeze(-2)
    return {"z": z, "r": r, "H^pre": h_pre, "H^post": h_post, "H^res": h_res, "h": h}


def fused_read(p: dict, iters: int = ITERS) -> dict:
    from kernels.mhc import fused

    h, h_pre, h_post, h_res, z, r = fused.pre_fwd(p["x"], p["phi"], p["gain"], p["alpha"], p["b_pre"], p["b_post"],
                                                  p["b_res"], iters=iters, eps=EPS)
    return {"z": z, "r": r, "H^pre": h_pre, "H^post": h_post, "H^res": h_res, "h": h}


def token_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The largest absolute error of each token (dim 0)."""
    return (got.double() - want).abs().reshape(got.shape[0], -1).amax(1)


def off_tokens(name: str, got: torch.Tensor, want: torch.Tensor, base_max: float) -> torch.Tensor:
    """The tokens (dim 0) whose error is more than the default configuration's (``base_max``) or, for h (stored in
    bf16: an ulp is 2^-8 of the value, and the interpreter truncates where the GPU rounds), more than rounding."""
    err = (got.double() - want).abs()
    if name == "h":
        excess = err - 2.0 ** -7 * want.abs()
        return excess.reshape(got.shape[0], -1).amax(1) > 1e-3 * want.abs().mean().item()
    return err.reshape(got.shape[0], -1).amax(1) > 10 * base_max + 1e-6 * want.abs().max().item()


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def positions(bad: torch.Tensor, block_t: int, most: int = 6) -> str:
    """The commonest positions in the block (token mod BLOCK_T) of the tokens flagged in ``bad``, with counts."""
    idx = torch.nonzero(bad).flatten().tolist()
    if not idx:
        return "-"
    common = Counter(i % block_t for i in idx).most_common(most)
    return ", ".join(f"{pos}×{count}" for pos, count in common)


def check(shapes: list[str], blocks: list[tuple], sums: list[str], n: int, seed: int, device: str,
          tag: str = "", iters: list[int] = (ITERS,), sinkhorn: list[str] = ("tile",)) -> Table:
    """Each shape, each setting (PRE_SUMS ``sums`` × Sinkhorn ``iters`` × SINKHORN ``sinkhorn``: what a race needs,
    narrowed down) and each block configuration, the first configuration the baseline of its setting."""
    from kernels.mhc import fused
    from kernels.backend import interpreting

    table = Table(title="mHC read forward (bf16 streams, tensor-core projection): results by block configuration",
                  columns=["shape", "blocks", "settings", "result", "rel L2 vs fp64", "max abs", "vs default max",
                           "tokens off", "their block positions", "two launches"],
                  notes=[f"n={n}, seed {seed}, reference: the fp64 read of the same bf16 streams; settings: PRE_SUMS, "
                         "Sinkhorn iterations, SINKHORN; 'tokens off': "
                         "tokens whose largest error on the result is above 10x the default blocks' (first "
                         "row's of the setting) largest error on it (+1e-6 of its largest value), for h (bf16) an "
                         "error above 2^-7 of the value (+1e-3 of its mean size), more than rounding to bf16 explains; "
                         "positions: token index mod BLOCK_T, the commonest, with "
                         "counts; two launches: 'same' when a second launch gives the same bits"])
    if interpreting():
        table.notes.append("under the interpreter: every configuration runs the interpreter's blocks")
    for name in shapes:
        B, T, d = SHAPES[name]
        p = make_read_inputs(B, T, n, d, seed, device)
        for it in iters:  # the reference's and the kernel's iterations alike
            want = reference_read(p, it)
            for mode in sums:
                for sk in sinkhorn:
                    check_setting(table, name, p, want, blocks, f"{mode}, {it} iterations, {sk}",
                                  [(fused, "PRE_SUMS", mode), (fused, "SINKHORN", sk)], it)
        del p, want
        if device == "cuda":
            torch.cuda.empty_cache()
    table.write("mhc_read_check" + tag)
    return table


def check_setting(table: Table, name: str, p: dict, want: dict, blocks: list[tuple], label: str,
                  settings: list, iters: int = ITERS) -> None:
    """The rows of one setting: each block configuration against the fp64 read and against the first's errors."""
    from kernels.mhc import fused

    base_max: dict[str, float] = {}
    for cand in blocks:
        with patch.dict(fused.GPU_BLOCKS, {"pre_fwd_tc": cand}), \
                held(settings + [(fused, "READ_BLOCKS", "pre_fwd_tc"), (fused, "READ_LAYOUT", "fused")]):
            try:
                got = fused_read(p, iters)
                again = fused_read(p, iters)
            except Exception as e:  # a configuration that does not compile or run is reported
                table.add(name, str(cand), label, "", "", "", "", "", "", f"error: {type(e).__name__}: {e}")
                continue
        same = all(torch.equal(got[k], again[k]) for k in RESULTS)
        maxes = {k: token_errors(got[k], want[k]) for k in RESULTS}
        if not base_max:
            base_max = {k: v.max().item() for k, v in maxes.items()}
        ratios = {k: maxes[k].max().item() / max(base_max[k], 1e-30) for k in RESULTS}
        for k in RESULTS:
            bad = off_tokens(k, got[k], want[k], base_max[k])
            table.add(name, str(cand), label, k, f"{rel_l2(got[k], want[k]):.1e}",
                      f"{maxes[k].max().item():.1e}", f"{ratios[k]:.2g}",
                      str(int(bad.sum())), positions(bad, cand[0]), "same" if same else "DIFFER")
            print(" | ".join(table.rows[-1]), flush=True)


def parse_blocks(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(s.strip().isdigit() for s in parts):
        raise argparse.ArgumentTypeError(f"blocks {text!r}: four integers BLOCK_T,BLOCK_D,warps,stages, e.g. 32,64,4,2")
    block_t, block_d, warps, stages = (int(s) for s in parts)
    if block_t < 16 or block_d < 16 or block_t & (block_t - 1) or block_d & (block_d - 1):
        raise argparse.ArgumentTypeError(f"blocks {text!r}: BLOCK_T and BLOCK_D are powers of two, 16 or more")
    return block_t, block_d, warps, stages


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["small", "medium"], choices=sorted(SHAPES))
    p.add_argument("--blocks", nargs="+", type=parse_blocks, default=[parse_blocks(b) for b in DEFAULT_BLOCKS],
                   help="pre_fwd_tc candidates BLOCK_T,BLOCK_D,warps,stages; the first is the baseline")
    p.add_argument("--sums", nargs="+", default=["fp32"], choices=["fp32", "bf16x3"], help="PRE_SUMS settings")
    p.add_argument("--iters", nargs="+", type=int, default=[ITERS],
                   help="Sinkhorn iterations, the reference's and the kernel's (0: H^res from the logits' exp alone)")
    p.add_argument("--sinkhorn", nargs="+", default=["tile"], choices=["tile", "token"], help="SINKHORN settings")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    require_device(args.device)
    if any(it < 0 for it in args.iters):
        raise SystemExit(f"--iters {args.iters}: Sinkhorn iterations are 0 or more")
    return check(args.shapes, args.blocks, args.sums, args.n, args.seed, args.device, args.tag, args.iters,
                 args.sinkhorn).markdown()


if __name__ == "__main__":
    main()
