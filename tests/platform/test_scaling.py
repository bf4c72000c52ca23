"""The scaling fit: recovering known multipliers from synthetic power laws, the bootstrap interval,
the config checks, and a CPU smoke run that trains three tiny sizes and then only reads MLflow."""

import math

import numpy as np
import pytest

from platform import scaling
from tests.helpers import make_cfg

E_TRUE, A_TRUE, ALPHA_TRUE = 1.9, 2.2, 0.35
C = np.geomspace(1e14, 4e15, 4)  # four sizes spanning 40x in compute


def law(compute, multiplier=1.0, E=E_TRUE, A=A_TRUE, alpha=ALPHA_TRUE, C0=1e15):
    """A variant worth `multiplier` x vanilla's compute: vanilla's curve evaluated at multiplier * C."""
    return E + A * (multiplier * np.asarray(compute) / C0) ** -alpha


def synthetic(multipliers: dict[str, float], seeds: int = 1, noise: float = 0.0, rng_seed: int = 0):
    rng = np.random.default_rng(rng_seed)
    compute, loss, groups, cells = [], [], [], []
    for g, m in multipliers.items():
        for i, c in enumerate(C):
            for _ in range(seeds):
                compute.append(c)
                loss.append(law(c, m) + noise * rng.standard_normal())
                groups.append(g)
                cells.append((g, i))
    return np.array(compute), np.array(loss), groups, cells


def test_noise_free_power_laws_give_back_their_multipliers_and_exponent():
    truth = {"vanilla": 1.0, "attnres_block": 1.3, "msar_block": 1.58}
    compute, loss, groups, _ = synthetic(truth)
    fit = scaling.fit_power_law(compute, loss, groups, "vanilla")
    assert fit.E == pytest.approx(E_TRUE, abs=1e-3)
    assert all(a == pytest.approx(ALPHA_TRUE, rel=1e-3) for a in fit.alpha.values())
    for g, m in truth.items():
        for at in (C[0], C[-1], 1e16):  # a shared exponent: the same multiplier at every compute
            assert fit.multiplier(g, at) == pytest.approx(m, rel=1e-3)
    assert np.allclose(fit.predict("msar_block", C), law(C, 1.58), atol=1e-5)


def test_a_worse_variant_gets_a_multiplier_below_one_and_fixed_E_is_exact():
    compute, loss, groups, _ = synthetic({"vanilla": 1.0, "worse": 0.7})
    fit = scaling.fit_power_law(compute, loss, groups, "vanilla", E=E_TRUE)
    assert fit.E == E_TRUE and fit.sse < 1e-20
    assert fit.multiplier("worse", 3e14) == pytest.approx(0.7, rel=1e-9)


def test_per_variant_exponents_give_a_compute_dependent_multiplier():
    compute = np.concatenate([C, C])
    loss = np.concatenate([law(C), law(C, alpha=0.45)])  # the variant improves faster with compute
    groups = ["vanilla"] * 4 + ["steeper"] * 4
    fit = scaling.fit_power_law(compute, loss, groups, "vanilla", E=E_TRUE, shared_alpha=False)
    assert fit.alpha["steeper"] == pytest.approx(0.45, rel=1e-9)
    for at in (1e14, 1e15, 1e16):
        # vanilla reaches A (C'/C0)^-0.35 = A (at/C0)^-0.45 at C' = C0 (at/C0)^(0.45/0.35)
        expected = 1e15 * (at / 1e15) ** (0.45 / 0.35) / at
        assert fit.multiplier("steeper", at) == pytest.approx(expected, rel=1e-6)
    assert fit.multiplier("steeper", 1e16) > fit.multiplier("steeper", 1e14)


def test_bootstrap_over_seeds_covers_the_true_multiplier():
    compute, loss, groups, cells = synthetic({"vanilla": 1.0, "msar_block": 1.5}, seeds=3, noise=0.003)
    fit = scaling.fit_power_law(compute, loss, groups, "vanilla")
    ivs = scaling.bootstrap_multipliers(compute, loss, groups, cells, "vanilla", at=C[-1], n_boot=200, seed=1)
    low, high, ok = ivs["msar_block"]
    assert ok >= 190 and low < 1.5 < high and low < fit.multiplier("msar_block", C[-1]) < high
    assert high / low < 1.6  # informative at this noise level, not just wide
    assert ivs["vanilla"][:2] == pytest.approx((1.0, 1.0))


def test_bootstrap_with_one_seed_resamples_residuals():
    compute, loss, groups, cells = synthetic({"vanilla": 1.0, "msar_block": 1.5}, noise=0.002, rng_seed=3)
    low, high, ok = scaling.bootstrap_multipliers(compute, loss, groups, cells, "vanilla", at=C[-1], n_boot=100,
                                                  seed=0)["msar_block"]
    assert ok > 50 and low < high and low < 1.5 * 1.3 and high > 1.5 / 1.3


@pytest.mark.parametrize("kwargs,match", [
    ({"reference": "mhc"}, "reference='mhc' has no points"),
    ({"E": 5.0}, "E=5.0 must be >= 0 and below the smallest loss"),
    ({"compute": [1e15] * 4}, "needs points at two or more compute values"),
])
def test_fit_errors_name_the_problem(kwargs, match):
    args = {"compute": list(C), "loss": list(law(C)), "groups": ["vanilla"] * 4, "reference": "vanilla", **kwargs}
    with pytest.raises(ValueError, match=match):
        scaling.fit_power_law(args.pop("compute"), args.pop("loss"), args.pop("groups"), **args)


@pytest.mark.parametrize("argv,match", [
    (["model=small"], "come from scaling.sizes"),
    (["scaling.variants=[vanilla,nope]"], "'nope' is not a residual or ablation"),
    (["scaling.steps=[10,20]"], r"scaling.sizes \(3\) needs two or more entries and scaling.steps \(2\)"),
    (["scaling.variants=[attnres]"], "scaling.reference='vanilla' must be one of"),
    (["scaling.levl=0.9"], "levl"),
    (["scaling.workers=-1"], r"scaling.workers=-1 must be >= 0"),
])
def test_bad_arguments_fail_before_training(argv, match):
    with pytest.raises(Exception, match=match):
        scaling.parse_args(argv)


def test_finished_runs_are_matched_as_comparisons_match_them(tmp_path):
    """A stored run counts for a point when its logged params match the point's config and seed as
    `platform.compare` matches them: display knobs and CUDA graphs do not matter, the seed and the
    numbers' knobs do, and a run stored before a field was added counts at the field's old value."""
    import mlflow

    from platform.compare.matching import ADDED_PARAMS
    from tests.platform.test_compare import _log_run

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp_id = client.create_experiment("residuals", artifact_location=(tmp_path / "artifacts").as_uri())
    old = _log_run(client, exp_id, make_cfg("residual=vanilla", "seed=3"), 3.0,
                   drop=(*ADDED_PARAMS, "trainer/cuda_graphs"))
    index = {}
    assert [r.info.run_id for r in scaling.finished_run(client, exp_id, make_cfg(
        "residual=vanilla", "seed=3", "trainer.progress_bar=false", "trainer.threads=1"), index)] == [old]
    assert set(index) == {"vanilla"}  # the residual's runs searched once, kept for the next points
    for change in ("seed=1", "trainer.lr=0.001", "model.d_model=32", "data.batch_size=4", "trainer.ddp_comm=bf16"):
        assert scaling.finished_run(client, exp_id, make_cfg("residual=vanilla", "seed=3", change)) == [], change
    assert scaling.finished_run(client, exp_id, make_cfg("residual=msar_block", "seed=3")) == []


FAST = ["model.n_heads=2", "model.n_kv_heads=1", "model.seq_len=32", "model.dense_hidden=64",
        "model.expert_hidden=32", "model.n_experts=4", "data.vocab_size=512", "data.batch_size=4",
        "trainer.progress_bar=false", "trainer.threads=1", "trainer.warmup_steps=1", "trainer.val_batches=1",
        "trainer.val_every=2", "trainer.log_every=1", "mlflow.depth_heatmaps=false"]


def test_smoke_trains_three_sizes_then_reads_them_back(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sc = scaling.ScalingConfig(sizes=["tiny model.d_model=16", "tiny model.d_model=32", "tiny model.d_model=64"],
                               steps=[2, 2, 3], n_boot=20, name="smoke", report_dir=str(tmp_path / "report"),
                               out_dir=str(tmp_path / "runs"))
    scaling.check(sc)
    base = [*FAST, f"mlflow.tracking_uri={uri}"]
    first = scaling.run_scaling(sc, base, command="test")
    points = first["points"]
    assert len(points) == 9 and all(p.trained_now and math.isfinite(p.loss) for p in points)
    by = {(p.variant, p.size): p for p in points}
    # Compute grows with the model and the steps; the residual's own FLOPs count too.
    xs, s, m = (by[("vanilla", size)].compute for size in sc.sizes)
    assert xs < s < m and m / xs > 3
    assert by[("msar_block", sc.sizes[0])].compute > xs
    assert by[("vanilla", sc.sizes[2])].tokens == 3 * 4 * 32
    for suffix in ("md", "png", "json"):
        assert (tmp_path / "report" / f"smoke.{suffix}").stat().st_size > 0
    assert "compute multiplier" in (tmp_path / "report" / "smoke.md").read_text()
    client = mlflow.MlflowClient(uri)
    logged = client.search_runs([client.get_experiment_by_name("residuals").experiment_id],
                                filter_string="tags.`platform.kind` = 'scaling'")
    assert len(logged) == 1 and "msar_block/multiplier" in logged[0].data.metrics

    sc.train = False
    again = scaling.run_scaling(sc, base, command="test")
    assert [(p.run_id, p.loss, p.compute) for p in again["points"]] == [(p.run_id, p.loss, p.compute) for p in points]
    assert not any(p.trained_now for p in again["points"])


def test_a_failed_run_is_reported_and_the_rest_go_on(monkeypatch, tmp_path):
    import platform.train

    class Page(list):  # one page of MLflow's paginated search, the last
        token = None

    class NoRuns:  # an empty store: every point has to be trained
        def search_runs(self, *args, **kwargs):
            return Page()

    def boom(cfg, **kwargs):
        raise FloatingPointError(f"val/loss is nan ({cfg.model.d_model})")

    monkeypatch.setattr(platform.train, "train", boom)
    sc = scaling.ScalingConfig(variants=["vanilla"], sizes=["tiny model.d_model=16", "tiny"], steps=[2, 2],
                               out_dir=str(tmp_path / "runs"))
    points, missing = scaling.collect(sc, FAST, NoRuns(), "0")
    assert points == [] and len(missing) == 2
    assert "vanilla @ tiny, seed 0: failed (FloatingPointError: val/loss is nan (64))" in missing[1]


def test_default_sizes_compose_for_every_variant_and_span_over_10x_in_compute():
    from platform.accounting import backbone_flops_per_token
    from platform.config import validate

    sc = scaling.ScalingConfig()
    scaling.check(sc)
    compute = []
    for size, steps in zip(sc.sizes, sc.steps):
        for variant in sc.variants:
            cfg = make_cfg(*scaling.size_overrides(size), scaling.variant_override(variant), "data=large",
                           "trainer=gpu", f"trainer.max_steps={steps}")
            validate(cfg)  # e.g. block_size 4 must divide every size's sublayer count
        compute.append(3 * backbone_flops_per_token(cfg.model, cfg.data.vocab_size) * scaling.training_tokens(cfg))
    assert compute == sorted(compute) and compute[-1] / compute[0] > 10


def test_command_line_errors_are_one_line():
    with pytest.raises(SystemExit, match=r"^error: .*no viable alternative"):
        scaling.main(["scaling.sizes=[tiny model.d_model=16]"])  # unquoted spaces: Hydra's grammar refuses
    with pytest.raises(SystemExit, match=r"^error: scaling.n_boot=-1 must be >= 0"):
        scaling.main(["scaling.n_boot=-1"])


def test_no_multiplier_when_the_reference_does_not_improve_with_compute():
    compute = np.concatenate([C, C])
    loss = np.concatenate([law(C, alpha=-0.05), law(C, 1.5)])  # vanilla's loss rises with compute
    fit = scaling.fit_power_law(compute, loss, ["vanilla"] * 4 + ["msar_block"] * 4, "vanilla", E=E_TRUE,
                                shared_alpha=False)
    assert fit.alpha["vanilla"] < 0 and math.isnan(fit.multiplier("msar_block", C[-1]))


def test_workers_train_the_points_as_processes_then_one_fit(tmp_path):
    # scaling.workers=2 on the CPU: every missing point is its own `scaling.fit=false` process, two at a
    # time, sharing one MLflow store; the parent reads them back and fits once. A second call trains nothing.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sc = scaling.ScalingConfig(variants=["vanilla", "attnres_block"], sizes=["tiny model.d_model=16", "tiny"],
                               steps=[2, 2], n_boot=20, name="pieces", report_dir=str(tmp_path / "report"),
                               out_dir=str(tmp_path / "runs"), workers=2, log_mlflow=False)
    scaling.check(sc)
    base = [*FAST, f"mlflow.tracking_uri={uri}"]
    first = scaling.run_scaling(sc, base, command="test")
    assert len(first["points"]) == 4 and not first["missing"]
    assert all(p.trained_now and math.isfinite(p.loss) for p in first["points"])
    logs = sorted(p.name for p in (tmp_path / "runs" / "logs").iterdir())
    assert logs == ["attnres_block_tiny_model.d_model_16_s0.log", "attnres_block_tiny_s0.log",
                    "vanilla_tiny_model.d_model_16_s0.log", "vanilla_tiny_s0.log"]
    assert "compute multiplier" in (tmp_path / "report" / "pieces.md").read_text()
    again = scaling.run_scaling(sc, base, command="test")
    assert sorted(p.run_id for p in again["points"]) == sorted(p.run_id for p in first["points"])
    assert not any(p.trained_now for p in again["points"])


def test_a_piece_trains_without_the_reference_and_writes_no_report(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sc = scaling.ScalingConfig(variants=["attnres_block"], sizes=["tiny"], steps=[2], fit=False,
                               report_dir=str(tmp_path / "report"), out_dir=str(tmp_path / "runs"))
    scaling.check(sc)  # one size and no reference are fine for a training-only piece
    result = scaling.run_scaling(sc, [*FAST, f"mlflow.tracking_uri={uri}"], command="test")
    assert [p.variant for p in result["points"]] == ["attnres_block"] and result["points"][0].trained_now
    assert not (tmp_path / "report").exists()
    with pytest.raises(ValueError, match="scaling.reference='vanilla' must be one of"):
        scaling.check(scaling.ScalingConfig(variants=["attnres_block"]))
