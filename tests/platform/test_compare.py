"""Comparisons: the interval statistics against known cases, the table from synthetic MLflow runs,
matching runs by config, and a comparison that trains what is missing and then reuses it."""

import json
import math
import statistics
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Metric, Param

import residuals
from platform import compare, stats
from tests.helpers import make_cfg
from tests.platform.test_train import FAST

T975_2 = 4.302652729911275  # t_{0.975, 2}, from tables


# --- statistics -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,df,expected", [
    (0.975, 1, 12.706204736174707), (0.975, 2, T975_2), (0.975, 4, 2.7764451051977987),
    (0.975, 10, 2.2281388519649385), (0.95, 30, 1.6972608865939587), (0.5, 3, 0.0),
    (0.025, 5, -2.5705818366147395), (0.975, math.inf, 1.959963984540054),
])
def test_t_quantile_known_values(p, df, expected):
    assert stats.t_quantile(p, df) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_t_quantile_matches_scipy_on_fractional_df():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (0.7, 1.5, 2.6, 7.3, 55.0):
        for p in (0.6, 0.9, 0.975, 0.999):
            assert stats.t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-8)


def test_mean_ci_of_1_2_3():
    iv = stats.mean_ci([1, 2, 3])
    assert iv.estimate == 2 and iv.n == 3 and iv.df == 2
    assert iv.half_width == pytest.approx(T975_2 * 1 / math.sqrt(3), rel=1e-9)  # s = 1
    assert (iv.low, iv.high) == pytest.approx((2 - 2.4841377, 2 + 2.4841377), abs=1e-6)


def test_one_value_has_no_interval():
    iv = stats.mean_ci([5.0])
    assert iv.estimate == 5.0 and math.isnan(iv.half_width)
    assert stats.fmt_interval(iv) == "5.0000 ± n/a"


def test_welch_by_hand():
    a, b = [3.1, 3.2], [2.9, 3.0, 3.3]
    va, vb = statistics.variance(a) / 2, statistics.variance(b) / 3
    df = (va + vb) ** 2 / (va**2 / 1 + vb**2 / 2)
    iv = stats.welch_ci(a, b)
    assert iv.method == "Welch" and iv.df == pytest.approx(df)
    assert iv.estimate == pytest.approx(3.15 - statistics.fmean(b))
    assert iv.half_width == pytest.approx(stats.t_quantile(0.975, df) * math.sqrt(va + vb))


def test_seeds_to_resolve_inverts_the_interval():
    # Differences with mean 0.1 and sd 0.1: the interval t_{n-1}·0.1/√n drops below 0.1 first at n = 7
    # (t_5 = 2.571 / √6 = 1.05; t_6 = 2.447 / √7 = 0.925).
    diffs = [0.0, 0.1, 0.2]  # mean 0.1, sd 0.1, three pairs: unresolved (±0.248)
    iv = stats.paired_ci([1 + d for d in diffs], [1.0] * 3)
    assert not iv.excludes_zero() and stats.seeds_to_resolve(iv) == 7
    n = stats.seeds_to_resolve(iv)
    assert stats.t_quantile(0.975, n - 1) * 0.1 / math.sqrt(n) < 0.1 <= stats.t_quantile(0.975, n - 2) * 0.1 / math.sqrt(n - 1)
    resolved = stats.paired_ci([1.1, 1.11, 1.09], [1.0] * 3)
    assert resolved.excludes_zero() and stats.seeds_to_resolve(resolved) is None
    assert stats.seeds_to_resolve(stats.welch_ci([1.0, 1.2], [1.1, 1.0, 1.3])) is None  # paired only
    tiny = stats.paired_ci([1.0, 1.001, 0.9995], [1.0, 1.0, 1.0])
    assert stats.seeds_to_resolve(tiny, limit=5) == 6  # more than the limit


def test_paired_when_the_same_seeds_else_welch():
    variant, base = {0: 2.9, 1: 3.0, 2: 3.3}, {0: 3.0, 1: 3.2, 2: 3.4}
    iv = stats.difference_ci(variant, base)
    assert iv.method == "paired" and iv.estimate == pytest.approx(-0.4 / 3)
    # differences -0.1, -0.2, -0.1: s = 0.057735
    assert iv.half_width == pytest.approx(T975_2 * statistics.stdev([-0.1, -0.2, -0.1]) / math.sqrt(3))
    assert stats.difference_ci({0: 3.1, 1: 3.2}, base).method == "Welch"


# --- the table from synthetic MLflow runs -----------------------------------------------------------------
BASE = [*FAST, "trainer.max_steps=12", "trainer.val_every=4"]


def _log_run(client, exp_id, cfg, final, status="FINISHED", curve_offset=0.5, drop=()):
    """A synthetic run with cfg's params (but those in ``drop``: a run stored before they existed)."""
    run = client.create_run(exp_id, tags={"synthetic": "true"})
    rid = run.info.run_id
    params = [Param(k, v) for k, v in compare.flat_params(cfg).items() if k not in drop]
    metrics = [Metric("final/val_loss", final, 0, 12), Metric("perf/peak_mem_mb", 700.0, 0, 12)]
    metrics += [Metric("val/loss", final + curve_offset * (12 - s) / 8, 0, s) for s in (4, 8, 12)]
    metrics += [Metric("perf/tokens_per_s", v, 0, s) for s, v in ((10, 900.0), (20, 1000.0), (30, 1100.0))]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    client.log_batch(rid, metrics=metrics)
    client.set_terminated(rid, status)
    return rid


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp_id = client.create_experiment("residuals", artifact_location=(tmp_path / "artifacts").as_uri())  # not ./mlruns
    return uri, client, exp_id


def test_table_from_synthetic_runs(tmp_path, store):
    uri, client, exp_id = store
    base = [*BASE, f"mlflow.tracking_uri={uri}"]
    finals = {"vanilla": [3.0, 3.2, 3.4], "msar_block": [2.9, 3.0, 3.3]}
    for name, values in finals.items():
        for seed, v in enumerate(values):
            _log_run(client, exp_id, make_cfg(*base, f"residual={name}", f"seed={seed}"), v)
    for seed, v in enumerate([3.1, 3.2]):  # an ablation with two seeds only: Welch against msar_block
        _log_run(client, exp_id, make_cfg(*base, "ablation=wo_conv", f"seed={seed}"), v)
    # must not count: a failed run with the same config, another budget; must count: other thread count
    _log_run(client, exp_id, make_cfg(*base, "residual=vanilla", "seed=0"), 0.1, status="FAILED")
    _log_run(client, exp_id, make_cfg(*base, "residual=vanilla", "seed=0", "trainer.max_steps=24"), 0.2)

    cc, rest = compare.parse_args(["compare.runs=[vanilla,msar_block,wo_conv]", "compare.train=false",
                                   f"compare.out_dir={tmp_path}/out", f"compare.report={tmp_path}/report.md",
                                   *base, "trainer.threads=2"])
    text, rows = compare.run_compare(cc, rest, command="test")
    by = {r.variant.name: r for r in rows}
    assert [r.variant.name for r in rows] == ["vanilla", "msar_block", "wo_conv"]

    van = by["vanilla"]
    assert [x.seed for x in van.records] == [0, 1, 2] and van.interval.estimate == pytest.approx(3.2)
    assert van.interval.half_width == pytest.approx(T975_2 * 0.2 / math.sqrt(3))
    assert van.delta is None and van.variant.paper.startswith("1.799")

    msar = by["msar_block"]
    assert msar.delta.method == "paired" and msar.delta.estimate == pytest.approx(-0.4 / 3)
    assert msar.variant.baseline == "vanilla" and msar.variant.paper.startswith("1.750")

    wo = by["wo_conv"]
    assert wo.variant.kind == "ablation" and wo.variant.baseline == "msar_block"
    assert wo.delta.method == "Welch"
    assert wo.delta.estimate == pytest.approx(3.15 - statistics.fmean([2.9, 3.0, 3.3]))
    assert wo.delta.half_width == pytest.approx(stats.welch_ci([3.1, 3.2], [2.9, 3.0, 3.3]).half_width)
    assert "1.862 (w/o conv)" in wo.variant.paper

    assert "| `vanilla` | residual | 3 | 0,1,2 | 3.2000 ± 0.4968 | — (reference) |" in text
    assert "| `msar_block` | residual | 3 | 0,1,2 | 3.0667 ± " in text and "-0.1333 ± 0.1434 (paired)" in text
    assert "(Welch)" in text and "| 1000 | 700 |" in text
    # the report path gets the same document, its plots and JSON beside it under its own name
    assert (tmp_path / "report.md").read_text() == text.replace("(compare.png)", "(report.png)").replace(
        "(compare_bars.png)", "(report_bars.png)")
    for png in ("out/compare.png", "out/compare_bars.png", "report.png", "report_bars.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "report.json").read_text())["msar_block"]["vs"]["vanilla"]["method"] == "paired"
    assert "wo_conv seed 2: runs of this config exist for other seeds only" in text

    logged = client.search_runs([exp_id], filter_string="tags.`platform.kind` = 'comparison'")
    assert len(logged) == 1
    run = logged[0]
    assert run.data.metrics["msar_block/delta"] == pytest.approx(-0.4 / 3)
    assert run.data.metrics["vanilla/n"] == 3
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"compare.md", "compare.png", "compare.json",
                                                                       "compare_bars.png"}


def test_missing_runs_are_reported_with_the_nearest_config(tmp_path, store):
    uri, client, exp_id = store
    base = [*BASE, f"mlflow.tracking_uri={uri}"]
    _log_run(client, exp_id, make_cfg(*base, "residual=vanilla", "seed=0", "trainer.lr=0.001"), 3.0)
    cc, rest = compare.parse_args(["compare.runs=[vanilla]", "compare.seeds=[0]", "compare.train=false",
                                   f"compare.out_dir={tmp_path}/out", "compare.log_comparison=false", *base])
    text, rows = compare.run_compare(cc, rest)
    assert rows[0].records == []
    assert "trainer/lr: 0.001 (wanted 0.003)" in text


def test_config_key_ignores_knobs_that_do_not_change_numbers():
    key = compare.config_key(compare.flat_params(make_cfg(*BASE, "residual=vanilla")))
    assert key == compare.config_key(compare.flat_params(make_cfg(*BASE, "residual=vanilla", "trainer.threads=7",
                                                                  "trainer.progress_bar=true", "seed=5")))
    assert key != compare.config_key(compare.flat_params(make_cfg(*BASE, "residual=vanilla", "trainer.lr=0.01")))
    assert key != compare.config_key(compare.flat_params(make_cfg(*BASE, "residual=msar_block")))


def test_variants_and_arguments():
    cc, base = compare.parse_args(["compare.runs=[no_key_norm,msar_block]", "trainer.max_steps=5"])
    assert base == ["trainer.max_steps=5"] and cc.seeds == [0, 1, 2]
    # the references first, then each baseline just before the first variant that needs it
    assert [v.name for v in compare.plan_variants(cc)] == ["vanilla", "attnres_block", "no_key_norm", "msar_block"]
    cc, _ = compare.parse_args(["compare.runs=[no_key_norm,msar_block]", "compare.references=[]"])
    assert [v.name for v in compare.plan_variants(cc)] == ["attnres_block", "no_key_norm", "vanilla", "msar_block"]
    for bad, match in ((["residual=vanilla"], "compare.runs"), (["seed=1"], "compare.seeds"),
                       (["compare.runs=[nope]"], "neither a registered ablation"),
                       (["compare.seeds=null"], "needs compare.train=false"),
                       (["compare.references=[vanila]"], "'vanila' is neither"),
                       (["compare.target=mhc"], "must be one of compare.references"),
                       (["compare.workers=-1"], "compare.workers=-1 must be >= 0"),
                       (["compare=paper_large"], "not a preset; presets: .*paper_small")):
        with pytest.raises(ValueError, match=match):
            cc, _ = compare.parse_args(bad)
            compare.plan_variants(cc)
    with pytest.raises(Exception, match="sedes"):
        compare.parse_args(["compare.sedes=[1]"])


# --- training what is missing, then reusing it --------------------------------------------------------------
def test_compare_trains_missing_runs_on_two_workers_then_reuses_them(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"  # a fresh store: the two workers share it from their first run
    args = ["compare.runs=[vanilla]", "compare.seeds=[0,1]", f"compare.out_dir={tmp_path}/out", "compare.workers=2",
            *FAST, "trainer.max_steps=6", "trainer.val_every=3", f"mlflow.tracking_uri={uri}"]
    cc, base = compare.parse_args(args)
    text, rows = compare.run_compare(cc, base)
    first = rows[0].records
    assert [r.seed for r in first] == [0, 1] and all(r.trained_now for r in first)
    from platform.env import machine_description  # each run is tagged with what trained it

    assert {r.device for r in first} == {machine_description()}
    assert f"runs trained on: {machine_description()} (2 runs)" in text
    assert {r.shared_by for r in first} == {2}  # two workers on one CPU: their timings say so
    assert "**Speed columns:** up to 2 runs shared one device at once" in text
    assert all(math.isfinite(r.final_val_loss) for r in first) and first[0].final_val_loss != first[1].final_val_loss
    assert all([s for s, _ in r.val_curve] == [3, 6] for r in first)
    assert all(0 <= r.val_wall_s[0] <= r.val_wall_s[1] for r in first)  # seconds since each run's start
    # vanilla is its own target: each seed reaches its own final loss, at the latest at its last validation
    assert all(hit is not None and hit[1] <= 6 for hit in rows[0].to_target.values())
    logs = sorted((tmp_path / "out" / "runs").glob("vanilla_s*/train.log"))
    assert len(logs) == 2  # with workers, each run's output goes to its own log
    _, rows = compare.run_compare(cc, base)
    assert [(r.run_id, r.trained_now) for r in rows[0].records] == [(r.run_id, False) for r in first]


# --- references, time to the target's loss, the bar chart --------------------------------------------------
def test_time_to_loss_interpolates_between_validations():
    curve, wall = [(4, 3.0), (8, 2.5), (12, 2.0)], [10.0, 20.0, 30.0]
    assert compare.time_to_loss(curve, wall, 2.25) == pytest.approx((25.0, 10.0))  # halfway from step 8 to 12
    assert compare.time_to_loss(curve, wall, 2.0) == pytest.approx((30.0, 12.0))  # exactly at the last one
    assert compare.time_to_loss(curve, wall, 3.5) == (10.0, 4.0)  # already at the first validation
    assert compare.time_to_loss(curve, wall, 1.9) is None  # never
    assert compare.time_to_loss([(4, 3.0), (8, 3.2), (12, 2.4)], wall, 2.8) == pytest.approx((25.0, 10.0))


def _log_timed_run(client, exp_id, cfg, curve, start_ms=1_000_000):
    """A run whose validations happen at the given seconds after its start: curve = [(step, loss, seconds)]."""
    rid = client.create_run(exp_id, start_time=start_ms).info.run_id
    params = [Param(k, v) for k, v in compare.flat_params(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    client.log_batch(rid, metrics=[Metric("val/loss", v, start_ms + int(1000 * t), s) for s, v, t in curve]
                     + [Metric("final/val_loss", curve[-1][1], 0, curve[-1][0])])
    client.set_terminated(rid, "FINISHED")
    return rid


def test_references_and_time_to_the_target_loss(tmp_path, store):
    uri, client, exp_id = store
    base = [*BASE, f"mlflow.tracking_uri={uri}"]
    curves = {  # (step, val loss, seconds from the run's start); finals per seed
        "vanilla": {0: [(4, 3.6, 10), (8, 3.3, 20), (12, 3.0, 30)], 1: [(4, 3.8, 12), (8, 3.5, 24), (12, 3.2, 36)]},
        "attnres_block": {0: [(4, 3.4, 11), (8, 3.0, 22), (12, 2.8, 33)], 1: [(4, 3.6, 11), (8, 3.1, 22), (12, 3.0, 33)]},
        "msar_block": {0: [(4, 3.5, 10), (8, 3.1, 20), (12, 2.9, 30)], 1: [(4, 3.7, 10), (8, 3.4, 20), (12, 3.3, 30)]},
    }
    for name, by_seed in curves.items():
        for seed, curve in by_seed.items():
            _log_timed_run(client, exp_id, make_cfg(*base, f"residual={name}", f"seed={seed}"), curve)
    cc, rest = compare.parse_args(["compare.runs=[msar_block]", "compare.seeds=[0,1]", "compare.train=false",
                                   "compare.references=[vanilla,attnres_block]", f"compare.out_dir={tmp_path}/out",
                                   *base])
    text, rows = compare.run_compare(cc, rest)
    by = {r.variant.name: r for r in rows}
    assert [r.variant.name for r in rows] == ["vanilla", "attnres_block", "msar_block"]
    msar = by["msar_block"]
    assert msar.refs["vanilla"].method == "paired" and msar.refs["vanilla"].estimate == pytest.approx(0.0)
    assert msar.refs["attnres_block"].estimate == pytest.approx(((2.9 - 2.8) + (3.3 - 3.0)) / 2)
    assert by["attnres_block"].refs["attnres_block"] is None  # itself
    # the target of seed s is vanilla's final loss of seed s: 3.0 (seed 0), 3.2 (seed 1)
    assert by["vanilla"].to_target == {0: pytest.approx((30.0, 12.0)), 1: pytest.approx((36.0, 12.0))}
    assert by["attnres_block"].to_target[0] == pytest.approx((22.0, 8.0))
    assert by["attnres_block"].to_target[1] == pytest.approx((11 + 11 * 0.4 / 0.5, 4 + 4 * 0.4 / 0.5))
    assert msar.to_target[0] == pytest.approx((25.0, 10.0)) and msar.to_target[1] is None  # 3.3 > 3.2
    assert "Δ vs vanilla (± 95% CI)" in text and "Δ vs attnres_block (± 95% CI)" in text
    assert "time to vanilla's loss" in text and "(1/2 reached)" in text and "not reached" in text
    assert "25 at step 10 (1/2 reached)" in text  # msar_block: seed 0 at 25 s, step 10
    # msar_block − attnres_block: +0.2 ± (differences 0.1, 0.3) unresolved with two seeds
    assert "- `msar_block` − `attnres_block` = +0.2000 ± 1.2706 with 2 seeds: about 5 seeds" in text
    speedup = (30 + 36) / 2 / ((22 + 11 + 11 * 0.8) / 2)
    assert f"{speedup:.2f}×" in text
    logged = client.search_runs([exp_id], filter_string="tags.`platform.kind` = 'comparison'")[0].data.metrics
    assert logged["msar_block/vs_attnres_block"] == pytest.approx(0.2)
    assert logged["msar_block/time_to_target_s"] == pytest.approx(25.0) and logged["msar_block/reached_target"] == 1


def test_runs_of_a_renamed_residual_still_count(tmp_path, store, monkeypatch):
    uri, client, exp_id = store
    base = [*BASE, f"mlflow.tracking_uri={uri}"]
    cfg = make_cfg(*base, "residual=vanilla", "seed=0")
    rid = client.create_run(exp_id).info.run_id
    params = {**compare.flat_params(cfg), "residual/name": "plain"}  # logged before vanilla was renamed
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(rid, params=items[i:i + 100])
    client.log_batch(rid, metrics=[Metric("final/val_loss", 3.0, 0, 12), Metric("val/loss", 3.0, 0, 12)])
    client.set_terminated(rid, "FINISHED")
    args = ["compare.runs=[vanilla]", "compare.seeds=[0]", "compare.train=false", "compare.log_comparison=false",
            f"compare.out_dir={tmp_path}/out", *base]
    _, rows = compare.run_compare(*compare.parse_args(args))
    assert rows[0].records == []  # without the rename map the run is orphaned
    monkeypatch.setattr(compare.matching.tracking, "RENAMED", {"plain": "vanilla"})
    _, rows = compare.run_compare(*compare.parse_args(args))
    assert [r.run_id for r in rows[0].records] == [rid]


# --- the study preset ---------------------------------------------------------------------------------------
def test_paper_small_preset_composes_with_one_budget_and_overridable_steps():
    cc, base = compare.parse_args(["compare=paper_small", "trainer.max_steps=7"])
    assert cc.runs == ["vanilla", "mhc", "attnres", "attnres_block", "msar_block", "wo_conv", "attnres_mhc_sum",
                       "attnres_conv"]
    assert len(cc.seeds) >= 3 and cc.references == ["vanilla", "attnres_block"]
    assert base.count("trainer.max_steps=7") == 1 and not any(o == "trainer.max_steps=400" for o in base)
    variants = compare.plan_variants(cc)
    assert {v.name: v.kind for v in variants}["wo_conv"] == "ablation"
    cfgs = [make_cfg(*base, v.override, "seed=1") for v in variants]
    assert {(c.model.name, c.trainer.accelerator, c.trainer.max_steps) for c in cfgs} == {("small", "gpu", 7)}
    from platform.accounting import token_budget

    assert {token_budget(c) for c in cfgs} == {7 * 16 * 1024}  # one token budget for every variant
    data = [{k: v for k, v in compare.flat_params(c).items() if k.startswith("data/") or k == "seed"} for c in cfgs]
    assert all(d == data[0] for d in data)  # the same data (and so data order) for every variant of a seed
    assert {c.residual.name for c in cfgs} >= {"vanilla", "mhc", "attnres", "attnres_block", "msar_block"}


def test_a_preset_with_a_misspelt_key_fails_naming_the_file(tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text("runs: [vanilla]\nsedes: [0]\n")
    monkeypatch.setattr(compare.plan, "PRESET_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"conf/compare/bad.yaml: .*sedes.*options: runs, seeds"):
        compare.parse_args(["compare=bad"])


# --- parallel runs ------------------------------------------------------------------------------------------
def test_missing_runs_are_shared_over_workers_one_gpu_each(monkeypatch, tmp_path):
    import threading

    lock, running, seen = threading.Lock(), [], []
    both = threading.Barrier(2, timeout=30)

    def fake_train_run(base, variant, seed, run_dir, env=None, log=None):
        with lock:
            running.append(env["CUDA_VISIBLE_DEVICES"])
            seen.append((variant.name, seed, env["CUDA_VISIBLE_DEVICES"], env["NCCL_NVLS_ENABLE"], set(running)))
        if len(seen) <= 2:
            both.wait()  # the first two runs are in flight together, on different GPUs
        with lock:
            running.remove(env["CUDA_VISIBLE_DEVICES"])
        return 0 if seed != 2 else 3

    monkeypatch.setattr(compare.command, "train_run", fake_train_run)
    jobs = [(compare.resolve_variant("vanilla", "vanilla"), s) for s in range(4)]
    codes = compare.train_missing([], jobs, tmp_path, workers=2, gpus=["4", "7"])
    assert codes == {("vanilla", 0): 0, ("vanilla", 1): 0, ("vanilla", 2): 3, ("vanilla", 3): 0}
    assert sorted(s for _, s, *_ in seen) == [0, 1, 2, 3]
    assert all(len(r) == len(set(r)) for *_, r in seen)  # never two runs on one GPU
    assert {g for _, _, g, _, _ in seen[:2]} == {"4", "7"} and {n for *_, n, _ in seen} == {"0"}
    assert compare.n_workers(compare.parse_args(["compare.workers=0"])[0], ["0", "1", "2"]) == 3
    assert compare.n_workers(compare.parse_args(["compare.workers=0"])[0], []) == 1


def test_speed_caveat_only_when_runs_shared_their_device_or_do_not_say():
    from platform.compare.command import speed_caveat
    from platform.compare.matching import RunRecord
    from platform.compare.table import Row

    def rows(*shares):
        recs = [RunRecord(i, f"r{i}", 3.0, 1e5, 1.0, [], shared_by=s) for i, s in enumerate(shares)]
        return [Row(compare.resolve_variant("vanilla", "vanilla"), recs, stats.mean_ci([3.0]), None)]

    assert speed_caveat(rows(1, 1)) == ""
    assert "up to 4 runs shared one device at once, so tokens/s and the times to the target's loss are not the " \
           "variants' own speeds" in speed_caveat(rows(1, 4))
    assert "1 run(s) do not record whether they shared it, so tokens/s and the times to the target's loss may not " \
           "be the variants' own speeds" in speed_caveat(rows(1, 0))


def test_missing_runs_are_trained_seed_by_seed(monkeypatch, tmp_path):
    # A comparison cut short (a time limit) still holds whole seeds of every variant.
    order = []
    monkeypatch.setattr(compare.command, "train_missing",
                        lambda base, jobs, *a: order.extend((v.name, s) for v, s in jobs) or {})
    cc, base = compare.parse_args(["compare.runs=[vanilla,attnres_block]", "compare.seeds=[0,1]",
                                   f"compare.out_dir={tmp_path}/out", *FAST,
                                   f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    compare.run_compare(cc, base)
    assert order == [("vanilla", 0), ("attnres_block", 0), ("vanilla", 1), ("attnres_block", 1)]


def test_a_misspelt_compare_key_is_one_line_naming_it():
    from platform.compare import main

    with pytest.raises(SystemExit) as exc:
        main(["compare.nokey=1"])
    message = str(exc.value.code)
    assert message.startswith("error: ") and "nokey" in message and "\n" not in message, message


# --- stored runs keep matching as the config grows ------------------------------------------------------
LOGGED_2026_11_30 = json.loads((Path(__file__).parent / "logged_params_2026-11-30.json").read_text())["params"]


@pytest.mark.parametrize("residual", sorted(LOGGED_2026_11_30))
def test_every_param_added_since_a_stored_study_has_its_old_behaviour_registered(residual):
    """A field added to the config after runs were stored changes every new run's key; unless it is a
    knob that does not change numbers (HASH_IGNORED) or registered with the value that does what the
    old runs did (ADDED_PARAMS), the stored study stops counting (`compare.train=false` finds nothing)."""
    from platform.compare.matching import ADDED_PARAMS

    today = {k for k in compare.flat_params(make_cfg(*BASE, f"residual={residual}"))
             if k.startswith(compare.HASH_GROUPS)}
    stored = set(LOGGED_2026_11_30[residual])
    added = sorted(today - stored - set(compare.HASH_IGNORED) - set(ADDED_PARAMS))
    assert not added, (f"{residual}: params {added} did not exist when the 2026-11-30 study was stored; register each "
                       "in platform/compare/matching.py (ADDED_PARAMS with its old behaviour, or HASH_IGNORED)")
    removed = sorted(stored - today - set(compare.HASH_IGNORED))
    assert not removed, f"{residual}: params {removed} were removed; stored runs still log them and no longer match"


# Defaults changed after their field was added, (residual, param) -> today's default: the numbers changed with them, so
# a stored run of the old default (logged, or stored before the field) is another configuration and trains again
CHANGED_DEFAULTS = {("attnres_block", "residual/source_dtype"): "autocast",  # bf16 sources under autocast, 2026-12-03
                    ("msar_block", "residual/source_dtype"): "autocast",  # the same for Block MSAR, 2026-12-05
                    ("msar", "residual/source_dtype"): "autocast"}  # and for full MSAR, 2026-12-05 (night)


def test_a_run_stored_before_a_field_existed_matches_its_old_behaviour_only():
    from platform.compare.matching import ADDED_PARAMS

    seen = set()
    for residual in residuals.names():  # a field may belong to some residuals only
        params = compare.flat_params(make_cfg(*BASE, f"residual={residual}"))
        old = {k: v for k, v in params.items() if k not in ADDED_PARAMS and k != "trainer/cuda_graphs"}
        added = [k for k in ADDED_PARAMS if k in params]
        changed = {k for k in added if (residual, k) in CHANGED_DEFAULTS}
        # today's defaults: the old behaviour, but where a default changed since
        assert all(params[k] == CHANGED_DEFAULTS.get((residual, k), ADDED_PARAMS[k]) for k in added)
        assert (compare.config_key(old) == compare.config_key(params)) == (not changed), residual
        seen.update(added)
    assert {k for _, k in CHANGED_DEFAULTS} <= seen
    assert ADDED_PARAMS and seen == set(ADDED_PARAMS)  # every registered field is checked above
    block = compare.flat_params(make_cfg(*BASE, "residual=attnres_block"))
    torch_merge = compare.flat_params(make_cfg(*BASE, "residual=attnres_block", "residual.merge_backend=torch"))
    assert compare.config_key(torch_merge) != compare.config_key(block)  # another value is another run
    params = compare.flat_params(make_cfg(*BASE, "residual=vanilla"))
    old = {k: v for k, v in params.items() if k not in ADDED_PARAMS and k != "trainer/cuda_graphs"}
    bf16 = compare.flat_params(make_cfg(*BASE, "residual=vanilla", "trainer.ddp_comm=bf16"))
    assert compare.config_key(old) != compare.config_key(bf16)
    graphs_off = compare.flat_params(make_cfg(*BASE, "residual=vanilla", "trainer.cuda_graphs=false"))
    assert compare.config_key(graphs_off) == compare.config_key(params)
