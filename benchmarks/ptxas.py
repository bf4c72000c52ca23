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


def _wheel_tool(tool: str, data: bytes, name: str, *args: str) -> subprocess.CompletedProcess:
    """Run one of the NVIDIA tools shipped in the triton wheel on ``data`` written to a temporary file ``name``
    (the file's path goes first, then ``args``)."""
    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        return subprocess.run([exe, path, *args], capture_output=True, text=True, check=True)


def ptxas_report(compiled) -> str:
    """``ptxas -arch=sm_90a -v`` on a compiled kernel's PTX: its stderr (registers, spills, stack)."""
    return _wheel_tool("ptxas", compiled.asm["ptx"].encode(), "kernel.ptx", "-arch=sm_90a", "-v", "-o",
                       os.devnull).stderr


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


# opcode classes of a loop profile: the arithmetic a kernel is for, its memory instructions, and the rest
# (address and index arithmetic, predicates, conversions, moves), which an instruction-bound kernel pays for
SASS_CLASSES = {
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "MUFU", "FSETP"),
    "load": ("LDG", "LDS", "LDC", "LDSM", "LD"),
    "store": ("STG", "STS", "ST", "RED", "ATOM", "ATOMG"),
    "convert": ("PRMT", "F2F", "F2FP", "I2F", "F2I"),
    "integer": ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "IABS", "IMNMX", "SEL", "ISETP", "P2R", "R2P", "PLOP3",
                "CS2R", "MOV", "S2R", "S2UR", "UMOV", "UIADD3", "ULEA", "UIMAD", "ULDC", "USHF", "ULOP3"),
}


def sass(compiled) -> str:
    """The SASS of a compiled kernel (``nvdisasm -c`` of its cubin, both shipped in the triton wheel)."""
    return _wheel_tool("nvdisasm", compiled.asm["cubin"], "kernel.cubin", "-c").stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _opcode(instruction: str) -> str:
    """An instruction's opcode without its predicate and suffixes: ``@P0 LDG.E.64 R2, ...`` -> LDG."""
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def sass_loops(text: str) -> list[dict]:
    """The loops of a kernel's SASS, innermost first: every backward branch closes one, from its target label to
    the branch. Each: ``start``/``end`` (instruction indices), ``depth`` (loops it lies inside), ``ops`` (opcode →
    count, predicates and suffixes dropped: ``@P0 LDG.E.64`` counts as LDG) and ``total``. The static count of an
    inner loop's body is what an instruction-bound kernel pays per trip (branches inside a body, e.g. a masked
    path, are counted once each)."""
    labels, instrs = {}, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and stripped.startswith(".L"):
            labels[stripped[:-1]] = len(instrs)
            continue
        m = _SASS_LINE.search(line)
        if m:
            instrs.append(m.group(2))
    ops = [_opcode(ins) for ins in instrs]
    loops = []
    for i, ins in enumerate(instrs):
        target = re.search(r"\((\.L\w+)\)", ins) if ops[i] == "BRA" else None
        start = labels.get(target.group(1)) if target else None
        if start is None or start >= i:  # not a backward branch (or the trap loop at a kernel's end: BRA to itself)
            continue
        counts: dict = {}
        for op in ops[start:i + 1]:
            counts[op] = counts.get(op, 0) + 1
        loops.append(dict(start=start, end=i, ops=counts, total=i + 1 - start))
    for lp in loops:
        lp["depth"] = sum(o["start"] <= lp["start"] and lp["end"] <= o["end"] and o is not lp for o in loops)
    return sorted(loops, key=lambda lp: (-lp["depth"], lp["start"]))


def sass_classes(ops: dict) -> dict:
    """An opcode histogram summed by ``SASS_CLASSES`` (plus "other")."""
    out = {name: 0 for name in (*SASS_CLASSES, "other")}
    for op, n in ops.items():
        cls = next((name for name, members in SASS_CLASSES.items() if op in members), "other")
        out[cls] += n
    return out


def loop_summary(compiled) -> str:
    """One line per loop of a compiled kernel, innermost first: its instruction count by class."""
    lines = []
    for lp in sass_loops(sass(compiled)):
        cls = sass_classes(lp["ops"])
        lines.append(f"loop depth {lp['depth']}: {lp['total']} instructions ("
                     + ", ".join(f"{k} {v}" for k, v in cls.items() if v) + ")")
    return "\n".join(lines) or "no loops"
