"""Controls that the paper does not run but that separate its explanations (SPEC §4–§5)."""

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
    name="conv_dirac",
    question="Does the conv init matter? Dirac taps (+ small noise) instead of the causal box.",
    baseline="msar_block", residual="msar_block", changes={"conv_init": "dirac", "conv_init_noise": 0.01}))

register(Ablation(
    name="fusion_softmax",
    question="Sigmoid gates or a softmax over the m streams for the H^pre fusion?",
    baseline="msar_block", residual="msar_block", changes={"fusion": "softmax"}))

register(Ablation(
    name="taps_shared",
    question="Do conv taps need to be per consuming sublayer, or can one set be shared by all?",
    baseline="msar_block", residual="msar_block", changes={"taps": "shared"}))
