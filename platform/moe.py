"""DeepSeek-V3-style MoE feed-forward with sigmoid top-k routing and aux-loss-free balancing.

docs/method.md §6: shared expert(s) plus E fine-grained routed SwiGLU experts. Affinities s = σ(u·e_i) come
from an fp32 router; the top-k experts are chosen on s + bias, where `bias` is a non-gradient
buffer nudged after each optimizer step toward balanced load (`update_bias`); the gates are the
selected s renormalised. Dispatch sorts the (token, expert) assignments by expert and runs one
grouped GEMM per projection over the contiguous groups (no loop over experts on the hot path); the
combine gathers each token's k output rows and sums them (`_Combine`), and the dispatch's backward
gathers and sums each token's k input-gradient rows the same way (`_Dispatch`): no atomic
scatter-add in either direction, so the step is deterministic.

The dispatch never waits for the device: group ends come from a `searchsorted` over the sorted
expert ids (not `bincount`, which reads the maximum back to the host on CUDA), the grouped GEMM
takes them as a device tensor, and the balancing update has no data-dependent branch. Only the
`sliced` reference reads the group sizes back. Loads are accumulated by the caller
(`accumulate_load`, once per forward of the model), so a recomputed forward (activation
checkpointing) does not count its tokens twice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
MOE_IMPLS = ("grouped_mm", "sliced")  # model.moe_impl: the grouped GEMM and its reference twin
MOE_TOPK = ("argmax", "topk")  # model.moe_topk: how the router picks its k experts (the same set)


def grouped_matmul(x: Tensor, w: Tensor, offsets: Tensor, impl: str) -> Tensor:
    """Rows x[offsets[g-1]:offsets[g]] times w[g], for every group g.

    x: (N, K) sorted by group; w: (G, K, M); offsets: (G,) int32 cumulative group ends -> (N, M).
    `impl="grouped_mm"` runs one grouped GEMM; `impl="sliced"` is the reference twin (a loop over
    contiguous slices). On CUDA under autocast the grouped GEMM runs in the autocast dtype (bf16).
    """
    if impl == "sliced":
        ends = offsets.tolist()
        starts = [0] + ends[:-1]
        return torch.cat([x[s:e] @ w[g].to(x.dtype) for g, (s, e) in enumerate(zip(starts, ends))], dim=0)
    if impl != "grouped_mm":
        raise ValueError(f"unknown grouped matmul impl {impl!r}; choose {' or '.join(MOE_IMPLS)}")
    if _grouped_mm is None:
        raise RuntimeError("this torch has no grouped_mm; use model.moe_impl=sliced")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return _grouped_mm(x.to(dtype), w.to(dtype), offs=offsets)


class _Dispatch(torch.autograd.Function):
    """xs = x[token]: every token's row copied to its k assignments, in expert-sorted order.

    x (N, d), token (N·k,) source token of each sorted assignment, inv (N·k,) position in the sorted
    order of assignment t·k + j -> xs (N·k, d). The backward sums each token's k rows as a gather and
    a reduction, dx = dxs[inv].view(N, k, d).sum(1), where autograd's backward of x[token] scatters
    with atomic adds into a zeroed (N, d) buffer (one more pass, and an order that varies from run to
    run): deterministic, and under torch.compile one kernel with the adds that follow."""

    @staticmethod
    def forward(ctx, x: Tensor, token: Tensor, inv: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inv)
        ctx.k = k
        return x[token]

    @staticmethod
    def backward(ctx, dxs: Tensor):
        (inv,) = ctx.saved_tensors
        return dxs[inv].view(inv.numel() // ctx.k, ctx.k, dxs.shape[-1]).sum(1), None, None, None


class _Combine(torch.autograd.Function):
    """y[inv]: the expert-sorted rows y (N·k, d) back in (token, slot) order, as a gather.

    inv and order are inverse permutations. Autograd's backward of y[inv] is an accumulating
    index_put (atomic adds, for indices that cannot repeat here); the gradient of a permutation is the
    inverse permutation of the gradient, dy = dout[order], a gather like the forward."""

    @staticmethod
    def forward(ctx, y: Tensor, inv: Tensor, order: Tensor) -> Tensor:
        ctx.save_for_backward(order)
        return y[inv]

    @staticmethod
    def backward(ctx, dout: Tensor):
        (order,) = ctx.saved_tensors
        return dout[order], None, None


def inverse_permutation(order: Tensor) -> Tensor:
    """inv with inv[order[p]] = p."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def dispatch(x: Tensor, order: Tensor, k: int, inv: Tensor | None = None) -> Tensor:
    """x (N, d), order (N·k,) the argsort of the flattened (N, k) expert choices -> x's row of every sorted
    assignment, (N·k, d) (`_Dispatch`); ``inv``: order's inverse, if the caller has it."""
    return _Dispatch.apply(x, order // k, inverse_permutation(order) if inv is None else inv, k)


def combine(y: Tensor, order: Tensor, k: int, inv: Tensor | None = None) -> Tensor:
    """y (N·k, d) in the sorted order of ``order`` -> each token's k rows summed, (N, d) (`_Combine`);
    ``inv``: order's inverse, if the caller has it."""
    inv = inverse_permutation(order) if inv is None else inv
    return _Combine.apply(y, inv, order).view(-1, k, y.shape[-1]).sum(1)


def top_k_indices(scores: Tensor, k: int, impl: str) -> Tensor:
    """The k largest entries' indices along the last dim, in no particular order: (N, E) -> (N, k).

    ``impl="topk"`` is ``torch.topk`` (on CUDA a selection kernel of its own, one per MoE layer, that a
    compiled graph calls as a library op). ``impl="argmax"`` takes k rounds of argmax, each masking out
    the entry it chose: elementwise work and row reductions only, which Inductor can fuse with the
    router's sigmoid and the gates' gather. Both pick the same set; on ties argmax keeps the lowest
    index, as a stable descending sort would. On an H200 the graphed `small` step took 15.8 ms with
    argmax and 15.9 with topk, timed argmax, topk, argmax in one process
    (benchmarks/results/throughput_small_router_rev.md).
    """
    if impl == "topk":
        return torch.topk(scores, k, dim=-1, sorted=False).indices
    if impl != "argmax":
        raise ValueError(f"unknown top-k impl {impl!r}; choose {' or '.join(MOE_TOPK)}")
    cols = torch.arange(scores.shape[-1], device=scores.device)
    # a chosen entry becomes -inf, so every entry left must be above it, -inf scores included
    scores = scores.clamp_min(torch.finfo(scores.dtype).min)
    picks = []
    for _ in range(k):
        i = scores.argmax(-1, keepdim=True)  # (N, 1)
        picks.append(i)
        scores = scores.masked_fill(cols == i, float("-inf"))
    return torch.cat(picks, dim=-1)  # (N, k)


def sort_key_dtype(n_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds every expert id (uint8 up to 256 experts)."""
    return torch.uint8 if n_experts <= 256 else torch.int16 if n_experts <= 2**15 else torch.int32


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, d: int, n_experts: int, top_k: int, expert_hidden: int, n_shared: int,
                 bias_update_rate: float, route_scale: float = 1.0, impl: str = "grouped_mm",
                 topk_impl: str = "argmax"):
        super().__init__()
        self.n_experts, self.top_k, self.impl, self.topk_impl = n_experts, top_k, impl, topk_impl
        # The sort key's dtype: a radix sort makes one pass per key byte, so expert ids sorted as uint8
        # take 1 pass where topk's int64 indices take 8 (the order is the same: stable, same keys).
        self.key_dtype = sort_key_dtype(n_experts)
        self.bias_update_rate, self.route_scale = bias_update_rate, route_scale
        self.shared = SwiGLU(d, expert_hidden * n_shared) if n_shared > 0 else None
        self.router = nn.Parameter(torch.empty(n_experts, d))  # e_i, used in fp32
        # Routed expert weights, stacked for grouped GEMMs: (E, d, h), (E, d, h), (E, h, d).
        self.w1 = nn.Parameter(torch.empty(n_experts, d, expert_hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, d, expert_hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, expert_hidden, d))
        self.register_buffer("bias", torch.zeros(n_experts))  # balancing bias: no gradient, checkpointed
        self.register_buffer("load", torch.zeros(n_experts), persistent=False)  # assignments since update
        self.register_buffer("counts", torch.zeros(n_experts), persistent=False)  # of the latest forward

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: (N, d) -> expert indices (N, k) and gates (N, k), in fp32."""
        scores = torch.sigmoid(x.float() @ self.router.float().t())  # (N, E)
        # bias steers choice only; the k chosen in no particular order (nothing depends on the slot order,
        # and an ordered top-k sorts every token's k values once more)
        idx = top_k_indices(scores + self.bias, self.top_k, self.topk_impl)  # (N, k)
        gates = scores.gather(-1, idx)
        gates = gates / gates.sum(-1, keepdim=True) * self.route_scale
        return idx, gates

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d)
        idx, gates = self.route(x)  # (N, k)
        flat = idx.flatten().to(self.key_dtype)  # (N*k,) expert of each assignment, as a narrow sort key
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        experts = torch.arange(self.n_experts, device=x.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat[order], experts, right=True)  # (E,) cumulative group ends
        offsets = ends.to(torch.int32)
        inv = inverse_permutation(order)  # (N*k,): sorted position of assignment t*k + j
        xs = dispatch(x, order, self.top_k, inv)  # (N*k, d): row p is token order[p] // k
        h = F.silu(grouped_matmul(xs, self.w1, offsets, self.impl)) * grouped_matmul(xs, self.w3, offsets, self.impl)
        # The gate scales the expert's hidden activation, not its output: the same product (w2 is
        # linear), but the gate's gradient needs h (N*k, hidden) instead of the output (N*k, d).
        h = h * gates.flatten()[order].unsqueeze(-1).to(h.dtype)  # (N*k, hidden)
        y = grouped_matmul(h, self.w2, offsets, self.impl)  # (N*k, d), sorted by expert
        # Combine: each token gathers its k assignments' rows and sums them (`_Combine`): no atomics (an
        # index_add of the k rows of a token into one row needs atomic adds, slow in bf16 and
        # non-deterministic), one rounding per sum, and compiled one kernel that reads y once.
        out = combine(y, order, self.top_k, inv)  # (N, d)
        if self.shared is not None:
            out = out + self.shared(x)
        with torch.no_grad():  # idempotent: a recomputed forward writes the same counts
            self.counts.copy_(torch.diff(ends, prepend=ends.new_zeros(1)))  # (E,) assignments per expert
        return out.reshape(shape).to(x.dtype)

    @torch.no_grad()
    def accumulate_load(self) -> None:
        """Add the latest forward's assignments to the load the next bias update balances."""
        self.load += self.counts

    @property
    def last_stats(self) -> dict[str, Tensor]:
        """Load balance of the latest forward: max and min load over the mean, normalised entropy."""
        counts = self.counts
        p = counts / counts.sum().clamp_min(1)
        entropy = -(p * p.clamp_min(1e-12).log()).sum() / math.log(self.n_experts) if self.n_experts > 1 else p.sum()
        return {"max_over_mean": p.max() * self.n_experts, "min_over_mean": p.min() * self.n_experts,
                "entropy": entropy}

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        update_biases([self])


@torch.no_grad()
def update_biases(layers: list[MoE]) -> None:
    """One balancing step for every MoE layer, from the load summed over all ranks.

    Under data parallelism each rank has routed its own tokens; one all-reduce of the stacked loads
    gives every rank the global load, so the biases stay identical on every rank. An expert with a
    load equal to the mean (and a layer with no load at all) keeps its bias: sign(0) = 0.
    """
    if not layers:
        return
    load = torch.cat([m.load for m in layers])  # (sum of E,): one collective for all layers
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(load)
    for m, row in zip(layers, load.split([m.n_experts for m in layers])):
        m.bias += m.bias_update_rate * torch.sign(row.mean() - row)
        m.load.zero_()
