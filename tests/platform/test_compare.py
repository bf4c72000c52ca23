"""Comparisons: the interval statistics against known cases, the table from synthetic MLflow runs,
matching runs by config, and a comparison that trains what is missing and then reuses it."""

import json
import math
import statistics

import mlflow
import pytest
from mlflow.entities import Metric, Param

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


def test_paired_when_the_same_seeds_else_welch():
    variant, base = {0: 2.9, 1: 3.0, 2: 3.3}, {0: 3.0, 1: 3.2, 2: 3.4}
    iv = stats.difference_ci(variant, base)
    assert iv.method == "paired" and iv.estimate == pytest.approx(-0.4 / 3)
    # differences -0.1, -0.2, -0.1: s = 0.057735
    assert iv.half_width == pytest.approx(T975_2 * statistics.stdev([-0.1, -0.2, -0.1]) / math.sqrt(3))
    assert stats.difference_ci({0: 3.1, 1: 3.2}, base).method == "Welch"


# --- the table from synthetic MLflow runs -----------------------------------------------------------------
BASE = [*FAST, "trainer.max_steps=12", "trainer.val_every=4"]


def _log_run(client, exp_id, cfg, final, status="FINISHED", curve_offset=0.5):
    run = client.create_run(exp_id, tags={"synthetic": "true"})
    rid = run.info.run_id
    params = [Param(k, v) for k, v in compare.flat_params(cfg).items()]
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
    exp_id = client.create_experiment("residuals")
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
def test_compare_trains_missing_runs_then_reuses_them(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["compare.runs=[vanilla]", "compare.seeds=[0]", f"compare.out_dir={tmp_path}/out",
            *FAST, "trainer.max_steps=6", "trainer.val_every=3", f"mlflow.tracking_uri={uri}"]
    cc, base = compare.parse_args(args)
    _, rows = compare.run_compare(cc, base)
    first = rows[0].records
    assert len(first) == 1 and first[0].trained_now and math.isfinite(first[0].final_val_loss)
    assert [s for s, _ in first[0].val_curve] == [3, 6]
    _, rows = compare.run_compare(cc, base)
    assert [(r.run_id, r.trained_now) for r in rows[0].records] == [(first[0].run_id, False)]
