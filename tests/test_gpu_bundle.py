"""make gpu-bundle: the version check catches the silent resolution that breaks an offline host."""

import pytest

from benchmarks.gpu_bundle import WANTED, check, requirement_lines
from tests.helpers import ROOT


def _wheels(tmp_path, pins):
    paths = []
    for name, version in pins.items():
        path = tmp_path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        path.write_bytes(b"x")
        paths.append(path)
    return paths


def _pins():
    return {line.partition("==")[0]: line.partition("==")[2] or "1.0" for line in requirement_lines(WANTED)}


def test_the_pinned_bundle_passes(tmp_path):
    assert check(_wheels(tmp_path, _pins())) == []


def test_hydra_resolved_without_the_antlr_wheel_is_refused(tmp_path):
    # What a plain `pip download --only-binary=:all:` resolves when antlr4 4.9.3 has no wheel.
    pins = {**_pins(), "hydra-core": "0.11.3", "omegaconf": "1.4.1"}
    del pins["antlr4-python3-runtime"]
    problems = check(_wheels(tmp_path, pins))
    assert "hydra-core: resolved 0.11.3, wanted 1.3.8" in problems
    assert "omegaconf: resolved 1.4.1, wanted 2.3.1" in problems
    assert "antlr4-python3-runtime: no wheel in the bundle" in problems


def test_gpu_session_script_parses_and_names_its_plans(tmp_path):
    import subprocess

    script = ROOT / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), "nope", str(tmp_path / "out")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 2 and "unknown plan nope" in out.stderr
    for plan in ("check", "study", "finish", "scaling"):
        assert f"  {plan})" in script.read_text(), plan
    # the list that the usage, the check and the error name is exactly the script's case arms
    import re

    text = script.read_text()
    listed = set(re.search(r'^PLANS="([^"]+)"', text, re.M).group(1).split())
    arms = set(re.findall(r"^  ([a-z0-9_]+)\)$", text, re.M))
    assert listed == arms, (listed ^ arms)
    for plan in sorted(listed):
        assert plan in out.stderr, plan


def test_gpu_session_step_with_limit_zero_is_skipped(tmp_path):
    """A step's limit of 0 skips it (``timeout 0`` would run it without any limit), and says so in the summary."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_session.sh", repo / "benchmarks" / "gpu_session.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PARITY_LIMIT": "0", "REF_LIMIT": "0", "OPS_LIMIT": "0",
           "ARCHIVE": str(tmp_path / "a.tgz")}
    out = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_session.sh"), "attnref", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    summary = (tmp_path / "o" / "summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == ["parity", "ref_loop_order", "ops_attnres"]
    assert all("skipped (limit 0)" in line for line in summary)
    assert not list((tmp_path / "o").glob("gpu0.*.txt")) and (tmp_path / "a.tgz").exists()


@pytest.mark.parametrize("plan, steps", [("split2", ["gpu_tests", "small", "parity", "medium"]),
                                         ("serial2", ["medium", "tiles", "ncu_msar"]),
                                         ("split3", ["ncu_msar", "small"]),
                                         ("lean2", ["tiles", "gpu_tests", "small", "parity"]),
                                         ("lean3", ["medium", "small_all", "ncu_msar"]),
                                         ("medium_all", ["medium_all"]),
                                         ("streams", ["streams_medium", "streams_small"]),
                                         ("mhc", ["ops_bf16", "ops_fp32", "gpu_tests", "small"]),
                                         ("mhc2", ["ops_bf16", "ops_fp32", "gpu_tests", "medium", "small"]),
                                         ("mhc3", ["small", "ncu_mhc"]),
                                         ("chain", ["gpu_tests", "small"]),
                                         ("chain2", ["medium", "parity"]),
                                         ("chain3", ["mhc_streams", "profile", "ops_rounds"]),
                                         ("closing2", ["small_all"]),
                                         ("ops_wide", ["ops_medium", "ops_d2048"]),
                                         ("phase1", ["gpu_tests", "small", "parity"]),
                                         ("pairs", ["gpu_tests", "medium"]),
                                         ("phase1p", ["profile"]),
                                         ("phase1m", ["parity", "medium"]),
                                         ("delta", ["gpu_tests", "small", "parity"]),
                                         ("closing3", ["dtiles", "small_all", "medium"]),
                                         ("launches", ["dtiles", "profile"]),
                                         ("folded", ["gpu_tests", "dtiles", "small", "medium", "profile"]),
                                         ("auto_delta", ["small", "medium"]),
                                         ("kept", ["gpu_tests", "saved", "small"]),
                                         ("lean", ["gpu_tests", "medium"]),
                                         ("sources2", ["parity", "small"]),
                                         ("attnres_next", ["gpu_tests", "tiles", "small", "medium"]),
                                         ("msar_next", ["gpu_tests", "msar_tiles", "coef_tiles", "medium"]),
                                         ("mhc_next", ["gpu_tests", "ops_fp32", "small", "medium"]),
                                         ("msar_sources", ["gpu_tests", "medium", "parity"]),
                                         ("peaks", ["cached", "uncached"]),
                                         ("parity_all", ["parity"]),
                                         ("ops_final", ["where_medium", "ops_attnres", "msar_attn", "ops_mhc"]),
                                         ("timers", ["ops_attnres", "msar_graphs", "attnres_graphs", "msar_events"]),
                                         ("apart", ["gpu_tests", "medium"]),
                                         ("final2", ["attnres_d2048", "attnres_graphs", "ops_mhc"])])
def test_gpu_session_msar_plans_run_their_shared_steps(plan, steps, tmp_path):
    """The MSAR plans' shared steps (the op's GPU tests, msar_block's step, its parity, the counters: shell functions)
    run under the names and limits the plans give them: with every limit at 0 each is listed as skipped, in order."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_session.sh", repo / "benchmarks" / "gpu_session.sh")
    limits = ("TEST", "SMALL", "PARITY", "MEDIUM", "DTILES", "TILES", "TILES17", "COUNTER", "STREAMS", "OPS", "OPS32", "PROFILE", "OPS2048", "SAVED", "GRADS", "MSAR_TILES", "COEF", "PEAKS", "ATTNRES", "MSAR", "MHC", "GRAPHS", "EVENTS", "D2048")  # every *_LIMIT of these plans
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ARCHIVE": str(tmp_path / "a.tgz"),
           **{f"{name}_LIMIT": "0" for name in limits}}
    out = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_session.sh"), plan, str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    summary = (tmp_path / "o" / "summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == steps
    assert all("skipped (limit 0)" in line for line in summary)


def test_gpu_session_mhc_long_needs_the_large_corpus(tmp_path):
    """Plan mhc_long trains on data=large: without its shards it stops before any step, naming how to build them;
    with them its one step runs under LONG_LIMIT (listed as skipped at 0)."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_session.sh", repo / "benchmarks" / "gpu_session.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ARCHIVE": str(tmp_path / "a.tgz"), "LONG_LIMIT": "0"}

    def run():
        return subprocess.run(["bash", str(repo / "benchmarks" / "gpu_session.sh"), "mhc_long", str(tmp_path / "o")],
                              capture_output=True, text=True, env=env, timeout=60)

    out = run()
    assert out.returncode == 2 and "data.build_corpus --large" in out.stderr
    assert not (tmp_path / "o" / "summary.txt").exists()
    (repo / "data" / "shards" / "large").mkdir(parents=True)
    (repo / "data" / "shards" / "large" / "manifest.json").write_text("{}")
    out = run()
    assert out.returncode == 0, out.stderr
    summary = (tmp_path / "o" / "summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == ["long"] and "skipped (limit 0)" in summary[0]


@pytest.mark.parametrize("plan, counts, groups", [("lean2", (4,), ("forward", "stats")),
                                                  ("msar_next", (3, 2), ("forward", "stats", "source gradients")),
                                                  ("src_ahead2", (1,), ("source gradients",))])
@pytest.mark.parametrize("T, d", [(1024, 512), (2048, 1024)], ids=["small", "medium"])
def test_gpu_session_plans_time_only_candidates(T, d, plan, counts, groups):
    """Every ``--only`` of a plan's msar_tiles steps is a candidate of benchmarks.msar_tiles at the shapes it runs,
    and a step's --only name distinct tiles (one that is not a candidate, or names tiles already named, is not timed
    on the GPU, and its device time is lost)."""
    import dataclasses
    import re
    import shlex

    from benchmarks.msar_tiles import candidates, parse_candidate
    from kernels.msar_attn import fused

    text = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    plan = re.search(rf"^  {plan}\)\n(.*?)^    ;;", text, re.M | re.S).group(1)
    words = shlex.split(plan.replace("\\\n", " "), comments=True)
    steps, taking = [], False
    for word in words:  # per step, the words after its --only, up to the next option
        if word.startswith("--") or word == "step":
            taking = word == "--only"
            if taking:
                steps.append([])
        elif taking:
            steps[-1].append(parse_candidate(word))
    assert [len(step) for step in steps] == list(counts), (plan, steps)
    base = fused._blocks(T, d, 4, 12)
    offered = [dataclasses.replace(base, **o) for group in groups for o in candidates(base)[group][1:]]
    for asked in steps:
        tiles = [dataclasses.replace(base, **o) for o in asked]
        assert all(t in offered for t in tiles), [o for o, t in zip(asked, tiles) if t not in offered]
        # two --only that name the same tiles: the second is never timed
        assert all(tiles.index(t) == i for i, t in enumerate(tiles)), asked
