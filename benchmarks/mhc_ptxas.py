"""Shared-memory instructions, barriers and the main loop of the fused mHC kernels compiled for sm_90, without a GPU.

    python -m benchmarks.mhc_ptxas [--dtype fp32|bf16] [--kernels NAME ...] [--set NAME=VALUE ...] [n,d ...]
    # default: fp32 streams (the model's default), every kernel, n,d = 4,512 and 4,1024; --set: a variant of
    # kernels/mhc/fused.py (its VARIANT_CHOICES), several allowed

Captures the launches of the fused ops with their GPU launch configuration (``tests.kernels.mhc_compile``), compiles
each to a cubin for sm_90a (Triton's compiler, the wheel's ptxas and nvdisasm) and prints one line per launch:
registers, spill bytes, shared memory per program, and from the SASS the whole kernel's STS / LDS / BAR / SHFL, then
the longest loop (the channel loop of a streaming kernel): its instructions, FFMA, LDS, the bytes those LDS move per
thread (LDS.64 = 8, LDS.128 = 16) and per FFMA, STS, BAR and SHFL. Static counts: not a timing (that is
``benchmarks.ops_mhc``). Must run without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from benchmarks.ptxas import ptxas_report, registers, sass, sass_loops, spill_stores

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLAGS = ("HAS_GAIN", "FUSE_POST", "HAS_DOUT", "HAS_DPRE", "STORE_DX", "PARTS", "PROJ", "SPLIT3")
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LDS_BYTES = {"": 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def shared_counts(text: str) -> dict:
    """From a kernel's SASS: STS, LDS, BAR, SHFL of the whole kernel, and of its longest loop the instructions, FFMA,
    LDS, LDS bytes per thread, STS, BAR, SHFL."""
    instrs = _INSTR.findall(text)

    def opcode(ins):
        words = ins.split()
        return words[1] if words[0].startswith("@") else words[0]

    full = [opcode(i) for i in instrs]
    out = {op: sum(o.split(".")[0] == op for o in full) for op in ("STS", "LDS", "BAR", "SHFL")}
    loops = sass_loops(text)
    if not loops:
        return out | {"loop": 0}
    lp = max(loops, key=lambda lp: lp["total"])
    body = full[lp["start"]:lp["end"] + 1]
    lds = [o for o in body if o.split(".")[0] == "LDS"]
    lds_bytes = sum(_LDS_BYTES.get(o.partition(".")[2], 4) for o in lds)
    ffma = sum(o.split(".")[0] == "FFMA" for o in body)
    return out | {"loop": lp["total"], "loop_FFMA": ffma, "loop_LDS": len(lds), "loop_LDS_bytes": lds_bytes,
                  "loop_LDS_bytes_per_FFMA": round(lds_bytes / ffma, 2) if ffma else 0.0,
                  **{f"loop_{op}": sum(o.split(".")[0] == op for o in body) for op in ("STS", "BAR", "SHFL")}}


NAMED_SHAPES = {"small": (4, 512), "medium": (4, 1024)}


def _shape(text: str) -> tuple[int, int]:
    """A shape argument: a model size of NAMED_SHAPES or "n,d"; anything else is an error naming both forms."""
    if text in NAMED_SHAPES:
        return NAMED_SHAPES[text]
    try:
        n, d = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"shape {text!r}: give n,d (e.g. 4,512) or one of {', '.join(NAMED_SHAPES)}") from None
    return n, d


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("benchmarks.mhc_ptxas must run without TRITON_INTERPRET=1")
    from kernels.mhc import fused
    from tests.kernels.mhc_compile import capture_launches, compile_captured

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", default=["small", "medium"],
                    help="n,d pairs, or the model sizes small (4,512) and medium (4,1024)")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--kernels", nargs="+", default=None, help="kernel names, e.g. _pre_fwd_kernel")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a variant of fused.py")
    opts = ap.parse_args(argv)
    for item in opts.set:
        name, _, value = item.partition("=")
        if name not in fused.VARIANT_CHOICES:
            raise SystemExit(f"--set {item!r}: NAME is one of {', '.join(fused.VARIANT_CHOICES)}")
        setattr(fused, name, value)
        fused._variant(name)  # a bad value raises here with the choices
    for n, d in map(_shape, opts.shapes):
        seen = set()
        for kernel, args, kwargs in capture_launches(n, d, DTYPES[opts.dtype]):
            if opts.kernels and kernel.__name__ not in opts.kernels:
                continue
            flags = {k: v for k, v in kwargs.items() if k in FLAGS}
            # (BLOCK_T or the split kernel's BLOCK_R, BLOCK_D, warps, stages, maxnreg); Triton's defaults where unset
            launch = (kwargs.get("BLOCK_T", kwargs.get("BLOCK_R")), kwargs.get("BLOCK_D", 0),
                      kwargs.get("num_warps", 4), kwargs.get("num_stages", 3), kwargs.get("maxnreg", 0))
            key = (kernel.__name__, tuple(sorted(flags.items())), launch)
            if key in seen:
                continue
            seen.add(key)
            compiled = compile_captured(kernel, args, kwargs)
            report = ptxas_report(compiled)
            counts = shared_counts(sass(compiled))
            print(f"{kernel.__name__} n={n} d={d} {opts.dtype} blocks={launch} {flags} registers {registers(report)} "
                  f"spills {spill_stores(report)} shared {compiled.metadata.shared} "
                  + " ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
