"""Block MSAR: MSAR over block summaries (docs/method.md §4, built like Block AttnRes, docs/method.md §3).

Paper: "Multi-Stream Attention Residuals" (preprint; reconstructed in docs/method.md §4).

Between sublayers only single-stream tensors are kept: b_0 = the embedding, the completed block
summaries and the running partial sum of the current block, N+1 tensors (B, T, d) at most, as in
Block AttnRes. The views are never stored across sublayers: each consumer expands the summaries it
attends over into its m views on demand. E_j is linear, so E_j(b_n) = Σ_{k∈block n} E_j(v_k) and
expanding a summary is exact. With ``block_size=1`` this is ``msar`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attnres_block import BlockFields, BlockSummaries
from .msar import Msar
from .registry import register


@register("msar_block")
class MsarBlock(BlockSummaries, Msar):
    """MSAR over [b_0, completed block summaries, partial]; taps="per_block" means per block of S."""

    @dataclass
    class Config(BlockFields, Msar.Config):
        """MSAR's fields plus ``block_size``."""

        # source_dtype="autocast" comes from msar's fields (bf16 sources under bf16 autocast). Block MSAR's timing,
        # H200, `medium`, one process (throughput_medium_msar_sources.md): 361.5 -> 345.9 ms a step (0.432x -> 0.452x
        # vanilla's), peak 47.61 -> 44.55 GiB; 60 training steps at `small`, seeds 0 and 1, within the run-to-run
        # spread of fp32 sources (backend_training_small_msar_block_bf16_sources.md; docs/kernel_msar.md, "The
        # sources in bf16")
