"""Compile the fused mHC kernels for sm_90 (H100 / H200) on a machine without a GPU.

    python -m tests.kernels.mhc_compile [--sass] [--precision tf32x3|ieee] [--set NAME=VALUE ...] [n,d ...]
    # default shapes: 4,512 4,1024 4,2048 2,1000; --set: a kernel variant of fused.py (PRE_PROJ=fp32|bf16x3,
    # PHI_GRAD_PROJ=fp32|bf16x3, DX_PROJ=fp32|tf32|bf16x2), several allowed

Runs every launcher in kernels/mhc/fused.py with the GPU launch configuration (``fused.GPU_BLOCKS``,
not the interpreter's), captures each kernel launch instead of running it, compiles it with Triton's
compiler to PTX and a cubin for sm_90, and prints ptxas's registers per thread and spill bytes.
Must run WITHOUT ``TRITON_INTERPRET=1``. Used by tests/kernels/test_mhc_fused.py; also the quick
way to check a change of ``GPU_BLOCKS`` or of a kernel before a GPU run. ``--sass`` also prints each kernel's loops
from its SASS with their instructions by class (``benchmarks.ptxas.loop_summary``).
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.ptxas import compile_sm90, launch_attrs, loop_summary, ptxas_report, registers, spill_stores

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def capture_launches(n: int, d: int, dtype=torch.bfloat16) -> list:
    """(kernel, args, kwargs) of every launch the fused ops make for N = 64 tokens of (n, d) streams."""
    from kernels.mhc import fused

    launches, saved = [], {}

    class Capture:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    names = ("_pre_fwd_kernel", "_pre_bwd_kernel", "_pre_dx_kernel", "_post_fwd_kernel", "_post_bwd_kernel",
             "_post_bwd_tc_kernel", "_pre_dx_rows_kernel", "_phi_grad_kernel",
             "_split_kernel", "_read_proj_kernel", "_read_coef_kernel", "_read_sum_kernel", "_pre_sweep_kernel")
    for name in names:
        saved[name] = getattr(fused, name)
        setattr(fused, name, Capture(saved[name]))
    props = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device: type("P", (), {"multi_processor_count": 132})
    try:
        N, k = 64, n * n + 2 * n
        x, f = torch.empty(N, n, d, dtype=dtype), torch.empty(N, d, dtype=dtype)

        def f32(*shape):
            return torch.empty(*shape, dtype=torch.float32)

        phi, gain, alpha, b_pre, b_post, b_res = f32(n * d, k), f32(n * d), f32(3), f32(n), f32(n), f32(n, n)
        one_pass = fused.POST_PRE_ONE_PASS
        for g in (None, gain):
            fused.pre_fwd(x, phi, g, alpha, b_pre, b_post, b_res, iters=20, eps=1e-6)
            for fused.POST_PRE_ONE_PASS in (False, True):  # the write then the read; both in one pass
                fused.pre_fwd(torch.empty_like(x), phi, g, alpha, b_pre, b_post, b_res, iters=20, eps=1e-6,
                              post=(x, f, f32(N, n), f32(N, n, n)))
        fused.POST_PRE_ONE_PASS = one_pass
        fused.pre_bwd(x, f, f32(N, n), f32(N, n), f32(N, n, n), x, f32(N, n, n), f32(N, k), f32(N), phi, gain,
                      alpha, b_pre, b_post, b_res, iters=20, eps=1e-6)
        fused.pre_bwd(x, f, None, f32(N, n), f32(N, n, n), None, None, f32(N, k), f32(N), phi, None,
                      alpha, b_pre, b_post, b_res, iters=20, eps=1e-6)
        fused.post_fwd(x, f, f32(N, n), f32(N, n, n))
        for store_dx in (True, False):
            fused.post_bwd(x, f, f32(N, n), f32(N, n, n), x, store_dx=store_dx)
        fused.phi_grad(x, f32(N, k))
    finally:
        for name, kernel in saved.items():
            setattr(fused, name, kernel)
        torch.cuda.get_device_properties = props
    return launches


def compile_captured(kernel, args, kwargs):
    """One captured launch compiled for sm_90 with the launch's specialisation (``launch_attrs``): the compiled
    kernel, for ptxas's report and the SASS."""
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in kwargs}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for arg in kernel.arg_names:
        v = values[arg]
        if isinstance(v, torch.Tensor):
            signature[arg] = "*" + TRITON_TYPES[v.dtype]
        elif arg in kwargs:
            signature[arg], constexprs[arg] = "constexpr", v
        else:
            signature[arg] = "fp32" if isinstance(v, float) else "i32"
    div16 = {a for a in kernel.arg_names if type(values[a]) is int and a not in kwargs and values[a] % 16 == 0}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                    attrs=launch_attrs(kernel.arg_names, signature, div16))
    return compile_sm90(src, options)


def compile_launch(kernel, args, kwargs, loops: list | None = None) -> tuple[int, int]:
    """Compile one captured launch for sm_90; (registers per thread, spill store bytes) from ptxas. ``loops``: a list
    that gets the kernel's SASS loop summary (``loop_summary``) appended."""
    compiled = compile_captured(kernel, args, kwargs)
    report = ptxas_report(compiled)
    if loops is not None:
        loops.append(loop_summary(compiled))
    return registers(report), spill_stores(report)


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("tests.kernels.mhc_compile must run without TRITON_INTERPRET=1")
    from kernels.mhc import fused

    sass = "--sass" in argv
    argv = [a for a in argv if a != "--sass"]
    if argv[:1] == ["--precision"]:
        if argv[1] not in fused.DOT_PRECISIONS:
            raise SystemExit(f"--precision {argv[1]!r}: choose one of {', '.join(fused.DOT_PRECISIONS)}")
        fused.DOT_PRECISION, argv = argv[1], argv[2:]
    while argv[:1] == ["--set"]:
        name, _, text = argv[1].partition("=")
        choices = {str(c): c for c in fused.VARIANT_CHOICES.get(name, ())}  # a choice as written: str or int
        if text not in choices:
            raise SystemExit(f"--set {argv[1]!r}: one of " + ", ".join(
                f"{k}={'|'.join(map(str, v))}" for k, v in fused.VARIANT_CHOICES.items()))
        setattr(fused, name, choices[text])
        argv = argv[2:]
    shapes = [tuple(map(int, a.split(","))) for a in (argv or ["4,512", "4,1024", "4,2048", "2,1000"])]
    for n, d in shapes:
        for kernel, args, kwargs in capture_launches(n, d):
            loops = [] if sass else None
            regs, spills = compile_launch(kernel, args, kwargs, loops)
            flags = {k: v for k, v in kwargs.items() if k.isupper() and k not in ("D", "N_STREAMS", "NP", "KP", "K")}
            print(f"{kernel.__name__} n={n} d={d} registers {regs} spills {spills} {flags}", flush=True)
            for line in (loops[0].splitlines() if loops else []):
                print("    " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
