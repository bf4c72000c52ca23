"""Ceilings and bookkeeping shared by the op benchmarks (CUDA only).

Every op benchmark compares its time with a roofline measured *in the same process*, because
timings on a shared host swing 13-17% between invocations:

    floor = max(bytes / copy_bandwidth, cuda_core_flops / fp32_rate)

- ``copy_bandwidth``: a large device-to-device copy, counting bytes read plus bytes written.
- ``fp32_rate``: an fp32 matrix product with TF32 off (CUDA cores, no tensor cores).
- ``bf16_rate``: a bf16 matrix product (tensor cores), for MFU of whole-model runs.

``Table`` prints a markdown table and writes it under benchmarks/results/ with the command, the GPU
and the date, as every benchmark result here is. ``held`` sets attributes of the code (a kernel variant, a class
switch) for the timing of one row and restores them after it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@contextlib.contextmanager
def held(settings):
    """``settings``: (object, attribute, value) triples, set for the body and restored after it (in reverse order,
    also when the body raises)."""
    settings = list(settings)
    before = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in settings]
    try:
        for obj, attr, value in settings:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in reversed(before):
            setattr(obj, attr, value)


def require_device(device: str) -> None:
    """A checking script's --device (cuda, or cpu under TRITON_INTERPRET=1): cuda where there is none ends it, naming
    the choice that works here."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; valid here: --device cpu (under TRITON_INTERPRET=1)")


# How bench_ms times a call. "events": triton.testing.do_bench, CUDA events around each call with L2 flushed between
# calls, so the gaps while the host launches a call's kernels count (an op of several small kernels at `small` reads
# launch-bound: mHC's split read, 2026-12-06). "graphs": triton.testing.do_bench_cudagraph, replays of one CUDA graph
# of many calls, as a graphed training step runs them: no launch gaps, no L2 flush. Set for a run with
# held([(roofline, "TIMER", ...)]) (the benchmarks' --timer).
TIMERS = ("events", "graphs")
TIMER = "events"


def add_timer_option(parser) -> None:
    """A benchmark's ``--timer`` (events or graphs), which its main holds as TIMER while it times."""
    parser.add_argument("--timer", default="events", choices=list(TIMERS),
                        help="events: CUDA events around each call (the gaps while the host launches count); "
                             "graphs: replays of a CUDA graph of the calls, as a graphed step runs them "
                             "(benchmarks.roofline.TIMER)")


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn()``, timed as TIMER says."""
    import triton.testing

    if TIMER not in TIMERS:
        raise ValueError(f"benchmarks.roofline.TIMER={TIMER!r}: choose one of {', '.join(TIMERS)}")
    if TIMER == "graphs":
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth(n_bytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n_bytes / (ms * 1e-3)


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of an n×n×n matrix product on random data; fp32 with TF32 off uses CUDA cores."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ms = bench_ms(lambda: a @ b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n ** 3 / (ms * 1e-3)


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    fp32_flops_per_s: float
    bf16_flops_per_s: float

    @classmethod
    def measure(cls) -> "Ceilings":
        return cls(copy_bandwidth(), matmul_rate(torch.float32, 4096), matmul_rate(torch.bfloat16))

    def floor_ms(self, n_bytes: float, flops: float) -> float:
        """Roofline time: the larger of the memory and the arithmetic term."""
        return 1e3 * max(n_bytes / self.copy_bytes_per_s, flops / self.fp32_flops_per_s)

    def binding(self, n_bytes: float, flops: float) -> str:
        return "bytes" if n_bytes / self.copy_bytes_per_s >= flops / self.fp32_flops_per_s else "flops"

    def describe(self) -> str:
        return (f"copy {self.copy_bytes_per_s / 1e12:.2f} TB/s (read+write), fp32 CUDA cores "
                f"{self.fp32_flops_per_s / 1e12:.1f} TFLOP/s, bf16 matmul {self.bf16_flops_per_s / 1e12:.0f} TFLOP/s")


@dataclass
class Table:
    """A markdown table with a provenance header; ``write`` saves it under benchmarks/results/."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells) -> None:
        self.rows.append([c if isinstance(c, str) else f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells])

    def markdown(self) -> str:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        head = [f"# {self.title}", "",
                f"- command: `python -m {' '.join([_module_name(), *sys.argv[1:]])}`",
                f"- GPU: {gpu}; torch {torch.__version__}; date {dt.date.today().isoformat()}",
                *[f"- {n}" for n in self.notes], ""]
        return "\n".join(head) + "\n" + self.rows_markdown()

    def rows_markdown(self) -> str:
        """The table alone (header row and rows), without the title and provenance lines."""
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def write(self, name: str, partial: str | None = None) -> Path:
        """Save (and print) the table; with ``partial`` (e.g. "3 of 9 rows"), save it quietly as a table still
        being filled, so a run stopped by a time limit leaves the rows it timed. The final write replaces it."""
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{name}.md"
        text = self.markdown()
        if partial is not None:
            title, rest = text.split("\n", 1)
            text = f"{title}\n\n- **partial: {partial}** (written after each row; the run stopped or is still going)\n{rest}"
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a reader (or a kill mid-write) never sees half a file
        if partial is None:
            print(text)
        return path


def read_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table in a file ``Table.write`` wrote (its ``rows_markdown``), each a dict from column to
    cell; the title and provenance lines are skipped."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("|---"):
            columns = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                cells = [c.strip() for c in row.strip("|").split("|")]
                if len(cells) == len(columns):
                    rows.append(dict(zip(columns, cells)))
            return rows
    return []


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else str(sys.argv[0])
