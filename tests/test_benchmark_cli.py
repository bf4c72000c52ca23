"""The benchmark commands' residual and ablation choices: names are checked before any work (with the
registered ones listed), and an ablation is timed as its preset configures it."""

import os

import pytest
import torch

from benchmarks import profile_step, throughput


@pytest.mark.parametrize("argv, bad, listed", [
    (["--residuals", "vanila"], "'vanila'", "vanilla"),
    (["--residuals", "vanilla", "--ablations", "wo_conv", "no_such"], "'no_such'", "wo_conv"),
])
@pytest.mark.parametrize("command", [throughput.main, profile_step.main], ids=["throughput", "profile_step"])
def test_unknown_names_fail_first_and_list_the_choices(command, argv, bad, listed):
    with pytest.raises(SystemExit) as exc:
        command(argv)
    message = str(exc.value)
    assert bad in message and listed in message


def test_an_ablation_is_built_from_its_preset():
    model, cfg = throughput.build("tiny", "ablation=wo_conv", 256, [], "cpu")
    assert cfg.residual.name == "msar_block" and cfg.residual.view == "identity"
    assert cfg.ablation.name == "wo_conv"
    _, plain = throughput.build("tiny", "msar_block", 256, [], "cpu")
    assert plain.residual.view == "conv" and plain.ablation is None


def test_throughput_times_ablations_beside_the_residuals(tmp_path, monkeypatch):
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    text = throughput.main(["--models", "tiny", "--residuals", "vanilla", "--ablations", "wo_conv", "--steps", "1",
                            "--warmup", "1", "--compile", "off", "--vocab", "256", "--batch", "2",
                            "--set", "model.seq_len=32", "--tag", "_test"])
    rows = [line for line in text.splitlines() if line.startswith("| tiny")]
    assert [r.split("|")[2].strip() for r in rows] == ["vanilla", "ablation=wo_conv"]
    assert (tmp_path / "throughput_tiny_cpu_test.md").exists()


def test_throughput_frees_the_cublas_workspaces_before_it_reads_what_earlier_rows_left(monkeypatch):
    """Between rows: the cuBLAS workspaces (one pair a stream, kept by PyTorch; each graph capture's stream added
    about 64 MiB that the next rows' peaks counted) are cleared and the cache emptied before the bytes still allocated
    are read, which the next row's peak then leaves out. The GPU calls stand in for a GPU here."""
    from benchmarks import throughput

    calls, allocated = [], {"bytes": 3 << 26}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: (calls.append("clear"), allocated.update(bytes=allocated["bytes"] - (2 << 25))),
                        raising=False)  # a CPU build of torch has no CUDA bindings
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: (calls.append("read"), allocated["bytes"])[1])
    assert throughput.free_between_rows() == (3 << 26) - (2 << 25)
    assert calls == ["synchronize", "clear", "empty_cache", "read"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU refusal")
def test_throughput_refuses_cuda_graphs_without_a_gpu():
    with pytest.raises(SystemExit, match=r"--graphs on: CUDA graphs need a CUDA device; valid here: --graphs off"):
        throughput.main(["--models", "tiny", "--graphs", "on"])


def test_throughput_ddp_rows_per_all_reduce_dtype_and_sync(tmp_path, monkeypatch):
    """--ddp 2 --ddp-comm fp32 bf16 --ddp-sync ddp flat: one DDP row per all-reduce dtype and gradient sync
    (gloo on a CPU), with a scaling column."""
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    text = throughput.main(["--models", "tiny", "--residuals", "vanilla", "--steps", "1", "--warmup", "1",
                            "--compile", "off", "--vocab", "256", "--batch", "2", "--set", "model.seq_len=32",
                            "--ddp", "2", "--ddp-comm", "fp32", "bf16", "--ddp-sync", "ddp", "flat", "--tag", "_test"])
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| tiny")]
    assert [r[6].strip() for r in rows] == ["1", "2 (ddp, fp32 all-reduce)", "2 (ddp, bf16 all-reduce)",
                                            "2 (flat, fp32 all-reduce)", "2 (flat, bf16 all-reduce)"]
    assert all(float(r[-2]) > 0 for r in rows[1:])  # a scaling efficiency per DDP row


def test_throughput_sets_are_rows_and_a_failing_row_keeps_the_table(tmp_path, monkeypatch):
    """--set given twice: the rows of each set, labelled with its overrides, in one table; a row whose run
    raises is reported FAILED in its row, and the rows after it are still timed."""
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    real = throughput.time_training

    def flaky(model, *args, **kwargs):
        if model.cfg.expert_hidden == 24:
            raise RuntimeError("no kernel for these settings")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(throughput, "time_training", flaky)
    text = throughput.main(["--models", "tiny", "--residuals", "vanilla", "--steps", "1", "--warmup", "1",
                            "--compile", "off", "--vocab", "256", "--batch", "2", "--set", "model.seq_len=32",
                            "model.expert_hidden=24", "--set", "model.seq_len=32", "--tag", "_test"])
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| tiny")]
    assert [r[2].strip() for r in rows] == ["model.seq_len=32 model.expert_hidden=24", "model.seq_len=32"]
    assert rows[0][9].strip() == "FAILED: RuntimeError: no kernel for these settings"
    assert float(rows[1][9].strip()) > 0  # ms/step of the set after the failure


def test_throughput_a_stopped_run_leaves_the_rows_it_timed(tmp_path, monkeypatch):
    """A time limit that stops the command mid-table (here an interrupt in the third run) leaves the file with the
    rows timed before it, marked partial; a run that ends replaces it with the whole table, unmarked."""
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    real = throughput.time_training
    calls = []

    def stopped(model, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill would: not a failing row, the end of the process
        return real(model, *args, **kwargs)

    argv = ["--models", "tiny", "--residuals", "vanilla", "attnres_block", "mhc", "--steps", "1", "--warmup", "1",
            "--compile", "off", "--vocab", "256", "--batch", "2", "--set", "model.seq_len=32", "--tag", "_stop"]
    monkeypatch.setattr(throughput, "time_training", stopped)
    with pytest.raises(KeyboardInterrupt):
        throughput.main(argv)
    text = (tmp_path / "throughput_tiny_cpu_stop.md").read_text()
    rows = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| tiny")]
    assert rows == ["vanilla", "attnres_block"]
    assert "partial: 2 of 3 runs timed" in text
    assert text.startswith("# Training-step throughput") and "- command:" in text
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(throughput, "time_training", real)
    throughput.main(argv)
    text = (tmp_path / "throughput_tiny_cpu_stop.md").read_text()
    assert "partial" not in text
    assert [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| tiny")] == [
        "vanilla", "attnres_block", "mhc"]


def test_flex_tile_candidates_are_what_the_config_passes():
    """benchmarks.flex_tiles times each candidate with the kernel_options that model.flex_fwd / flex_bwd give
    the backbone, and every candidate passes the config's validation."""
    from benchmarks import flex_tiles
    from platform.config import validate
    from tests.helpers import build_backbone, make_cfg

    for f, b in flex_tiles.PAIRS:
        model = build_backbone("vanilla", flex_fwd=list(f), flex_bwd=list(b))
        assert model.sublayers[0].flex_options == {**flex_tiles.fwd_options(f), **flex_tiles.bwd_options(b)}
    for t in flex_tiles.FWD + flex_tiles.QUICK_FWD:
        assert set(flex_tiles.fwd_options(t)) == {"fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_warps", "fwd_num_stages"}
        validate(make_cfg(f"model.flex_fwd=[{','.join(map(str, t))}]"))
    for t in flex_tiles.BWD + flex_tiles.QUICK_BWD:
        validate(make_cfg(f"model.flex_bwd=[{','.join(map(str, t))}]"))


def test_throughput_refuses_a_bad_override_of_any_row_before_timing(monkeypatch):
    """A --set that does not compose for one of the rows (vanilla has no merge_backend) ends the command
    before anything is timed, naming the row."""
    monkeypatch.setattr(throughput, "time_training", lambda *a, **k: pytest.fail("timed before the check"))
    with pytest.raises(SystemExit, match=r"error: tiny vanilla residual.merge_backend=torch: .*merge_backend"):
        throughput.main(["--models", "tiny", "--residuals", "attnres_block", "vanilla", "--compile", "off",
                         "--set", "--set", "residual.merge_backend=torch"])
    with pytest.raises(SystemExit, match=r"error: tiny vanilla model.flex_fwd=\[64,64,4\]: model.flex_fwd="):
        throughput.main(["--models", "tiny", "--residuals", "vanilla", "--compile", "off",
                         "--set", "model.flex_fwd=[64,64,4]"])


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on CPU tensors need TRITON_INTERPRET=1")
def test_ops_attnres_parity_runs_the_fused_op_as_the_residual_does():
    """The benchmark's parity check on the CPU (fp32 under the interpreter): the fused op stores its sources in
    a buffer and every source's gradient comes back through it, equal to the reference's."""
    from benchmarks import ops_attnres

    for n, C in [(3, 3), (4, 1)]:
        assert ops_attnres.parity(n, C, 1, 9, 16, dtype=torch.float32, device="cpu") < 1e-5


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on CPU tensors need TRITON_INTERPRET=1")
def test_depth_attn_tile_sweep_checks_every_candidate_against_the_default(tmp_path, monkeypatch):
    """Every candidate tile of the sweep runs and matches the default tiles' outputs and gradients (CPU smoke run,
    fp32 under the interpreter); the kernels' own tiles are restored afterwards."""
    import benchmarks.roofline as roofline
    from benchmarks import depth_attn_tiles
    from kernels.depth_attn import fused

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    tiles, row_tiles = fused.tiles, fused._row_tiles
    depth_attn_tiles.main(["--shapes", "tiny", "--dtypes", "fp32", "--ops", "block", "--device", "cpu"])
    text = (tmp_path / "depth_attn_tiles_cpu_tiny.md").read_text()
    assert "FAIL" not in text and "failed" not in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny")]
    # phase 1 forward and backward and the merges' per candidate, and the backward taking dO·o from the outputs (5
    # sources in loads of 4 under the interpreter at d = 20: the two-pass backward) with the default tiles
    assert len(rows) == 2 * len(depth_attn_tiles.PHASE1[512]) + 2 * len(depth_attn_tiles.MERGE[512]) + 2
    assert sum("dO·o from the outputs" in row for row in rows) == 2  # kept fp32, and bf16
    assert (fused.tiles, fused._row_tiles) == (tiles, row_tiles)
    depth_attn_tiles.main(["--shapes", "tiny", "--dtypes", "fp32", "--ops", "block", "--device", "cpu",
                           "--default-only"])
    rows = [line for line in (tmp_path / "depth_attn_tiles_cpu_tiny_default.md").read_text().splitlines()
            if line.startswith("| tiny")]
    assert [row.split(" | ")[3] for row in rows] == ["phase 1 fwd", "phase 1 bwd", "phase 1 bwd, dO·o from the outputs",
                                                     "phase 1 bwd, dO·o from the outputs (bf16)", "merge fwd",
                                                     "merge bwd"], rows
    assert all(row.endswith("ok |") for row in rows), rows
    # the step's other phase-1 calls: (n, C) per op, the outputs' rows only where the sources take several loads
    depth_attn_tiles.main(["--shapes", "tiny", "--dtypes", "fp32", "--ops", "block_n2", "block_final", "--device", "cpu",
                           "--default-only"])
    rows = [line.split(" | ")[2:4] for line in (tmp_path / "depth_attn_tiles_cpu_tiny_default.md").read_text().splitlines()
            if line.startswith("| tiny")]
    assert [op for op, kernel in rows if kernel.startswith("phase 1 bwd")] == ["block_n2", "block_final", "block_final",
                                                                               "block_final"], rows


def test_depth_attn_tiles_times_the_phase1_candidates_given(tmp_path, monkeypatch):
    """``--phase1``: exactly the candidates given, in order, each checked against the default's results; a bad one
    stops before any work."""
    import benchmarks.roofline as roofline
    from benchmarks import depth_attn_tiles

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    assert depth_attn_tiles.parse_tiles("1,4,8,8,0") == (1, 4, 8, 8, False)
    assert depth_attn_tiles.parse_tiles("1,2,8,8,0,4") == (1, 2, 8, 8, False, 4)
    with pytest.raises(SystemExit, match="'1,2,8,8,2'"):
        depth_attn_tiles.parse_tiles("1,2,8,8,2")
    with pytest.raises(SystemExit, match="'1,4,x'"):
        depth_attn_tiles.main(["--phase1", "1,4,x", "--device", "cpu"])
    assert depth_attn_tiles.parse_tiles("split") == "split" and depth_attn_tiles.parse_tiles("one-kernel") == "one-kernel"
    depth_attn_tiles.main(["--shapes", "tiny", "--dtypes", "fp32", "--ops", "block_n6", "--device", "cpu",
                           "--phase1", "default", "1,1,8,8", "1,1,8,2,0,2,128", "--tag", "_given"])
    from kernels.depth_attn import fused

    split_before = fused.SPLIT_BWD
    depth_attn_tiles.main(["--shapes", "tiny", "--dtypes", "fp32", "--ops", "block_n6", "--device", "cpu",
                           "--phase1", "default", "split", "one-kernel", "split:4,64,4,1,4", "split-once", "fwd-tail",
                           "fwd4-tail", "fwd-stream2-prefetch", "--tag", "_split"])
    assert fused.SPLIT_BWD == split_before and fused.SPLIT_TILES is None and fused.SCORES_ONCE is None  # put back
    assert fused.FWD_TAIL is True and fused.FWD_WARPS is None and fused.FWD_STREAM == 1
    with pytest.raises(SystemExit, match="'fwd-tail:1,2,3,4,5'"):  # only the split settings take tiles
        depth_attn_tiles.parse_tiles("fwd-tail:1,2,3,4,5")
    with pytest.raises(SystemExit, match="'split:4,64,4'"):
        depth_attn_tiles.parse_tiles("split:4,64,4")
    split_rows = [line.split(" | ") for line in (tmp_path / "depth_attn_tiles_cpu_tiny_split.md").read_text().splitlines()
                  if line.startswith("| tiny") and " | phase 1 bwd | " in line]
    assert [r[4] for r in split_rows] == ["default", "split", "one-kernel", "split:4,64,4,1,4", "split-once", "fwd-tail",
                                          "fwd4-tail", "fwd-stream2-prefetch"] and all(
        r[-1].endswith("ok |")
                                                                                  for r in split_rows), split_rows
    rows = [line.split(" | ") for line in (tmp_path / "depth_attn_tiles_cpu_tiny_given.md").read_text().splitlines()
            if line.startswith("| tiny")]
    # (the default's rows also time dO·o from the outputs, its backward taking two loads of sources here)
    assert [(r[3], r[4]) for r in rows if r[3] in ("phase 1 fwd", "phase 1 bwd")] == [("phase 1 fwd", "default"), ("phase 1 bwd", "default"),
                                            ("phase 1 fwd", "(1, 1, 8, 8)"), ("phase 1 bwd", "(1, 1, 8, 8)"),
                                            ("phase 1 fwd", "(1, 1, 8, 2, False, 2, 128)"),
                                            ("phase 1 bwd", "(1, 1, 8, 2, False, 2, 128)")], rows
    assert all(r[-1].endswith("ok |") for r in rows), rows


def test_depth_attn_tiles_picks_the_fastest_backward_over_every_op(capsys, tmp_path):
    """``--best-wide``: the candidate with the least backward time summed over the ops, as fused.WIDE_BWD; the default
    or a candidate that failed a check or missed an op never wins."""
    from benchmarks import depth_attn_tiles

    def table(rows):
        return "\n".join(f"| medium | bf16 | {op} | phase 1 bwd | {label} | {ms} | 1.00 | 1 | {check} |"
                         for op, label, ms, check in rows)

    rows = [("block_n3", "default", "1.0", "0.0e+00 ok"), ("block_n6", "default", "2.0", "0.0e+00 ok"),
            ("block_n3", "(1, 2, 8, 8, False, 8, 128)", "0.5", "1e-3 ok"),
            ("block_n6", "(1, 2, 8, 8, False, 8, 128)", "1.6", "1e-3 ok"),
            ("block_n3", "(1, 4, 8, 4)", "0.4", "1e-3 ok"), ("block_n6", "(1, 4, 8, 4)", "1.0", "5e-1 FAIL"),
            ("block_n3", "(1, 2, 8, 2, False, 4)", "0.1", "1e-3 ok")]  # the last one missed block_n6
    assert depth_attn_tiles.best_wide(table(rows)) == (8, 8, False, 128)
    assert depth_attn_tiles.best_wide(table(rows[:2] + [("block_n3", "(1, 4, 8, 4)", "2.0", "ok"),
                                                        ("block_n6", "(1, 4, 8, 4)", "2.0", "ok")])) is None
    assert depth_attn_tiles.best_wide(table([("block_n3", "(1, 4, 8, 4)", "0.5", "ok")])) == (4, 4, True, 0)
    # the split backward is not tiles: never picked, even the fastest
    assert depth_attn_tiles.best_wide(table(rows + [("block_n3", "split", "0.01", "ok"),
                                                    ("block_n6", "split", "0.01", "ok")])) == (8, 8, False, 128)
    path = tmp_path / "t.md"
    path.write_text("# title\n\n" + table(rows))
    depth_attn_tiles.main(["--best-wide", str(path)])
    assert capsys.readouterr().out.strip() == "(8, 8, False, 128)"


def test_kernel_counter_reports_are_tabulated_per_launch(tmp_path, monkeypatch):
    """The profiler's text report becomes one row per launch with its own metrics (not the next launch's)."""
    import benchmarks.roofline as roofline
    from benchmarks import kernel_counters

    report = "\n".join([
        "# `ncu -c 2 python3 -m benchmarks.kernel_counters --ops mhc` (2026-12-01T13:07:22Z)",
        "  _pre_fwd_kernel (1024, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0",
        "    Section: GPU Speed Of Light Throughput",
        "    DRAM Throughput                   %        15.26",
        "    Duration                         us       182.62",
        "    L1/TEX Cache Throughput           %        89.37",
        "    Registers Per Thread             register/thread              48",
        "    Achieved Occupancy                        %        43.93",
        "    Active Warps Per Scheduler          warp         2.96",
        "    Eligible Warps Per Scheduler        warp         0.89",
        "    OPT   Est. Speedup: 45.43%",
        "          On average, each warp of this workload spends 2.9 cycles being stalled waiting for a scoreboard "
        "dependency on",
        "          a L1TEX (local, global, surface, texture) operation. Find the instruction producing the data being",
        "          upon to identify the culprit. This stall type represents about 54.2% of the total average of 5.4 "
        "cycles",
        "  _post_fwd_kernel (2048, 4, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0",
        "    Duration                         ms         2.30",
        "    DRAM Throughput                   %        71.67",
    ])
    launches = kernel_counters.parse_report(report)
    assert [x["kernel"] for x in launches] == ["_pre_fwd_kernel", "_post_fwd_kernel"]
    assert launches[0]["grid × block"] == "1024 × 128" and launches[1]["grid × block"] == "2048×4 × 128"
    assert launches[0]["duration"] == "182.62 us" and launches[1]["duration"] == "2.30 ms"
    assert launches[0]["DRAM %"] == "15.26" and launches[0]["registers"] == "48"
    assert "registers" not in launches[1]
    # the top stall reason of the profiler's advice, its parenthesis dropped, on its own launch only
    stall = kernel_counters.STALL
    assert launches[0][stall] == "54.2%: waiting for a scoreboard dependency on a L1TEX operation"
    assert stall not in launches[1]
    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    path = tmp_path / "r.txt"
    path.write_text(report)
    text = kernel_counters.summarize([str(path)], "_t").read_text()
    assert ("| r | _pre_fwd_kernel | 1024 × 128 | 182.62 us | 15.26 | 89.37 | 48 | 43.93 | 2.96 | 0.89 |  | 54.2%: "
            "waiting for a scoreboard dependency on a L1TEX operation |") in text
    assert "compute capability 9.0" in text and "--ops mhc" in text


def test_saved_bytes_counts_each_storage_once_and_tabulates(tmp_path, monkeypatch):
    """benchmarks.saved_bytes: a tensor that autograd saves twice counts once, parameters not at all, and each
    storage is attributed to the node that keeps it; the table has a row per residual against vanilla and a
    second table of who keeps it; an unknown residual is refused, listing the registered ones."""
    import benchmarks.roofline as roofline
    from benchmarks import saved_bytes

    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 8)

        def forward(self, tokens, doc_ids):
            x = self.emb(tokens).float() * 2  # (2, 5, 8) fp32
            return (x * x) @ self.emb.weight.t()  # the product saves x twice; bf16 autocast casts for the matmul

    # x once (320 bytes, not 640), the bf16 copies the matmul saves of x·x (160) and of the weight (176, a new
    # storage: counted), the embedding's indices (80); the weight itself (a parameter) not
    nodes = {}
    assert saved_bytes.saved_bytes(Square(), torch.zeros(2, 5, dtype=torch.long), None, nodes) == (736, 4)
    # and who keeps them, each storage once: the product x, the matmul its two bf16 operands, the embedding its indices
    assert nodes == {"MulBackward0": 320, "MmBackward0": 336, "EmbeddingBackward0": 80}, nodes
    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    saved_bytes.main(["--residuals", "vanilla", "attnres_block", "--backend", "torch", "--set", "model.seq_len=16",
                      "--tag", "_test"])
    text = (tmp_path / "saved_bytes_tiny_test.md").read_text()
    assert "| vanilla |" in text and "| attnres_block |" in text and "| 1.000 |" in text
    # the memory columns (on the CPU from torch's MemTracker): the forward leaves tensors allocated (what it saved, bar
    # the buffers made before it, and the logits); the peak of forward and backward is at least that; vanilla's peak
    # is the peaks' unit
    rows = [line.strip("| ").split(" | ") for line in text.split("## Who keeps it")[0].splitlines()
            if line.startswith(("| vanilla |", "| attnres_block |"))]
    assert len(rows) == 2
    for cells in rows:
        saved, left, peak = float(cells[1]), float(cells[5]), float(cells[6])
        assert saved > 0 and 0 < left <= peak, cells
        assert cells[0] != "vanilla" or cells[7] == "1.000"
    assert "## Who keeps it" in text and "| attnres_block | MergeSumFunctionBackward |" not in text  # torch backend
    with pytest.raises(SystemExit, match=r"'vanila'.*vanilla"):
        saved_bytes.main(["--residuals", "vanila"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the fused merges on CPU tensors need TRITON_INTERPRET=1")
def test_saved_bytes_holds_a_rows_code_setting_for_that_row_alone(tmp_path, monkeypatch):
    """A row's ``py:`` setting (here the merges keeping their own h, not the phase-1 outputs that phase 1 keeps with fp32
    sources) applies to that row: 6 merges of a bf16 (B, T, d) each show as 3 (B, T, d) fp32 units more saved than the
    other row's, and the setting is back to its value after the row."""
    import benchmarks.roofline as roofline
    from benchmarks import saved_bytes
    from residuals.attnres import DepthAttentionResidual

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    row = "attnres_block@residual.source_dtype=stream"  # fp32 sources: phase 1 keeps its bf16 outputs
    setting = f"{row}@py:residuals.attnres.DepthAttentionResidual.merges_keep_outputs=False"
    saved_bytes.main(["--residuals", row, setting, "--set", "model.seq_len=16", "--by-node", "0", "--tag", "_test"])
    assert DepthAttentionResidual.merges_keep_outputs is True
    rows = [line.split(" | ") for line in (tmp_path / "saved_bytes_tiny_test.md").read_text().splitlines()
            if line.startswith("| attnres_block")]
    units = [float(row[3]) for row in rows]
    assert len(units) == 2 and units[1] - units[0] == pytest.approx(3.0, abs=0.05), units


@pytest.mark.parametrize("T, d", [(1024, 512), (2048, 1024)], ids=["small", "medium"])
def test_msar_tile_candidates_change_the_default_and_name_valid_modes(T, d):
    """benchmarks.msar_tiles times each candidate as fused.Blocks with its fields replaced: every candidate names
    fields of Blocks, differs from the default and from every other candidate of its kernel (else it times the same
    tiles twice under another label), and names a kernel mode streams_backward runs (a misspelt mode would be an
    error on the GPU, after the compile)."""
    import dataclasses

    from benchmarks.msar_tiles import candidates
    from kernels.msar_attn import fused

    base = fused._blocks(T, d, 4, 12)
    for kernel, overrides in candidates(base).items():
        assert overrides[0] == {}, kernel
        for over in overrides[1:]:
            blk = dataclasses.replace(base, **over)
            assert blk != base, (kernel, over)
            assert blk.src_mode in ("serial", "ring") and blk.stats_mode in ("serial", "tile"), (kernel, over)
        timed = [repr(dataclasses.replace(base, **over)) for over in overrides]
        assert len(set(timed)) == len(timed), f"{kernel}: a candidate repeats another"
    src = candidates(base)["source gradients"]
    assert {"src_mode": "ring", "stats_mode": "tile"} in src  # the kernels before, beside the defaults


def floor_calls(name: str, model: str = "small"):
    """(residual, its step's fused calls) of a --residuals row of benchmarks.residual_floor, on a meta-device model."""
    from benchmarks import residual_floor
    from platform.accounting import meta_model

    base, own = residual_floor.row_parts(name)
    net, cfg = meta_model(model, base, extra_overrides=own)
    return net.residual, residual_floor.step_calls(net.residual, 16 * cfg.model.seq_len, cfg.model.d_model)


def test_residual_floor_counts_every_fused_call_of_a_step():
    """benchmarks.residual_floor takes a step's fused calls from the residual itself: msar_block at `small` reads
    over b_0, the completed summaries and the partial (S = 1, then 2 to 5 as blocks of 4 sublayers complete), Block
    AttnRes runs one phase 1 a block of consumers, mHC one write + read a sublayer; each call's floor is the larger
    of its byte and arithmetic times, and the step's is their sum."""
    from benchmarks import residual_floor

    def calls(name):
        return floor_calls(name)[1]

    msar = calls("msar_block")
    sources = [int(c[0].split("S=")[1].rstrip(")")) for c in msar]
    assert sources == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]  # 16 sublayers and the output
    by_s = {s: (b, fl) for s, (_, b, fl) in zip(sources, msar)}
    assert all(by_s[s + 1][0] > by_s[s][0] and by_s[s + 1][1] > by_s[s][1] for s in range(1, 5))  # more sources
    assert len(calls("attnres_block")) == 5 and len(calls("mhc@residual.recompute_every=0")) == 16
    f = residual_floor.floor("small", "msar_block", 51.2, 4.25)
    per_call = sum(max(b / 4.25e12, fl / 51.2e12) * 1e3 for _, b, fl in msar)
    assert abs(f["floor_ms"] - per_call) < 1e-9 and f["calls"] == 17
    assert f["floor_ms"] >= max(f["bytes_ms"], f["flops_ms"])
    with pytest.raises(SystemExit, match=r"'vanila'.*vanilla"):
        residual_floor.main(["--residuals", "vanila"])
    with pytest.raises(SystemExit, match=r"'vanilla' has no fused-op cost model.*msar_block"):
        residual_floor.floor("small", "vanilla", 51.2, 4.25)
    # a view with packed bf16 multiply-adds: about a bf16 rounding per step, against fp32's round-off
    err = residual_floor.packed_bf16_view_error(8, d=64, T=256)
    assert err["fp32"] < 1e-6 < 1e-3 < err["one bf16 rounding"] < err["packed bf16"] < 1e-2, err


def test_residual_floor_counts_what_the_config_stores():
    """The floor streams what the residual's config stores, as `trainer=gpu` trains: mHC's fp32 streams
    (`mhc@residual.stream_dtype=fp32`, a row's own overrides) move twice the bytes of its default's (bf16 under
    autocast), msar_block's and msar's sources are bf16 under autocast (their default) and fp32 with
    `source_dtype=stream`; with the streams kept every L_r* sublayers (mHC's default on a GPU) backward rebuilds the others, one
    write each."""
    from benchmarks import residual_floor
    from benchmarks.ops_mhc import counts

    widths = {name: residual_floor.stored_bytes(floor_calls(name)[0]) for name in (
        "mhc", "mhc@residual.stream_dtype=input", "mhc@residual.stream_dtype=fp32", "mhc@residual.stream_dtype=bf16",
        "msar_block", "msar_block@residual.source_dtype=stream", "msar", "msar@residual.source_dtype=stream")}
    assert widths == {"mhc": 2, "mhc@residual.stream_dtype=input": 4, "mhc@residual.stream_dtype=fp32": 4,
                      "mhc@residual.stream_dtype=bf16": 2, "msar_block": 2, "msar_block@residual.source_dtype=stream": 4,
                      "msar": 2, "msar@residual.source_dtype=stream": 4}
    tokens = 16 * 1024
    for name, elt in (("mhc@residual.stream_dtype=fp32", 4), ("mhc", 2)):
        res, kept_all = floor_calls(name + "@residual.recompute_every=0")
        assert [c[1] for c in kept_all] == [counts(tokens, 4, 512, elt)["post+pre fwd+bwd"][0]] * 16
        res, default = floor_calls(name)
        every = res.stream_recompute_every(__import__("torch").device("cuda"))
        assert every == 3 and default[:16] == kept_all  # L_r* = round(sqrt(4 * 16 / 6)) at `small`
        label, nbytes, nflops = default[16]
        assert label == "10 streams rebuilt (L_r = 3)" and len(default) == 17  # sublayers 0, 3, ..., 15 kept
        assert (nbytes, nflops) == tuple(10 * v for v in counts(tokens, 4, 512, elt)["post"])
    fp32, bf16 = (residual_floor.floor("small", n, 51.2, 4.25) for n in ("mhc@residual.stream_dtype=fp32", "mhc"))
    assert 1.9 < fp32["bytes_ms"] / bf16["bytes_ms"] < 2.1 and fp32["gflop"] == bf16["gflop"]
    msar_fp32 = residual_floor.floor("small", "msar_block@residual.source_dtype=stream", 51.2, 4.25)
    assert msar_fp32["gb"] > residual_floor.floor("small", "msar_block", 51.2, 4.25)["gb"]


def test_residual_floor_writes_its_table_and_plot(tmp_path, monkeypatch):
    """The command writes its table (with the command that made it) and, with --plot, the bar chart."""
    from benchmarks import residual_floor

    monkeypatch.setattr(residual_floor, "RESULTS", tmp_path)
    assert residual_floor.main(["--models", "small", "--residuals", "msar_block", "--plot", "--tag", "_t"]) == 0
    table = (tmp_path / "residual_floor_t.md").read_text()
    assert "python -m benchmarks.residual_floor --models small --residuals msar_block --plot --tag _t" in table
    row = next(line for line in table.splitlines() if line.startswith("| small (L=16) | msar_block |"))
    assert row.split("|")[-3].strip() == "0.80"  # the target
    assert residual_floor.main(["--models", "small", "--residuals", "mhc@residual.stream_dtype=bf16", "--tag", "_b"]) == 0
    row = next(line for line in (tmp_path / "residual_floor_b.md").read_text().splitlines()
               if line.startswith("| small (L=16) | mhc@residual.stream_dtype=bf16 |"))
    assert row.split("|")[-3].strip() == "0.85"  # a row's overrides keep its residual's target
    png = (tmp_path / "residual_floor_t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with pytest.raises(SystemExit, match=r"--vanilla-ms 'small=fast'.*MODEL=MS"):
        residual_floor.main(["--vanilla-ms", "small=fast"])
    # another GPU's ceilings: the header names where they come from, and the floor moves with the bandwidth
    assert residual_floor.main(["--models", "small", "--residuals", "mhc", "--copy-tbs", "3.02", "--fp32-tflops",
                                "51.6", "--vanilla-ms", "small=18.0", "--ceilings-from", "an H100 host",
                                "--tag", "_h"]) == 0
    h100 = (tmp_path / "residual_floor_h.md").read_text()
    assert "3.02 TB/s copy and 51.6 TFLOP/s fp32, measured on an H100 host" in h100 and "H200" not in h100
    floor_ms = {t: float(next(line for line in text.splitlines() if line.startswith("| small (L=16) | mhc"))
                         .split("|")[9]) for t, text in (("h100", h100), ("h200", (tmp_path / "residual_floor_b.md")
                                                                          .read_text()))}
    assert floor_ms["h100"] > floor_ms["h200"]  # bf16 streams are byte-bound: less bandwidth, a higher floor
    with pytest.raises(SystemExit, match=r"--plot.*--copy-tbs 3.02.*--measured"):  # MEASURED is the H200's
        residual_floor.main(["--copy-tbs", "3.02", "--plot"])
    # with that card's ratios the plot draws them, and names the card
    drawn = {}
    monkeypatch.setattr(residual_floor, "plot", lambda points, path, card: drawn.update(points=points, card=card))
    assert residual_floor.main(["--models", "small", "--residuals", "mhc", "msar_block", "--copy-tbs", "3.02",
                                "--plot", "--measured", "small:mhc=0.682", "--card", "an H100", "--tag", "_p"]) == 0
    assert drawn["card"] == "an H100"
    assert [(p["residual"], p["measured"]) for p in drawn["points"]] == [("mhc", 0.682), ("msar_block", None)]
    for bad in ("small:mhc", "mhc=0.6", "small:mhc=fast", "small:mhc=3"):
        with pytest.raises(SystemExit, match=r"--measured .*MODEL:RESIDUAL=RATIO"):
            residual_floor.main(["--plot", "--measured", bad])


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="counts under Triton's interpreter, set before the kernels are imported (a CPU run)")
def test_glue_kernels_take_the_small_steps_off_pytorch():
    """benchmarks.msar_glue_ops counts the PyTorch operations that do work around one fused read: with the glue
    kernels (Blocks.glue="triton") the forward's softmax over the sources and gate, and the backward's w, κ, μ, are
    no longer a dozen PyTorch operations each (on a GPU, each a kernel launch of a few microseconds)."""
    from benchmarks import msar_glue_ops

    (f_torch, b_torch), (f_triton, b_triton) = (msar_glue_ops.count(glue, S=2) for glue in ("torch", "triton"))
    assert {"logsumexp", "sigmoid", "rsqrt", "exp"} <= set(f_torch) and not {"logsumexp", "sigmoid", "rsqrt",
                                                                            "exp"} & set(f_triton)
    assert sum(f_triton.values()) <= 5 < 15 <= sum(f_torch.values())
    assert "exp" in b_torch and "exp" not in b_triton and sum(b_triton.values()) + 8 <= sum(b_torch.values())
    assert not msar_glue_ops.NOT_WORK & (set(f_torch) | set(b_torch))  # views, allocations, copies not counted


@pytest.mark.slow
@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="counts under Triton's interpreter, set before the kernels are imported (a CPU run)")
def test_glue_ops_count_a_step_with_its_code_settings():
    """benchmarks.msar_glue_ops --step counts a whole step's ATen operations for each row with its code settings held
    for that row alone: msar_block's reads packed once a step (Msar.pack_step) make fewer copies, fills and zero
    tensors than reads packing their own, and the setting is restored after its row; a bad setting fails before any
    step runs."""
    from benchmarks import msar_glue_ops
    from residuals.msar import Msar

    default = Msar.pack_step
    own = msar_glue_ops.step_count("msar_block@py:residuals.msar.Msar.pack_step=False")
    once = msar_glue_ops.step_count("msar_block@py:residuals.msar.Msar.pack_step=True")
    assert Msar.pack_step is default  # restored
    for op in ("copy_", "zeros", "clone"):
        assert once[op] < own[op], (op, once[op], own[op])
    assert once["fill_"] < own["fill_"] and sum(once.values()) < sum(own.values())
    assert own["mm"] == once["mm"] > 0  # the same model, the same matmuls
    assert "empty" not in own and "view" not in own  # no work
    with pytest.raises(ValueError, match="pack_stepp"):
        msar_glue_ops.main(["--step", "msar_block@py:residuals.msar.Msar.pack_stepp=True"])


def test_a_row_can_carry_overrides_of_its_own(tmp_path, monkeypatch):
    """``mhc@residual.stream_dtype=bf16`` beside ``mhc`` and vanilla: that row alone is built with the override (the
    others would refuse it: vanilla has no stream_dtype), and a bad row override fails before any timing."""
    _, cfg = throughput.build("tiny", "mhc@residual.stream_dtype=bf16", 256, [], "cpu")
    assert cfg.residual.name == "mhc" and cfg.residual.stream_dtype == "bf16"
    _, plain = throughput.build("tiny", "mhc", 256, [], "cpu")
    assert plain.residual.stream_dtype == "autocast"
    with pytest.raises(SystemExit, match="stream_dtyp"):
        throughput.main(["--models", "tiny", "--residuals", "vanilla", "mhc@residual.stream_dtyp=bf16", "--compile",
                         "off", "--vocab", "256"])
    with pytest.raises(SystemExit, match="'mhcc'"):
        throughput.main(["--models", "tiny", "--residuals", "mhcc@residual.stream_dtype=bf16"])


def test_ops_mhc_rounds_interleave_the_backends_and_take_medians():
    """benchmarks.ops_mhc --rounds: every backend is timed once a round in turn (a, b, a, b, ...), so a drift over the
    run reaches all of them; the median and range per op come back; a backend that raises is not timed again."""
    from benchmarks.ops_mhc import interleaved_rounds

    calls, clock = [], iter(range(100))

    def time_one(entry):
        calls.append(entry)
        if entry == "broken":
            raise RuntimeError("no kernel")
        t = next(clock)  # a drifting clock: later calls read slower
        return {"fwd": 1.0 + t + (10.0 if entry == "b" else 0.0)}

    medians, errors = interleaved_rounds(["a", "broken", "b"], 3, time_one)
    assert calls == ["a", "broken", "b", "a", "b", "a", "b"]
    assert list(errors) == ["broken"] and isinstance(errors["broken"], RuntimeError)
    assert medians["a"]["fwd"] == (3.0, 1.0, 5.0)  # clock 0, 2, 4
    assert medians["b"]["fwd"] == (14.0, 12.0, 16.0)  # clock 1, 3, 5, plus 10
    assert "broken" not in medians


def test_ops_mhc_pick_takes_the_largest_gain_past_the_threshold_over_ok_rows(tmp_path, capsys):
    """benchmarks.ops_mhc --pick (a GPU plan's branch): the variant whose op time is the threshold or more below the
    default's at some shape, the largest gain winning; failed parity, error rows and other ops do not count."""
    from benchmarks.ops_mhc import pick_variant

    head = ("| shape | B×T | d | n | parity (vs fp32 ref) | backend | op | ms | min MB | GFLOP | roofline ms | binds "
            "| % of roofline |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")

    def row(shape, parity, backend, op, ms):
        return f"| {shape} | 16×1024 | 512 | 4 | {parity} | {backend} | {op} | {ms} | 1 | 1 | 1 | bytes | 1% |\n"

    op = "post+pre fwd+bwd"
    table = head + "".join([
        row("small", "2.9e-03 ok", "triton", op, "1.000 (0.99–1.10)"),
        row("small", "2.9e-03 ok", "triton (a)", op, "0.980 (0.97–0.99)"),  # 2%: below the threshold
        row("small", "2.9e-03 ok", "triton (b)", "fwd", "0.100"),  # another op
        row("medium", "2.9e-03 ok", "triton", op, "4.000"),
        row("medium", "2.9e-03 ok", "triton (a)", op, "3.800"),  # 5%
        row("medium", "2.9e-03 ok (sublayer/dx)", "triton (b)", op, "3.000"),  # 25%
        # fastest, but its parity failed
        row("medium", "3.0e-01 FAIL (post_pre/dx; reference in bf16: 1.0e-03)", "triton (c)", op, "1.000"),
        row("medium", "error", "triton (d)", "all", "error: RuntimeError")])
    assert pick_variant(table, op, 0.03) == "b"
    assert pick_variant(table, op, 0.30) is None
    assert pick_variant(table.replace("| 3.000 |", "| 4.100 |"), op, 0.03) == "a"
    assert pick_variant(table, "fwd", 0.03) is None  # no default row of that op
    from benchmarks import ops_mhc  # the command line a GPU plan calls: the name, or the row's code settings

    path = tmp_path / "t.md"
    path.write_text(table.replace("triton (b)", "triton (dx_rows_d128)"))
    ops_mhc.main(["--pick", str(path)])
    ops_mhc.main(["--pick", str(path), "--row"])
    assert capsys.readouterr().out.split() == [
        "dx_rows_d128", "py:kernels.mhc.fused.DX_LAYOUT=rows@py:kernels.mhc.fused.DX_ROWS_BLOCKS=pre_dx_rows_d128"]


def test_ops_mhc_row_of_a_variant_is_its_registry_entry_as_a_throughput_row(capsys):
    """benchmarks.ops_mhc --row-of NAME (what a GPU plan times a variant in the step with): the variant's settings from
    fused.NAMED_VARIANTS, which benchmarks.throughput reads back as the same settings; an unknown name is refused."""
    from benchmarks import ops_mhc, throughput
    from kernels.mhc import fused

    for name in ("read_t32", "dx_rows_tb4"):
        ops_mhc.main(["--row-of", name])
        row = capsys.readouterr().out.strip()
        assert [(attr, value) for _, attr, value in throughput.code_settings("mhc@" + row)] == list(
            fused.NAMED_VARIANTS[name].items())
    with pytest.raises(SystemExit):
        ops_mhc.main(["--row-of", "read_t16"])


def test_throughput_py_settings_hold_for_their_row_alone(monkeypatch, tmp_path):
    """``NAME@py:MODULE.NAME.ATTR=VALUE`` sets a code attribute while that row is built and timed, and restores it
    for the next row; a setting that does not resolve ends the command before any timing, naming it."""
    import benchmarks.roofline as roofline
    from residuals.attnres_block import BlockSummaries

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    seen = []
    monkeypatch.setattr(throughput, "time_training",
                        lambda *a, **k: seen.append(BlockSummaries.sum_in_merge) or (0.01, 0.0))
    setting = "py:residuals.attnres_block.BlockSummaries.sum_in_merge=False"
    text = throughput.main(["--models", "tiny", "--residuals", "attnres_block", f"attnres_block@{setting}",
                            "attnres_block", "--compile", "off", "--vocab", "64", "--tag", "_py"])
    assert seen == [True, False, True] and BlockSummaries.sum_in_merge is True
    assert f"attnres_block@{setting}" in text
    monkeypatch.setattr(throughput, "time_training", lambda *a, **k: pytest.fail("timed before the check"))
    for bad, match in [("py:residuals.attnres_block.BlockSummaries.no_such=1", "no_such"),
                       ("py:no_module_here.X=1", "no importable module"),
                       ("py:residuals.attnres_block.BlockSummaries.sum_in_merge", "py:MODULE.NAME.ATTR=VALUE")]:
        with pytest.raises(SystemExit, match=match):
            throughput.main(["--models", "tiny", "--residuals", "vanilla", f"attnres_block@{bad}", "--compile", "off"])


def test_profile_step_holds_a_rows_code_settings_for_that_row(tmp_path, monkeypatch):
    """``NAME@py:MODULE.NAME.ATTR=VALUE``: the row is profiled with the setting held, the next row without it."""
    import benchmarks.roofline as roofline
    from residuals.attnres import DepthAttentionResidual

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check; nothing runs on it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seen = []

    def fake_profile(model, residual, *args, **kwargs):
        seen.append((residual, DepthAttentionResidual.phase1_dtype))
        return {"wall_ms": 1.0, "gpu_ms": 1.0, "launches": 1}, [("op", 1, 1.0)]

    monkeypatch.setattr(profile_step, "profile", fake_profile)
    row = "attnres_block@py:residuals.attnres.DepthAttentionResidual.phase1_dtype=bfloat16"
    profile_step.main(["--residuals", row, "attnres_block", "--tag", "_test"])
    assert seen == [(row, "bfloat16"), ("attnres_block", "stream")]
    assert DepthAttentionResidual.phase1_dtype == "stream"


def test_profile_step_sorts_kernels_into_kinds_and_differences_them_to_the_first_residual():
    """Every Triton kernel of `kernels/` counts as a residual kernel; each kind's difference is against the first row."""
    ours = profile_step.residual_kernel_names()
    assert {"_merge_fwd_kernel", "_merge_bwd_kernel", "_summaries_fwd_kernel", "_summaries_bwd_kernel"} <= ours
    assert profile_step.kind_of("_merge_bwd_kernel", ours) == profile_step.KINDS[0]
    assert profile_step.kind_of("triton_poi_fused_add_0", ours).startswith("Inductor")
    assert profile_step.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", ours) == "GEMMs"
    assert profile_step.kind_of("triton_tem_fused_flex_attention_backward_2", ours) == "attention"
    vanilla = profile_step.by_kind([("nvjet_a", 3, 2.0), ("triton_poi_fused_0", 5, 1.0)], ours)
    other = profile_step.by_kind([("nvjet_a", 3, 2.5), ("_merge_fwd_kernel", 2, 0.75),
                                  ("void at::native::direct_copy_kernel_cuda", 1, 0.25)], ours)
    table = profile_step.kinds_table({"vanilla": vanilla, "attnres_block": other}, "t", [])
    rows = {r[0]: r for r in table.rows}
    assert rows["GEMMs"][1:] == ["2.00 (3)", "2.50 (3)", "+0.50"]
    assert rows[profile_step.KINDS[0]][1:] == ["0.00 (0)", "0.75 (2)", "+0.75"]
    assert rows["**all**"][1:] == ["3.00 (8)", "3.50 (6)", "+0.50"]


def test_bench_ms_times_as_its_timer_says_and_names_the_choices(monkeypatch):
    """benchmarks.roofline.TIMER: "events" times with triton.testing.do_bench, "graphs" with do_bench_cudagraph (CUDA
    graph replays: no launch gaps), each asked for the median; another value is refused with the choices."""
    import triton.testing

    from benchmarks import roofline

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (calls.append(("events", kw)), 1.5)[1])
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: (calls.append(("graphs", kw)), 0.5)[1])
    assert roofline.bench_ms(lambda: None) == 1.5
    with roofline.held([(roofline, "TIMER", "graphs")]):
        assert roofline.bench_ms(lambda: None, rep_ms=40) == 0.5
    assert roofline.TIMER == "events"
    assert calls == [("events", {"warmup": 25, "rep": 100, "return_mode": "median"}),
                     ("graphs", {"rep": 40, "return_mode": "median"})]
    monkeypatch.setattr(roofline, "TIMER", "wall")
    with pytest.raises(ValueError, match="TIMER='wall': choose one of events, graphs"):
        roofline.bench_ms(lambda: None)


def test_ops_mhc_refuses_an_unknown_timer():
    from benchmarks import ops_mhc

    with pytest.raises(SystemExit):
        ops_mhc.main(["--timer", "wall"])


def test_ops_mhc_sweep_candidates_name_real_kernels_and_blocks():
    """Every kernel of the mHC block sweep is a GPU_BLOCKS entry with an op to time, and every candidate is (BLOCK_T,
    BLOCK_D, warps, stages[, maxnreg]) with power-of-two blocks of 16 or more where the kernel has tensor-core tiles."""
    from benchmarks import ops_mhc
    from kernels.mhc import fused

    assert set(ops_mhc.BLOCK_CANDIDATES) <= set(fused.GPU_BLOCKS)
    assert set(ops_mhc.BLOCK_CANDIDATES) == set(ops_mhc.SWEEP_OP)
    for kernel, holds in ops_mhc.SWEEP_HOLDS.items():  # settings a kernel's sweep holds: real ones, valid values
        assert kernel in ops_mhc.BLOCK_CANDIDATES and all(v in fused.VARIANT_CHOICES[k] for k, v in holds.items())
    for kernel, candidates in ops_mhc.BLOCK_CANDIDATES.items():
        assert len(set(candidates)) == len(candidates), kernel
        for cand in candidates:
            assert len(cand) in (4, 5) and all(isinstance(v, int) and v > 0 for v in cand), (kernel, cand)
            block_t, block_d, warps = cand[:3]
            assert block_t & (block_t - 1) == 0 and block_d & (block_d - 1) == 0 and warps in (1, 2, 4, 8), cand
            if kernel.startswith(("pre_", "post_bwd_tc", "phi_grad")) and kernel != "pre_fwd":
                assert block_t >= 16 and block_d >= 16, (kernel, cand)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel runs on a CPU under the interpreter")
def test_wgmma_race_finds_no_race_under_the_interpreter_and_reports_one(tmp_path, monkeypatch):
    """benchmarks.wgmma_race: every configuration right and launch-to-launch identical under the interpreter (ragged
    last block, 3 streams), with the second sweep too; a launch corrupted at one token (of z, or of the second
    sweep's h) is reported as one token off and launches that differ."""
    import benchmarks.roofline as roofline
    from benchmarks import wgmma_race

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    monkeypatch.setattr(wgmma_race, "DEFAULT_CONFIGS", [(32, 64, 2, True, False), (64, 32, 2, False, False),
                                                        (32, 32, 2, True, True)])
    argv = ["--tokens", "150", "--d", "64", "--streams", "3", "--launches", "2", "--device", "cpu"]
    rows = roofline.read_rows(wgmma_race.main(argv))
    assert len(rows) == 3 and all(r["tokens off (worst launch)"] == "0" and r["launches agree"] == "yes"
                                  for r in rows), rows
    assert [r["second sweep"] for r in rows] == ["no", "no", "yes"]

    right, calls = wgmma_race.run, []

    def racing(x, w, block_t, block_d, stages, readback, sweep2):
        got = right(x, w, block_t, block_d, stages, readback, sweep2)
        calls.append(1)
        if len(calls) == 2:  # the first configuration's second launch: token 77 off
            got[0][77, 3] += 1.0
        if len(calls) == 6:  # the second sweep's second launch: h off at token 5
            got[2][5, 40] += 1.0
        return got

    monkeypatch.setattr(wgmma_race, "run", racing)
    rows = roofline.read_rows(wgmma_race.main(argv))
    assert [r["tokens off (worst launch)"] for r in rows] == ["1", "0", "1"], rows
    assert [r["launches agree"] for r in rows] == ["NO", "yes", "NO"] and rows[0]["launches off"] == "1 of 2", rows
    with pytest.raises(SystemExit, match="--d 48: a power of two"):
        wgmma_race.main(["--d", "48", "--device", "cpu"])
    monkeypatch.setattr(wgmma_race, "DEFAULT_CONFIGS", [(32, 64, 2, False, True)])
    with pytest.raises(ValueError, match=r"\(32, 64, 2, False, True\): the second sweep .* needs the read-back"):
        wgmma_race.main(argv)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on CPU tensors need TRITON_INTERPRET=1")
def test_msar_op_benchmark_checks_the_fused_op_it_times_and_its_pieces_run(monkeypatch):
    """benchmarks.msar_attn on the CPU (fp32 under the interpreter): its parity of h and every gradient is tight for
    the shipped op (T shorter than the longest tap, d not a multiple of a tile, 1 and 5 sources), it reports an op
    that is off by 1% as off, and the pieces it times (forward saving nothing, forward saving for the backward, mixer
    backward, streams backward) run as called."""
    import kernels.msar_attn as op
    from benchmarks import msar_attn

    for S, T, d in [(1, 7, 40), (5, 13, 24)]:
        errs = msar_attn.parity(S, T, d, seed=S, x_dtype=torch.float32, device="cpu")
        assert set(errs) >= {"h", "dx", "dqueries", "dgains", "dphi", "dalpha", "dbias"}
        assert max(errs.values()) < 1e-4, errs
    shipped = op.msar

    def off(*args, backend="auto", **kwargs):
        h = shipped(*args, backend=backend, **kwargs)
        return h * 1.01 if backend == "triton" else h

    monkeypatch.setattr(op, "msar", off)
    errs = msar_attn.parity(2, 9, 16, seed=0, x_dtype=torch.float32, device="cpu")
    assert 5e-3 < errs["h"] < 2e-2 and errs["dx"] > 5e-3
    monkeypatch.setattr(op, "msar", shipped)

    calls = []
    monkeypatch.setattr(msar_attn, "bench_ms", lambda fn: calls.append(fn()) or 1.0)
    parts = msar_attn.fused_breakdown(3, 1, 11, 24, seed=0, x_dtype=torch.float32, device="cpu")
    assert parts == {"forward, saving nothing": 1.0, "forward": 1.0, "mixer bwd": 1.0, "streams bwd": 1.0}
    assert len(calls) == 4
    nothing, saving = calls[0], calls[1]  # (h, lse, logits, saved, stats): the no-grad forward keeps nothing
    assert nothing[3] is None and nothing[4] is None and saving[3] is not None and saving[4] is not None
    torch.testing.assert_close(nothing[0], saving[0], rtol=0, atol=0)


def test_op_benchmarks_stopped_by_a_limit_leave_the_rows_they_timed(tmp_path, monkeypatch):
    """benchmarks.ops_attnres and benchmarks.msar_attn save their table after every row, marked partial, so a run
    stopped by its time limit (here an interrupt at the third implementation) leaves what it measured; the GPU is
    faked (ceilings, device name, timings): what is tested is the writing, not the numbers."""
    import benchmarks.roofline as roofline
    from benchmarks import msar_attn, ops_attnres

    class Ceil:
        def describe(self):
            return "fake ceilings"

        def floor_ms(self, nbytes, flops):
            return 0.5

        def binding(self, nbytes, flops):
            return "bytes"

    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 80GB")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for module in (ops_attnres, msar_attn):
        monkeypatch.setattr(module.Ceilings, "measure", staticmethod(lambda: Ceil()))
    calls = []

    def timed(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill would: the end of the process, not a failing row
        return 1.0, 2.0

    monkeypatch.setattr(ops_attnres, "parity", lambda *a, **k: 1e-3)
    monkeypatch.setattr(ops_attnres, "importable", lambda impl: None)
    monkeypatch.setattr(ops_attnres, "measure", timed)
    with pytest.raises(KeyboardInterrupt):
        ops_attnres.main(["--shapes", "small", "--ops", "block", "--impls", "fused", "reference", "fast-attnres",
                          "--no-breakdown"])
    text = (tmp_path / "ops_attnres_fake_gpu_80gb_small.md").read_text()
    assert "partial: 2 rows" in text and "- command:" in text
    assert [line.split("|")[5].strip() for line in text.splitlines() if line.startswith("| small")] == [
        "fused", "reference"]

    calls.clear()
    monkeypatch.setattr(msar_attn, "parity", lambda *a, **k: {"h": 1e-3})
    monkeypatch.setattr(msar_attn, "fused_breakdown", lambda *a, **k: {"forward": 1.0})
    monkeypatch.setattr(msar_attn, "implementations", lambda compile_reference: {
        "fused": None, "reference": None, "reference, torch.compile": None})
    monkeypatch.setattr(msar_attn, "timings", lambda *a: dict(zip(("fwd", "fb"), timed())) | {"peak_gib": 0.1})
    with pytest.raises(KeyboardInterrupt):
        msar_attn.main(["--shapes", "small", "--sources", "5", "2"])
    text = (tmp_path / "msar_attn_fake_gpu_80gb.md").read_text()
    assert "partial: 2 rows" in text
    assert [line.split("|")[6].strip() for line in text.splitlines() if line.startswith("| small")] == [
        "fused", "reference"]
    calls.extend([1] * 10)  # past the interrupt: the run ends and replaces the partial table with the whole one
    assert msar_attn.main(["--shapes", "small", "--sources", "5", "2"]) == 0
    text = (tmp_path / "msar_attn_fake_gpu_80gb.md").read_text()
    assert "partial" not in text and "targets (fused ≥ 50% of roofline fwd" in text
    assert len([line for line in text.splitlines() if line.startswith("| small")]) == 6

    # --timer graphs: every timing runs under bench_ms's graph timer, the table is named apart and says so, and the
    # default timer is back afterwards
    timers = []
    monkeypatch.setattr(msar_attn, "timings", lambda *a: timers.append(roofline.TIMER) or {"fwd": 1., "fb": 2.,
                                                                                          "peak_gib": 0.1})
    assert msar_attn.main(["--shapes", "small", "--sources", "5", "--timer", "graphs"]) == 0
    assert timers == ["graphs"] * 3 and roofline.TIMER == "events"
    assert "CUDA-graph replays" in (tmp_path / "msar_attn_fake_gpu_80gb_graphs.md").read_text()
    monkeypatch.setattr(ops_attnres, "measure", lambda *a: timers.append(roofline.TIMER) or (1.0, 2.0))
    timers.clear()
    ops_attnres.main(["--shapes", "small", "--ops", "block", "--impls", "fused", "reference", "--no-breakdown",
                      "--timer", "graphs"])
    assert timers == ["graphs"] * 2 and roofline.TIMER == "events"
    assert "replays of a CUDA graph" in (tmp_path / "ops_attnres_fake_gpu_80gb_small_graphs.md").read_text()


def test_mhc_op_parity_excuses_only_what_bf16_itself_cannot_hold(monkeypatch):
    """benchmarks.ops_mhc.parity: in bf16 an error above the tolerance passes only where the reference run in bf16 is
    at least half as far off on that same tensor (an ill-conditioned gradient such as α's); anywhere else, or in fp32,
    it fails; the worst tensor is named. (The errors are faked: what is tested is the rule.)"""
    from benchmarks import ops_mhc

    tol = ops_mhc.PARITY_TOL["bf16"]
    fused = {"post_pre/dalpha": 3 * tol, "sublayer/dx": tol / 4}
    own = {"post_pre/dalpha": 2 * tol, "sublayer/dx": tol / 40}
    monkeypatch.setattr(ops_mhc, "parity_errors",
                        lambda *a, backend="triton", **k: dict(own if backend == "torch" else fused))
    assert ops_mhc.parity(1, 8, 4, 16, 0, torch.bfloat16, "cpu") == (3 * tol, "post_pre/dalpha", True, 2 * tol)
    own["post_pre/dalpha"] = tol  # the reference holds it better than half: the fused ops' error is theirs
    assert ops_mhc.parity(1, 8, 4, 16, 0, torch.bfloat16, "cpu")[2] is False
    fused["sublayer/dx"], own["post_pre/dalpha"] = 2 * tol, 2 * tol  # an excused tensor does not excuse another
    assert ops_mhc.parity(1, 8, 4, 16, 0, torch.bfloat16, "cpu")[2] is False
    fused["sublayer/dx"] = tol / 4
    assert ops_mhc.parity(1, 8, 4, 16, 0, torch.float32, "cpu")[2] is False  # fp32: the tolerance alone
