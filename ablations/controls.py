"""Controls that the paper does not run but that separate its explanations (docs/method.md §4–§5)."""

from .registry import Ablation, register

register(Ablation(
    name="attnres_conv",
    question="Is it token mixing or multiple streams? AttnRes with a single query, then the same convs once on h_l.",
    baseline="msar_block", residual="msar_block", changes={"placement": "post"}))

register(Ablation(
    name="keys_only_conv",
    question="Do the views matter as values, or only as keys? Expanded keys, identity values.",
    baseline="msar_block", residual="msar_block", changes={"expand_values": False}))

register(Ablation(
    name="input_query",
    question="Does an input-dependent pseudo-query help depth attention?",
    baseline="attnres_block", residual="attnres_block", changes={"query": "input"},
    paper="1.731 with vs 1.737 without (AttnRes, 436M-active MoE)"))

register(Ablation(
    name="conv_box",
    question="Does the conv init matter? Causal-box taps (1/k_j) instead of the default Dirac + 0.01 noise.",
    baseline="msar_block", residual="msar_block", changes={"conv_init": "box", "conv_init_noise": 0.0}))

register(Ablation(
    name="fusion_softmax",
    question="Sigmoid gates or a softmax over the m streams for the H^pre fusion?",
    baseline="msar_block", residual="msar_block", changes={"fusion": "softmax"}))

register(Ablation(
    name="taps_shared",
    question="Do conv taps need to be per consuming sublayer, or can one set be shared by all?",
    baseline="msar_block", residual="msar_block", changes={"taps": "shared"}))
