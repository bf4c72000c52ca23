"""What autograd keeps from a training forward for its backward, per residual, on any device.

    python -m benchmarks.saved_bytes [--model tiny] [--residuals vanilla attnres_block] [--backend triton]
                                     [--batch 2] [--set KEY=VALUE ...] [--compile off|model] [--tag NAME]

One forward of the backbone (bf16 autocast, as `trainer=gpu` trains) under
``torch.autograd.graph.saved_tensors_hooks``: every tensor an autograd node saves is counted once per storage
(a tensor saved by two nodes, e.g. a merge's output that its consumer sublayer saves as its input, counts
once), in bytes and in units of one (B, T, d) fp32 tensor, and against vanilla's. Not counted: what an op keeps
on its ctx outside ``save_for_backward`` (the fused depth attention's source buffer and row gradients), the
parameters, and the backward's temporaries: this is the activation memory a change moves, not the peak (on a
GPU ``benchmarks.throughput`` reports the peak). Deterministic: it needs no GPU, and on the CPU
``--backend triton`` runs the fused ops through Triton's interpreter (set here when there is no GPU).
``--compile model`` compiles the forward as ``trainer=gpu`` does (one forward and backward first, outside the
count): Inductor chooses what a compiled sublayer keeps (e.g. its input's norm instead of its input). Two more columns
count everything, ctx-held buffers included: what the forward leaves allocated, and the most allocated during forward
and backward (one backward of a random upstream gradient), both from the allocation before the forward (parameter
gradients included). On a GPU from the caching allocator's counters (`torch.cuda.max_memory_allocated`); on the CPU
from torch's `MemTracker`, which follows every tensor storage the ops allocate and free through the dispatcher (no
allocator rounding or caching): the same quantity, without the GPU allocator's 512-byte blocks.
The table goes to benchmarks/results/saved_bytes_<model><tag>.md with the command, the device and the date.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.roofline import Table, held  # noqa: E402
from benchmarks.throughput import build, code_settings, packed_batch, run_names  # noqa: E402


def saved_bytes(model, tokens, doc_ids, by_node: dict | None = None, keep: bool = False) -> tuple[int, int]:
    """(bytes, tensors) of the distinct storages that one forward of ``model`` leaves saved for its backward:
    what the graph still holds when the forward returns (a node dropped during the forward, and what it saved,
    is not counted), each storage once, parameters excluded. With ``by_node`` (a dict), also which kind of
    autograd node keeps them: bytes per node type (``MsarFunctionBackward``, ``MmBackward0``, ...), a storage
    counted for the first kind that keeps it walking back from the output, "(not reached)" for the rest. ``keep``:
    the logits stay alive for a backward, as ``saved_bytes.last_logits``."""
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))  # the graph holds t while its node lives
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = model(tokens, doc_ids)
    storages = {}
    for ref in saved:
        t = ref()
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[(s.device.type, s.data_ptr())] = s.nbytes()
    if by_node is not None:
        owner = _node_owners(logits.grad_fn)
        for key, nbytes in storages.items():
            kind = owner.get(key, "(not reached)")
            by_node[kind] = by_node.get(kind, 0) + nbytes
    if keep:
        saved_bytes.last_logits = logits
    del logits
    return sum(storages.values()), len(storages)


def _node_saved(node) -> list[torch.Tensor]:
    """The tensors an autograd node keeps: a custom Function's ``saved_tensors``, a built-in node's ``_saved_*``."""
    if hasattr(node, "saved_tensors"):  # a custom autograd.Function's node
        try:
            return [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
        except RuntimeError:  # freed or never saved
            return []
    out = []
    for name in dir(node):
        if name.startswith("_saved_") and not name.endswith(("sym_sizes", "sym_strides")):
            try:
                value = getattr(node, name)
            except RuntimeError:
                continue
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out


def _node_owners(root) -> dict[tuple, str]:
    """Storage key -> the type of the first node, walking back from ``root`` breadth first, that keeps it."""
    owners, seen, queue = {}, set(), [root]
    while queue:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in _node_saved(node):
            s = t.untyped_storage()
            owners.setdefault((s.device.type, s.data_ptr()), type(node).__name__)
        queue.extend(next_node for next_node, _ in node.next_functions)
    return owners


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--residuals", nargs="+", default=["vanilla", "attnres", "attnres_block"])
    p.add_argument("--backend", default="triton", help="residual.backend of the depth-attention residuals")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, e.g. model.seq_len=256")
    p.add_argument("--by-node", type=int, default=6, metavar="K",
                   help="a second table: the K kinds of autograd node that keep the most, per residual (0: none)")
    p.add_argument("--compile", default="off", choices=["off", "model"],
                   help="model: compile the forward as trainer=gpu does (trainer.compile_scope=model)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    run_names(a.residuals, [])  # an unknown name: an error listing the registered ones, before any work
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    table = Table(f"Tensors saved for backward by one training forward, `{a.model}`",
                  ["residual", "MB saved", "tensors", "(B, T, d) fp32 units", "vs vanilla",
                   "MB left by the forward", "MB peak (fwd+bwd)", "peak vs vanilla"],
                  notes=[f"batch {a.batch}, bf16 autocast, compile={a.compile}, residual.backend={a.backend} for the "
                         "residuals that have one; distinct storages, parameters excluded (benchmarks/saved_bytes.py "
                         "says what is not counted)"])
    kinds = Table("who keeps it", ["residual", "kept by (autograd node)", "MB", "(B, T, d) fp32 units", "of the residual's"])
    base = base_peak = None
    for name in a.residuals:
        torch.manual_seed(0)
        if cuda:
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        extra = [] if name.split("@")[0] == "vanilla" else [f"residual.backend={a.backend}"]
        with held(code_settings(name)):  # a row's py: settings, for its build and its forward and backward
            nbytes, count, unit, cells = _row(a, name, extra, device, nodes := {})
            base_peak = base_peak or (cells[1] if name == "vanilla" else None)
        base = base or (nbytes if name == "vanilla" else None)
        left, peak = cells
        cells = [f"{left / 1e6:.1f}", f"{peak / 1e6:.1f}", f"{peak / base_peak:.3f}" if base_peak else "-"]
        table.add(name, f"{nbytes / 1e6:.2f}", count, f"{nbytes / unit:.1f}",
                  f"{nbytes / base:.3f}" if base else "-", *cells)
        print(" | ".join(table.rows[-1]), flush=True)
        for kind, kb in sorted(nodes.items(), key=lambda kv: -kv[1])[:a.by_node]:
            kinds.add(name, kind, f"{kb / 1e6:.2f}", f"{kb / unit:.1f}", f"{kb / nbytes:.0%}")
    path = table.write(f"saved_bytes_{a.model}{a.tag}")
    if a.by_node:  # the second table, below the first in the same file
        text = (f"\n## Who keeps it\n\nPer residual, the {a.by_node} kinds of autograd node that keep the most (a "
                "storage kept by several counts for the first found walking back from the output).\n\n"
                + kinds.rows_markdown())
        with open(path, "a") as f:
            f.write(text)
        print(text)
    return 0


def _row(a, name: str, extra: list[str], device: str, nodes: dict) -> tuple[int, int, int, tuple]:
    """One row: bytes saved, tensors, the bytes of one (B, T, d) fp32 tensor, and (bytes the forward leaves
    allocated, peak bytes of forward and backward), both from the allocation before the forward."""
    cuda = device == "cuda"
    model, cfg = build(a.model, name, a.vocab, [*extra, *a.set], device)
    model.train()
    tokens, doc_ids = packed_batch(a.batch, cfg.model.seq_len, a.vocab, device)  # seq_len + 1: inputs, targets
    tokens, doc_ids = tokens[:, :-1], doc_ids[:, :-1]
    if a.compile == "model":
        model.compile_as("model", dict(cfg.trainer.compile_options))
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens, doc_ids)
        logits.float().sum().backward()  # compiled forward and backward, outside the count
        del logits
        model.zero_grad(set_to_none=True)
    unit = a.batch * cfg.model.seq_len * cfg.model.d_model * 4
    if not cuda:
        nbytes, count, cells = _cpu_row(model, tokens, doc_ids, nodes)
        return nbytes, count, unit, cells
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    nbytes, count = saved_bytes(model, tokens, doc_ids, nodes, keep=True)
    logits = saved_bytes.last_logits
    left = torch.cuda.memory_allocated() - start
    logits.backward(torch.randn_like(logits))
    del logits, saved_bytes.last_logits
    torch.cuda.synchronize()
    return nbytes, count, unit, (left, torch.cuda.max_memory_allocated() - start)


def _cpu_row(model, tokens, doc_ids, nodes: dict) -> tuple[int, int, tuple[int, int]]:
    """``saved_bytes`` and one backward under torch's MemTracker: bytes saved, tensors, and (bytes the forward leaves
    allocated, peak bytes of forward and backward) above what was allocated before the forward (the parameters)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cpu = torch.device("cpu")
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        start = tracker.get_tracker_snapshot()[cpu]["Total"]
        nbytes, count = saved_bytes(model, tokens, doc_ids, nodes, keep=True)
        logits = saved_bytes.last_logits
        left = tracker.get_tracker_snapshot()[cpu]["Total"] - start
        logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=logits.dtype))
        del logits, saved_bytes.last_logits
    return nbytes, count, (left, tracker.get_tracker_snapshot("peak")[cpu]["Total"] - start)


if __name__ == "__main__":
    sys.exit(main())
