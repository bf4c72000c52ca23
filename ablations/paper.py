"""The ablations of the MSAR paper and its predecessors (docs/method.md §5; AttnRes numbers from docs/method.md §3).

MSAR ablations run on the paper's default method, Block MSAR (`msar_block`), so each one differs
from a default run in exactly the fields listed.
"""

from .registry import Ablation, register

register(Ablation(
    name="wo_conv",
    question="Do multiple queries help without multiple views? m queries over identical (identity) sources.",
    baseline="msar_block", residual="msar_block", changes={"view": "identity"},
    paper="1.862 (w/o conv) vs AttnRes 1.867 vs MSAR 1.847, 10B tokens"))

register(Ablation(
    name="hpost_streams",
    question="Can streams be made by scalar write-back (H^post-style) instead of convolutions?",
    baseline="msar_block", residual="msar_block", changes={"view": "scalar"},
    paper="near-identical keys after RMSNorm: no head diversity (qualitative)"))

register(Ablation(
    name="attnres_mhc_sum",
    question="Is MSAR just AttnRes plus mHC? Both on, their contributions summed.",
    baseline="msar_block", residual="attnres_mhc_sum", changes={},
    paper="1.861 vs MSAR 1.847, 10B tokens"))

register(Ablation(
    name="channel_split",
    question="Does channel-split multi-head depth attention (16 heads over d/16 channels) help AttnRes?",
    baseline="attnres_block", residual="attnres_block", changes={"heads": 16},
    paper="hurts: 1.752 vs 1.746 (AttnRes, 436M-active MoE)"))

register(Ablation(
    name="no_key_norm",
    question="Does the key RMSNorm of depth attention matter?",
    baseline="attnres_block", residual="attnres_block", changes={"key_norm": False},
    paper="1.743 without vs 1.737 with (AttnRes, 436M-active MoE)"))


# Kernel sets and stream counts: not studied by the paper (it fixed m = 4, k = {4, 8, 12}).
def _kernel_set(name: str, kernels: list[int], why: str) -> None:
    register(Ablation(
        name=name, question=f"{why} (m = {1 + len(kernels)}, kernels {kernels})",
        baseline="msar_block", residual="msar_block", changes={"kernels": kernels},
        paper="" if kernels != [4, 8, 12] else "the paper's choice (MSAR 1.847, 10B tokens)"))


_kernel_set("kernels_4_8_12", [4, 8, 12], "The paper's kernel set, named explicitly for sweeps and tables")
_kernel_set("kernels_2_4", [2, 4], "Do short windows suffice?")
_kernel_set("kernels_3_5_7_9", [3, 5, 7, 9], "Do more, odd-sized views help?")
_kernel_set("m2", [4], "Is one convolved view beside the identity enough?")
_kernel_set("m6", [2, 4, 8, 12, 16], "Do more streams keep helping?")
