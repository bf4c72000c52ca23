"""Does a pipelined tensor-core projection race on its own, outside mHC's read? A standalone reduction of it.

    python -m benchmarks.wgmma_race                 # GPU: the grid below, 5 launches each
    python -m benchmarks.wgmma_race --launches 20 --tokens 32768

mHC's read forward on tensor cores (``kernels.mhc.fused._pre_fwd_kernel``) at 64 tokens a program and two pipeline
stages gave z wrong on a few dozen tokens, different ones at each launch, on an H100 (mhc_read_check_read64_h100.md);
at one stage, or at 32 tokens, it was right. This kernel keeps only the shape of that projection: for each of S
streams, a loop over channel chunks accumulating y += x_i w_i (bf16 operands, fp32 accumulation, ``tl.dot``), the
sum of squares beside it, then y scaled by the norm and stored, a barrier, and y read back by other threads in
another layout (as the read's coefficients read z). Each configuration (tokens a program, stages, whether the
read-back is there, whether a second sweep follows) runs ``--launches`` times against ``x.float() @ w.float()``; the
table gives the tokens off (largest error above 1e-3 of the result's scale) at the worst launch and whether the
launches agree bit for bit. If the race shows here, this file is the report for Triton; if it does not, the race
needs more of the read kernel. The second sweep (2026-12-06, evening) is the read's: after the read-back, the
streams loaded again chunk by chunk, h = Σ_i c_i x_i with c_i the first STREAMS outputs read back, stored; in the read
the race needs neither the Sinkhorn iterations nor their layout (mhc_read_check_bisect_h100.md), and with that sweep on
tensor cores it goes away, so the second loop's pipelined loads (sharing the projection's shared memory) are the
suspect.
Writes benchmarks/results/wgmma_race<tag>.md. Under ``TRITON_INTERPRET=1`` on a CPU (``--device cpu``) it checks
itself (every configuration must be right there).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.roofline import Table, require_device


@triton.jit
def _projection_kernel(x_ptr, w_ptr, z_ptr, out_ptr, N, D: tl.constexpr, KP: tl.constexpr, STREAMS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, READBACK: tl.constexpr,
                       INTERP: tl.constexpr, h_ptr=None, SWEEP2: tl.constexpr = False, NP: tl.constexpr = 1):
    """z = r · Σ_i x_i w_i for a block of tokens, x (N, STREAMS, D) bf16, w (STREAMS·D, KP) bf16, r = rsqrt(mean x²);
    with READBACK, out = 2 z read back from memory in a transposed layout after a barrier; with SWEEP2 (and
    READBACK), h = Σ_i z[:, i] x_i (N, D) fp32 over a second loop of channel chunks (NP: STREAMS padded to a power
    of two), as the read's h."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < N
    rows = offs_t.to(tl.int64)
    offs_k = tl.arange(0, KP)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    y = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    for i in tl.static_range(STREAMS):
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            xr = tl.load(x_ptr + rows[:, None] * (STREAMS * D) + i * D + offs_d[None, :], mask=mask_t[:, None],
                         other=0.0)
            xv = xr.to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
            w = tl.load(w_ptr + (i * D + offs_d)[:, None] * KP + offs_k[None, :])
            if INTERP:  # the interpreter's bf16 products are not the GPU's; fp32 of the same values is exact
                y = tl.dot(xv, w.to(tl.float32), y, input_precision="ieee")
            else:
                y = tl.dot(xr, w, y)
    z = y * tl.rsqrt(ss / (STREAMS * D) + 1e-6)[:, None]
    tl.store(z_ptr + rows[:, None] * KP + offs_k[None, :], z, mask=mask_t[:, None])
    if READBACK:
        tl.debug_barrier()  # z read back below by other threads of the block, in the transposed layout
        zt = tl.load(z_ptr + rows[None, :] * KP + offs_k[:, None], mask=mask_t[None, :], other=0.0)  # (KP, BLOCK_T)
        tl.store(out_ptr + rows[None, :] * KP + offs_k[:, None], 2.0 * zt, mask=mask_t[None, :])
        if SWEEP2:
            offs_n = tl.arange(0, NP)
            m2 = mask_t[:, None] & (offs_n < STREAMS)[None, :]
            c = tl.load(z_ptr + rows[:, None] * KP + offs_n[None, :], mask=m2, other=0.0)  # (BLOCK_T, NP)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                x3 = tl.load(x_ptr + rows[:, None, None] * (STREAMS * D) + offs_n[None, :, None] * D
                             + offs_d[None, None, :], mask=m2[:, :, None], other=0.0).to(tl.float32)
                h = tl.sum(c[:, :, None] * x3, axis=1)
                tl.store(h_ptr + rows[:, None] * D + offs_d[None, :], h, mask=mask_t[:, None])


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    N, S, D = x.shape
    flat = x.reshape(N, S * D).double()
    return (flat @ w.double()) * torch.rsqrt(flat.pow(2).mean(1) + 1e-6)[:, None]


def reference_h(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The second sweep's h from the fp64 z: Σ_i z[:, i] x_i."""
    return (z[:, :x.shape[1], None] * x.double()).sum(1)


def run(x, w, block_t: int, block_d: int, stages: int, readback: bool,
        sweep2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(z, out, h) of one launch; h is None without ``sweep2``."""
    from kernels.backend import interpreting

    N, S, D = x.shape
    kp = w.shape[1]
    z = torch.empty(N, kp, device=x.device, dtype=torch.float32)
    out = torch.empty_like(z)
    h = torch.empty(N, D, device=x.device, dtype=torch.float32) if sweep2 else None
    launch = {} if interpreting() else {"num_warps": 4, "num_stages": stages}
    _projection_kernel[(triton.cdiv(N, block_t),)](x, w, z, out, N, D=D, KP=kp, STREAMS=S, BLOCK_T=block_t,
                                                    BLOCK_D=block_d, READBACK=readback, INTERP=interpreting(),
                                                    h_ptr=h, SWEEP2=sweep2, NP=triton.next_power_of_2(S), **launch)
    return z, out, h


def check(tokens: int, streams: int, d: int, kp: int, configs: list[tuple], launches: int, device: str,
          tag: str = "") -> Table:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, streams, d, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(streams * d, kp, device=device, generator=g) / (streams * d) ** 0.5).to(torch.bfloat16)
    want = reference(x, w)
    want_h = reference_h(x, want)
    scale = want.abs().max().item()
    scale_h = want_h.abs().max().item()
    table = Table(title="A tensor-core projection alone: tokens off by configuration",
                  columns=["tokens a program", "channels a chunk", "stages", "read-back", "second sweep",
                           "tokens off (worst launch)",
                           "launches off", "launches agree", "largest error"],
                  notes=[f"{tokens} tokens, {streams} streams of d = {d}, {kp} outputs, {launches} launches each, "
                         f"bf16 operands, fp32 accumulation, 4 warps; off: an error above 1e-3 of the result's "
                         f"largest value ({scale:.3g}) against the fp64 product of the same bf16 values; the second "
                         f"sweep's h against Σ_i z_i x_i of the fp64 z (off above 1e-3 of its largest value, "
                         f"{scale_h:.3g}; largest error: z's)"])
    for block_t, block_d, stages, readback, sweep2 in configs:
        if sweep2 and not readback:
            raise ValueError(f"configuration {(block_t, block_d, stages, readback, sweep2)}: the second sweep reads "
                             "z back, so it needs the read-back")
        first, worst, launches_off, largest, agree = None, 0, 0, 0.0, True
        for _ in range(launches):
            z, out, h = run(x, w, block_t, block_d, stages, readback, sweep2)
            got = torch.stack([z, out / 2]) if readback else z[None]
            err = (got.double() - want).abs().amax(-1)  # (results, tokens)
            bad = (err > 1e-3 * scale).any(0)
            if sweep2:
                bad |= (h.double() - want_h).abs().amax(-1) > 1e-3 * scale_h
                got = torch.cat([got.flatten(), h.flatten()])
            off = int(bad.sum())
            worst, largest = max(worst, off), max(largest, err.max().item())
            launches_off += off > 0
            agree = agree and (first is None or torch.equal(got, first))
            first = got if first is None else first
        table.add(block_t, block_d, stages, "yes" if readback else "no", "yes" if sweep2 else "no", worst,
                  f"{launches_off} of {launches}",
                  "yes" if agree else "NO", f"{largest:.1e}")
        print(" | ".join(table.rows[-1]), flush=True)
    table.write("wgmma_race" + tag)
    return table


# (tokens a program, channels a chunk, stages, read-back, second sweep): the read's racing blocks and their
# neighbours, then (2026-12-06, evening) the same with the read's second sweep
DEFAULT_CONFIGS = [(32, 64, 2, True, False), (64, 64, 1, True, False), (64, 64, 2, True, False),
                   (64, 64, 2, False, False), (64, 64, 3, True, False), (64, 32, 2, True, False),
                   (128, 64, 2, True, False),
                   (32, 64, 2, True, True), (64, 64, 1, True, True), (64, 64, 2, True, True), (64, 64, 3, True, True)]


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--kp", type=int, default=32, help="outputs, padded as mHC's n² + 2n = 24 is to 32")
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    require_device(args.device)
    for name in ("d", "kp"):
        value = getattr(args, name)
        if value < 16 or value & (value - 1):
            raise SystemExit(f"--{name} {value}: a power of two, 16 or more (the chunks and tl.dot tiles need it)")
    configs = [c for c in DEFAULT_CONFIGS if c[1] <= args.d]
    return check(args.tokens, args.streams, args.d, args.kp, configs, args.launches, args.device, args.tag).markdown()


if __name__ == "__main__":
    main()
