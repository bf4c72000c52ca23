"""Finding the runs of a comparison in MLflow: a FINISHED run counts for (variant, seed) when its logged
config hashes to the same key as the run `platform.run` would make now. Runs of a renamed residual are
found under its old names (`platform.tracking.RENAMED`) and hashed under the new one.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from .. import stats, tracking

# Knobs that do not change a run's numbers: runs that differ only in these are the same run.
# `compile`, `compile_scope`, `compile_options` (Inductor settings) and `cuda_graphs` change rounding only (fused kernels; the step's kernels replayed from a
# graph), and so do FlexAttention's tiles (`flex_fwd`, `flex_bwd`: the order of the sums). A graphed training run
# follows the eager one within 2% a step (tests/platform/test_graphs.py), a compiled one too (tests/platform/test_gpu.py).
# `model/moe_topk` picks the same experts either way (ties aside); only the order in which a token's k expert
# outputs are summed differs (tests/platform/test_moe.py).
# `grad_sync` changes when and in how many messages the gradients are averaged, not the average
# (divide by the world size, then sum, in the same dtype: bit-equal, tests/platform/test_ddp.py).
# `residual/recompute_streams` (MSAR's fused read) keeps no streams for its mixer's backward and rebuilds them: the
# same forward to the bit, and the mixer's backward reads the fp32 streams the forward combined h from instead of
# their bf16 copy under bf16-mixed (rounding; tests/kernels/test_msar_attn.py).
# `residual/recompute_every` (mHC's fused writes, also inside attnres_mhc_sum) keeps fewer streams for backward and
# rebuilds the others with the same write kernel: the same forward and gradients to the bit (tests/residuals/test_mhc.py).
HASH_IGNORED = ("trainer/progress_bar", "trainer/threads", "trainer/ckpt_every", "trainer/log_every",
                "trainer/compile", "trainer/compile_scope", "trainer/compile_options", "trainer/cuda_graphs",
                "model/flex_fwd", "model/flex_bwd", "model/moe_topk", "trainer/grad_sync", "data/num_workers",
                "data/cache_dir", "residual/recompute_streams", "residual/recompute_every",
                "residual/mhc/recompute_every")
HASH_GROUPS = ("model/", "data/", "trainer/", "residual/")
# Config fields added after runs were stored, each with the value that does what every run did before
# the field existed. A stored run that lacks the param is hashed as if it had logged this value, so a
# new field does not orphan a study's runs; a run asking for another value still differs. A field
# that changes the numbers goes here when it is added (tests/platform/test_compare.py checks that
# every param today's config logs is either in its snapshot of the logged params or here).
ADDED_PARAMS: dict[str, str] = {
    "trainer/ddp_comm": "fp32",  # gradients were averaged in fp32 before the bf16 hook existed
    "residual/merge_backend": "auto",  # the merge ran on the residual's backend before it had a choice
    "residual/attnres/merge_backend": "auto",  # the same inside attnres_mhc_sum's AttnRes half
    "residual/source_dtype": "stream",  # completed sources were stored in the stream's dtype before the choice
    "residual/attnres/source_dtype": "stream",  # the same inside attnres_mhc_sum's AttnRes half
}


@dataclass
class RunRecord:
    seed: int
    run_id: str
    final_val_loss: float
    tokens_per_s: float
    peak_mem_mb: float
    val_curve: list[tuple[int, float]]  # (step, val/loss) at every validation
    trained_now: bool = False
    val_wall_s: list[float] = field(default_factory=list)  # seconds from the run's start to each validation
    wall_s: float = math.nan  # the run's training wall time (final/wall_s)
    device: str = ""  # what trained it (the platform.device tag; "" when the run predates the tag)
    shared_by: int = 0  # runs that shared its device at once (platform.shared_by; 0: not recorded)


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """The params `train` logs for this config, as MLflow stores them (Lightning's flattening, str, 250 chars)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    flat = _flatten_dict(_convert_params(OmegaConf.to_container(cfg, resolve=True)))
    return {k: str(v)[:250] for k, v in flat.items()}


def _ignored(key: str) -> bool:
    """In HASH_IGNORED, or below one of its keys (a dict param is logged flattened: trainer/compile_options/<key>)."""
    return key in HASH_IGNORED or any(key.startswith(k + "/") for k in HASH_IGNORED)


def config_key(params: Mapping[str, str]) -> str:
    """Hash of what decides a run's numbers (model, data, trainer, residual params; not the seed). The
    residual's name is taken through the rename map, so a run logged under an old name keeps its key."""
    params = {**ADDED_PARAMS, **params}
    items = sorted((k, tracking.canonical_residual(v) if k == "residual/name" else v) for k, v in params.items()
                   if k.startswith(HASH_GROUPS) and not _ignored(k))
    return hashlib.sha1(json.dumps(items).encode()).hexdigest()[:16]


def _search_all(client, experiment_ids: list[str], filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _finished_of(client, experiment_id: str, residual: str) -> list:
    """FINISHED runs logged under any name of the residual (the current one and its old ones), newest first."""
    runs = []
    for name in tracking.logged_names(residual):
        runs += _search_all(client, [experiment_id],
                            f"params.`residual/name` = '{name}' and attributes.status = 'FINISHED'")
    return sorted(runs, key=lambda r: r.info.start_time, reverse=True)


def finished_runs_by_key(client, experiment_id: str, residual: str) -> dict[tuple[str, int], list]:
    """FINISHED runs of a residual, grouped by (config key, seed), newest first."""
    out: dict[tuple[str, int], list] = {}
    for run in _finished_of(client, experiment_id, residual):
        p = run.data.params
        if "seed" not in p:
            continue
        try:
            seed = int(p["seed"])
        except ValueError:
            continue
        out.setdefault((config_key(p), seed), []).append(run)
    return out


def nearest_difference(client, experiment_id: str, residual: str, want: Mapping[str, str]) -> str:
    """For a variant with no matching run: which params differ in the closest run of that residual."""
    runs = _finished_of(client, experiment_id, residual)[:50]
    if not runs:
        return f"no FINISHED run of residual {residual} in this experiment"
    keys = [k for k in want if k.startswith(HASH_GROUPS) and not _ignored(k) and k != "residual/name"]

    def diff(run):
        return [k for k in keys if run.data.params.get(k, ADDED_PARAMS.get(k)) != want[k]]

    best = min(runs, key=lambda r: len(diff(r)))
    if not diff(best):
        return f"runs of this config exist for other seeds only (e.g. {best.info.run_id[:8]}, seed {best.data.params.get('seed')})"
    shown = ", ".join(f"{k}: {best.data.params.get(k)} (wanted {want[k]})" for k in diff(best)[:4])
    return f"closest run {best.info.run_id[:8]} differs in {shown}"


def record_of(client, run, seed: int, trained_now: bool = False) -> RunRecord:
    """The numbers of one run: final loss, the validation curve with the wall time of each point
    (metric timestamp minus the run's start), median tokens/s, peak memory."""
    def history(key):
        return sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))

    val = history("val/loss")
    metrics = run.data.metrics
    final = metrics.get("final/val_loss", val[-1].value if val else math.nan)
    tps = stats.median([m.value for m in history("perf/tokens_per_s")])
    start = run.info.start_time or (val[0].timestamp if val else 0)
    return RunRecord(seed, run.info.run_id, float(final), tps, float(metrics.get("perf/peak_mem_mb", math.nan)),
                     [(m.step, m.value) for m in val], trained_now,
                     val_wall_s=[max(0.0, (m.timestamp - start) / 1000) for m in val],
                     wall_s=float(metrics.get("final/wall_s", math.nan)),
                     device=run.data.tags.get(tracking.DEVICE_TAG, ""),
                     shared_by=int(run.data.tags.get(tracking.SHARED_TAG, "0")))
