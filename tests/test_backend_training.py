"""benchmarks.backend_training: the verdict's arithmetic, and the script end to end on the CPU."""

import pytest

from benchmarks.backend_training import main, verdict


def test_verdict_passes_inside_the_reference_spread_and_fails_outside():
    ref = [{1: 5.0, 2: 4.0}, {1: 5.2, 2: 4.1}]  # spread at step 2: 0.1 + 1% of 4.05
    close = [{1: 5.05, 2: 4.12}, {1: 5.1, 2: 4.08}]
    far = [{1: 5.1, 2: 4.5}, {1: 5.1, 2: 4.6}]
    assert verdict(ref, close)[0]
    ok, gap, spread, step = verdict(ref, far)
    assert not ok and step == 2 and gap == pytest.approx(0.5) and spread == pytest.approx(0.1405)


@pytest.mark.slow
def test_fused_and_reference_training_agree_on_the_cpu(tmp_path, monkeypatch):
    # Triton's interpreter runs the fused op on the CPU: a few steps of the tiny debug model.
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    code = main(["--residuals", "attnres_block", "--steps", "3", "--seeds", "0", "1", "--name", "cpu",
                 "--set", "debug=fast", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                 "model.seq_len=32", "data.batch_size=2", "trainer.threads=1"])
    assert code == 0
    assert "attnres_block" in (tmp_path / "backend_training_cpu.md").read_text()


def test_a_failing_residual_is_a_row_and_the_others_are_kept(tmp_path, monkeypatch):
    # One residual's runs raise (as an Inductor error did on a GPU): its row says FAILED with the error, the
    # residual before it keeps its verdict in the written table, and the exit code is 1.
    import benchmarks.backend_training as bt
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)

    def fake_run(residual, arm, seed, steps, overrides):
        assert arm in (["residual.backend=torch"], ["residual.backend=triton"])
        if residual == "attnres":
            raise RuntimeError("InductorError: AssertionError")
        return {1: 5.0 + 0.1 * seed, 2: 4.0 + 0.1 * seed}

    monkeypatch.setattr(bt, "run", fake_run)
    code = main(["--residuals", "attnres_block", "attnres", "--steps", "2", "--seeds", "0", "1", "--name", "fake"])
    text = (tmp_path / "backend_training_fake.md").read_text()
    assert code == 1
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| attnres")}
    assert "| ok |" in rows["attnres_block"]
    assert "FAILED (RuntimeError: InductorError: AssertionError)" in rows["attnres"]


def test_any_two_settings_are_held_to_the_same_test(tmp_path, monkeypatch):
    """--reference / --candidate: the two arms' overrides reach the runs, the table names them, and the candidate
    passes or fails against the reference's own seed spread as the backends do."""
    import benchmarks.backend_training as bt
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    seen = []

    def fake_run(residual, arm, seed, steps, overrides):
        seen.append((tuple(arm), seed))
        off = 0.5 if arm == ["residual.stream_dtype=bf16"] else 0.0  # far outside the spread
        return {1: 5.0 + 0.1 * seed + off, 2: 4.0 + 0.1 * seed + off}

    monkeypatch.setattr(bt, "run", fake_run)
    code = main(["--residuals", "mhc", "--reference", "residual.backend=auto", "--candidate",
                 "residual.stream_dtype=bf16", "--seeds", "0", "1", "--name", "arms"])
    assert code == 1
    assert seen == [(("residual.backend=auto",), 0), (("residual.backend=auto",), 1),
                    (("residual.stream_dtype=bf16",), 0), (("residual.stream_dtype=bf16",), 1)]
    text = (tmp_path / "backend_training_arms.md").read_text()
    assert "final loss, residual.stream_dtype=bf16 (per seed)" in text and "OUTSIDE THE SPREAD" in text


def test_an_arm_holds_its_code_settings_for_its_runs_alone(monkeypatch):
    """An arm's ``py:`` items set the code for that arm's runs (restored after each), the rest compose the config."""
    import platform.train as train_mod

    import benchmarks.backend_training as bt
    from residuals.attnres import DepthAttentionResidual

    seen = []

    def fake_train(cfg, callbacks, run_dir):
        seen.append((DepthAttentionResidual.phase1_dtype, cfg.residual.backend))
        callbacks[0].losses[1] = 1.0

    monkeypatch.setattr(train_mod, "train", fake_train)
    arm = ["py:residuals.attnres.DepthAttentionResidual.phase1_dtype=bfloat16", "residual.backend=torch"]
    assert bt.run("attnres_block", arm, 0, 1, ["debug=fast"]) == {1: 1.0}
    assert bt.run("attnres_block", ["residual.backend=auto"], 0, 1, ["debug=fast"]) == {1: 1.0}
    assert seen == [("bfloat16", "torch"), ("stream", "auto")]
    assert DepthAttentionResidual.phase1_dtype == "stream"
    with pytest.raises(ValueError, match="py:residuals.attnres.Nope.x=1"):
        bt.run("attnres_block", ["py:residuals.attnres.Nope.x=1"], 0, 1, ["debug=fast"])
