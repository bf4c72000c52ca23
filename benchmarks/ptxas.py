"""Compile a Triton kernel for an H100/H200 (sm_90a) and read ptxas's resource report, without a GPU.

Uses Triton's NVIDIA backend and the ``ptxas`` shipped in the triton wheel. Shared by the kernels'
compile checks (``benchmarks.depth_attn_ptxas``, ``tests/kernels/mhc_compile.py``): registers per
thread and spill bytes are what decide the tiles, and they need no GPU to measure.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_sm90(src, options: dict):
    """``triton.compile`` of an ``ASTSource`` for sm_90 with launch ``options`` (num_warps, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def launch_attrs(arg_names, signature: dict, div16) -> dict:
    """The specialisation a launch gives a kernel, as ``ASTSource`` attrs: every pointer (a CUDA allocation,
    16-byte aligned; each of a tuple's too) and every integer argument named in ``div16`` (those that are
    multiples of 16 at the launch) marked divisible by 16. Compiled without them a kernel sees other address
    arithmetic, and its registers and spills are not the GPU's (MSAR's source-gradient kernel read 64 bytes of
    spills instead of 376; mHC's post backward 193 registers instead of 64)."""
    attrs = {}
    for i, name in enumerate(arg_names):
        t = signature[name]
        if isinstance(t, tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(t))})
        elif t != "constexpr" and (t.startswith("*") or name in div16):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def ptxas_report(compiled) -> str:
    """``ptxas -arch=sm_90a -v`` on a compiled kernel's PTX: its stderr (registers, spills, stack)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        return subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                              check=True).stderr


def layout_conversions(compiled) -> int:
    """``ttg.convert_layout`` ops in a compiled kernel's TTGIR: each moves a tensor between register layouts,
    many of them through shared memory. A CPU-side hint of on-chip traffic: MSAR's forward at `small` had 51
    (docs/kernel_msar.md), depth attention's bf16 phase-1 forward paid one per consumer (3× slower)."""
    return compiled.asm["ttgir"].count("ttg.convert_layout")


def registers(report: str) -> int:
    """Registers per thread from a ptxas report."""
    return int(re.search(r"Used (\d+) registers", report).group(1))


def spill_stores(report: str) -> int:
    """Spill store bytes from a ptxas report."""
    return int(re.search(r"(\d+) bytes spill stores", report).group(1))
