#!/usr/bin/env bash
# The GPU work of one session, as lanes that run side by side, one per GPU of the host, each a list
# of steps with its own time limit; every step logs to OUTDIR/<lane>.<step>.txt and adds a line
# (exit code, seconds) to OUTDIR/summary.txt. A failing step does not stop its lane.
#   bash benchmarks/gpu_session.sh PLAN [OUTDIR]
# A step's limit of 0 skips it (every *_LIMIT variable below; `timeout 0` would mean no limit at all).
# On a host that hands back only a few files per call, keep OUTDIR outside the returned folder and
# put the one archive in it: ARCHIVE=$OUT/x.tgz bash benchmarks/gpu_session.sh PLAN /tmp/x
# PLAN:
#   check    GPU 0: the GPU tests, fused MSAR parity and timing, training parity of the fused backends;
#            GPU 1: the throughput table of every study residual (alone on its GPU), then the tile
#            sizes of the fused MSAR kernels (benchmarks.msar_tiles); GPU_TESTS, MSAR_SHAPES,
#            TILE_SHAPES and TRAIN_RESIDUALS pick what those steps cover
#   study    the paper_small comparison over both GPUs (STUDY_WORKERS runs at once; STUDY_STEPS to change
#            the preset's 400 steps), and beside it the GPU tests and the training parity of the fused
#            backends (correctness only: they share the GPUs with the study)
# Every lane's limits add up to at most 540 s, inside a host's 10-minute command limit with the set-up.
#   finish   what the 2026-11-30 study left (attnres_conv seeds 1-2, the scaling points of Block AttnRes
#            and Block MSAR) in a fresh store, to merge back with `python -m platform.store merge`
#   measure  GPU 0: fused MSAR parity and timing (MSAR_SHAPES); GPU 1: the throughput table
#            (THROUGHPUT_RESIDUALS, THROUGHPUT_ABLATIONS, THROUGHPUT_LIMIT seconds)
#   graphs   GPU 0: the CUDA-graph tests (GRAPH_TESTS), then the small throughput table with graphs off
#            and on (GRAPH_RESIDUALS, GRAPH_ABLATIONS, SMALL_GRAPHS), first, with PROFILE_RESIDUALS, the
#            profile of a graphed step; GPU 1: the medium table (MEDIUM_RESIDUALS, MEDIUM_GRAPHS); then,
#            with DDP_RESIDUALS, the 2-GPU scaling with graphs; GPU0_FIRST / GPU1_FIRST put a command
#            line first in a lane (GPU0_FIRST_LIMIT / GPU1_FIRST_LIMIT seconds)
#   kernels  one GPU: the fused kernels' GPU tests (KERNEL_TESTS), the fused mHC variants side by side, the
#            mHC block sweep of SWEEP_KERNELS, the graphed small table (KERNEL_RESIDUALS)
#   final    the session's closing tables, graphed (GPU 0: GPU tests, mHC block sweep, profile; GPU 1: every
#            residual and ablation at small, vanilla per recompute choice and the table at medium; then DDP)
#   closing  the closing tables with the final defaults (GPU 0: the GPU tests CLOSING_TESTS, every residual and
#            ablation at small; GPU 1: the medium table; then, with CLOSING_DDP=1, the 2-GPU scaling); TAG names
#            the result files (default _closing)
#   seeds    GPU 0: more seeds (SEEDS) of the study's runs SEED_RUNS, SEED_WORKERS at once on that GPU, in a
#            fresh store (merge it back with `python -m platform.store merge`); GPU 1, alone: the GPU tests
#            of the training path, the small table with the loss eager and compiled, vanilla at medium
#   scaling  GPU 1: the throughput table of every study residual, alone on its GPU; GPU 0: the scaling
#            fit (`scaling.workers=4`: its runs four at a time, then the fit)
#   sync     GPU 0: the source-gradient tile candidates SYNC_TILES (`benchmarks.msar_tiles --only` arguments),
#            `benchmarks.ops_attnres SYNC_OPS`; GPU 1: the GPU tests SYNC_TESTS (none: skipped), the profile of a
#            graphed step (PROFILE_RESIDUALS, none: skipped; PROFILE_TOP rows); then both GPUs: DDP's bucketed
#            all-reduce against one flat all-reduce after the backward (trainer.grad_sync; DDP_SYNCS, default
#            "ddp flat"), fp32 and bf16, graphed vanilla at small (SYNC_DDP=0 skips it); then the training
#            path, `platform.run` on two GPUs (RUN_ARGS, default trainer.grad_sync=flat; RUN_FLAT=0 skips it)
#   lr       both GPUs: the study preset's LR_RUNS (default vanilla, attnres_block, msar_block) at another peak
#            learning rate LR (default 3e-3; the preset trains at 1e-3), seeds SEEDS (default 0,1,2), STUDY_WORKERS
#            runs at once, in a fresh store; its report compare_lr_<LR>_small.md
#   mfu      one GPU: the small table of MFU_RESIDUALS (default vanilla) compiled per MFU_COMPILE (default "on model":
#            trainer.compile_scope sublayers and model), graphed; the profile of a graphed step compiled per
#            PROFILE_COMPILE (default model; none: skipped); then FlexAttention's tiles (benchmarks.flex_tiles,
#            FLEX_SHAPES, FLEX_BUDGET seconds); TAG names the result files (default _mfu)
#   scope    one GPU: graphed vanilla at small with FlexAttention's default tiles and the model's (model.flex_fwd,
#            flex_bwd), in one process; SCOPE_RESIDUALS at small compiled per sublayer and whole (trainer.compile_scope);
#            FlexAttention's quick tile sweep at FLEX_SHAPES (default medium; none: skipped)
#   closing1 the closing tables on one GPU: the GPU tests CLOSING_TESTS, every residual and ablation at small, the
#            medium table (MEDIUM_RESIDUALS), compiled per COMPILE (default model); TAG names the files (default _closing)
#   merge    one GPU: attnres and attnres_block with the fused merge and with residual.merge_backend=torch (compiled
#            with the sublayer), graphed, whole forward compiled, in one process (MERGE_MODELS, default "small medium")
#   combo    one GPU: the GPU tests of the whole-model compile (COMBO_TESTS), then COMBO_RESIDUALS graphed at small
#            without and with Inductor's combo kernels (trainer.compile_options); TAG names the files (default _combo)
#   sources  one GPU: attnres and attnres_block with their sources stored in the stream's dtype and in bf16
#            (residual.source_dtype), graphed, whole forward compiled, at SOURCES_MODELS (default "small medium"), in one
#            process; then the 60-step training parity of the fused bf16-source path against its reference (seeds 0 1)
#   options  one GPU: Inductor's combo kernels (trainer.compile_options) against the default for OPTIONS_RESIDUALS
#            (default vanilla attnres_block mhc) at small; the merge A/B at MERGE_MODELS (default small); the profile of
#            a graphed attnres_block step (PROFILE_RESIDUALS; none: skipped); all graphed, whole forward compiled
#   glue     one GPU: the GPU tests GLUE_TESTS (default the depth-attention kernels and AttnRes), then GLUE_RESIDUALS
#            (default vanilla attnres attnres_block) graphed at small with combo kernels, whole forward compiled; with
#            GLUE_OPTION (an Inductor setting, e.g. aggressive_fusion=true or coordinate_descent_tuning=true) vanilla
#            with and without it, in one process; the
#            profile of a graphed step of PROFILE_RESIDUALS (default attnres_block; none: skipped); with GLUE_PARITY=1
#            the 60-step training parity of the fused path of PARITY_RESIDUALS (default attnres_block attnres), seeds 0 1
#   attnref  one GPU: the 60-step parity of AttnRes's fused path compiled per sublayer (its reference fails to compile
#            whole: docs/gpu.md, the 2026-12-01 afternoon session); 3 steps of that reference compiled whole with
#            Inductor's loop_ordering_after_fusion off; the phase-1 kernels alone (benchmarks.ops_attnres, small)
#   router   one GPU: ROUTER_RESIDUALS (default vanilla attnres_block) graphed at small with the router's top-k as
#            torch.topk and as fused argmax rounds (model.moe_topk), whole forward compiled, in one process; the
#            profile of a graphed vanilla step with ROUTER_PROFILE_SET (default model.moe_topk=argmax; none: skipped);
#            ROUTER_ORDER=reverse times argmax, topk, argmax instead (the first row a process times can read slow)
#   chain    one GPU: the depth-attention GPU tests, then attnres_block at small with its partial summed inside the
#            merge and by a separate add (BlockSummaries.sum_in_merge), beside vanilla, in one process
#   chain2   one GPU: the same at medium, then attnres_block's 60-step training parity of the fused path (seeds 0 1)
#   chain3   one GPU: mhc with bf16 streams against its fp32 default in training (300 steps, seeds 0-2), the profile of
#            graphed vanilla and attnres_block steps at small, mHC's kernels before and now in 5 interleaved rounds
#   closing2 one GPU: the small table of every study residual and ablation, mhc with bf16 streams beside (SMALL_LIMIT)
#   phase1   one GPU (about 500 s with the start): the depth-attention GPU tests; Block AttnRes with its phase-1
#            outputs in bf16 under autocast (its default since 2026-12-03) beside fp32 outputs (STREAM1), full AttnRes
#            with and without bf16 ones (PHASE1), and vanilla, at small in one process (the default re-timed last);
#            attnres_block's 300-step training with the default held to the fp32 outputs' seed spread (seeds 0-2, eager;
#            TRAIN_SET adds overrides, e.g. trainer.compile=true). (As first run, on 2026-12-02 when fp32 outputs were the
#            default, the rows set DepthAttentionResidual.phase1_dtype=bfloat16: throughput_small_phase1{,b}.md.)
#   pairs    one GPU (about 450 s with the start): with the serial stats kernel two tokens a trip the default
#            (Blocks.stats_pairs; timed on 2026-12-02, final session: msar_tiles_nvidia_h200_pairs.md,
#            throughput_small_pairs.md), the op's GPU tests, and msar_block's `medium` step with it and with one token
#            a trip (the default before) beside vanilla, in one process
#   phase1p  one GPU (about 230 s with the start): the profile of graphed attnres_block steps at small with its
#            phase-1 outputs in bf16 (the default since 2026-12-03) and in the stream's dtype (STREAM1): which kernels
#            each runs
#   phase1m  one GPU (about 610 s with the start; run on 2026-12-03, when fp32 outputs were still the default):
#            Block AttnRes's bf16 phase-1 outputs (now the default) trained compiled, as trainer=gpu
#            trains (300 steps, seeds 0-2, held to the fp32 outputs' (STREAM1) seed spread), and its `medium` step beside
#            fp32 outputs' and vanilla's in one process (the re-timing last did not fit the step's 220 s)
#   delta    one GPU (about 500 s with the start): Block AttnRes's phase-1 backward taking dO·o from the kept bf16
#            outputs (fused.DELTA_FROM_OUTPUTS, the default since 2026-12-03) against the pass over the sources (NODELTA):
#            the depth-attention GPU tests, the `small` step of both beside vanilla in one process (the default re-timed
#            last), and 60 steps of training, seeds 0 1, with one against the other
#   closing3 one GPU (about 680 s with the start): the phase-1 backward with and without dO·o from the outputs alone
#            (benchmarks.depth_attn_tiles --default-only, small and medium, fp32), every study residual and ablation at
#            small in one process with this session's defaults, and attnres_block's `medium` step with and without it
#   launches one GPU (about 330 s with the start): the phase-1 backward alone with bf16 outputs (depth_attn_tiles
#            --default-only), then every kernel of a graphed `small` step of vanilla and attnres_block (profile_step --top 400)
#   folded   one GPU (about 600 s with the start): the depth-attention GPU tests, phase 1's backward per call of the
#            step with and without dO·o from the outputs (depth_attn_tiles), attnres_block's `small` and `medium`
#            steps beside vanilla with its sources in the stream's dtype (the default) and in bf16 (source_dtype),
#            then every kernel of the default's graphed `small` step
#   auto_delta one GPU (about 380 s with the start): attnres_block's `small` step with dO·o from the outputs per
#            fused.DELTA_FROM_OUTPUTS True (the default) and "auto", beside vanilla; its `medium` step beside vanilla
#   kept     one GPU (about 520 s with the start): the depth-attention GPU tests; what a compiled `medium` forward saves
#            and the peak of its forward and backward (benchmarks.saved_bytes --compile model, batch 16) for vanilla and
#            attnres_block with its merges keeping the phase-1 outputs (the default) and their own h; the `small` step
#            of both beside vanilla
#   lean     one GPU (about 560 s with the start): the depth-attention GPU tests, then attnres_block's `medium` step
#            beside vanilla with the defaults, its sources in bf16 (residual.source_dtype: phase 1 then keeps no outputs,
#            and its first consumer's input is a tensor of its own) and dO·o from the sources (DELTA_FROM_OUTPUTS=False)
#   sources2 one GPU (about 560 s with the start): Block AttnRes's sources in bf16 under autocast (its default since
#            2026-12-03, residual.source_dtype=autocast) trained compiled against fp32 sources (300 steps, seeds 0-2),
#            then its `small` step with both beside vanilla
#   ops_wide one GPU: benchmarks.ops_attnres at medium (fused, reference, torch.compile of it) and d2048 (fused, reference)
#   counters one GPU: Nsight Compute's counters (speed of light, occupancy, launch, warp stalls, memory) of the fused
#            kernels of COUNTER_OPS (default mhc msar attnres; benchmarks.kernel_counters), COUNTER_LAUNCHES
#            (default 8) launches each, clocks left alone
#   verify   one GPU, what the 2026-12-01 second afternoon built and could not time or check (about 560 s with the
#            start; pack it: ARCHIVE=$OUT/v.tgz ... verify /tmp/v): the 60-step parity of attnres_block with the new
#            depth-attention tiles, MSAR's view builder in the tile's own layout against the default
#            (benchmarks.msar_tiles --only views_3d=...), the depth-attention tile candidates added since (small)
#   evening  one GPU (about 560 s with the start; ARCHIVE=$OUT/e.tgz ... evening /tmp/e): attnres_block's 60-step
#            parity with the backward's one-source loads (the earlier tiles' check did not fit its call twice),
#            Block AttnRes and AttnRes with the sources stored in bf16 against fp32 (one process), and MSAR's view
#            builder in the tile's own layout at `medium` (benchmarks.msar_tiles --only views_3d=True)
#   evening2 one GPU (about 600 s with the start; ARCHIVE=$OUT/f.tgz ... evening2 /tmp/f): MSAR's stats and
#            source-gradient kernels at one warp (benchmarks.msar_tiles --only), then the `small` table of every
#            study residual and the `medium` table of vanilla and attnres_block with the evening's kernels
#   evening3 one GPU (about 400 s with the start; ARCHIVE=$OUT/g.tgz ... evening3 /tmp/g): MSAR's stats kernel on
#            one warp against its earlier tiles at `medium`, the MSAR GPU tests, and vanilla against msar_block
#   buffered one GPU (about 570 s with the start; ARCHIVE=$OUT/b.tgz ... buffered /tmp/b): MSAR's read over buffered
#            sources (2026-12-01 evening, untimed): the op's GPU tests and msar's GPU training tests (compiled whole
#            against eager, the end-of-run recording, a bf16 step), the `small` table of
#            vanilla, msar_block and msar (it also timed the register caps, since withdrawn)
#   fixed    one GPU (about 560 s with the start; ARCHIVE=$OUT/x.tgz ... fixed /tmp/x): MSAR's kernels with the row
#            offsets once per source (the buffered read's per-element int64 offsets spilled the source-gradient kernel):
#            forward, stats and source gradients at `small` (benchmarks.msar_tiles; it was run with a register cap as
#            the one candidate, since withdrawn), the buffered read against a list
#            (benchmarks.msar_buffered), the `small` table of vanilla, msar_block and msar, the op's GPU tests
#   parity   one GPU (about 580 s with the start; ARCHIVE=$OUT/p.tgz ... parity /tmp/p): the 60-step training parity
#            of PARITY_RESIDUALS (default msar_block, its read over buffered sources) against the reference, seeds 0 1,
#            with PARITY_SET overrides (trainer.compile=false: msar_block's reference compiled whole takes about 200 s
#            a run to compile, so four runs do not fit one call);
#            then the training-path GPU tests of PARITY_TESTS (a -k expression, default msar)
#   eager    one GPU (about 560 s with the start; ARCHIVE=$OUT/q.tgz ... eager /tmp/q): the fused reads and writes
#            run as one eager call each (2026-12-01 late, counted on the CPU only): the compiled-whole training tests of
#            EAGER_TESTS (a -k expression, default attnres_block or msar_block) with TORCH_LOGS=recompiles and their
#            durations, then the `small` table of vanilla, attnres_block and msar_block (EAGER_RESIDUALS)
#   memory   one GPU (about 600 s with the start; ARCHIVE=$OUT/m.tgz ... memory /tmp/m): what 2026-12-01 late changed in
#            what the fused ops keep for backward (Block AttnRes's merges keep their output, not the group's phase-1
#            outputs; MSAR keeps R in bf16 under autocast): the `medium` table of vanilla, attnres_block and msar_block
#            (peak memory; MEMORY_RESIDUALS), then the 60-step training parity of msar_block and attnres_block against
#            their references, eager (PARITY_RESIDUALS, PARITY_SET), seeds 0 1
#   serial   one GPU (about 630 s with the start: lower a limit to fit one call; ARCHIVE=$OUT/s.tgz ... serial /tmp/s): MSAR's serial stats and
#            source-gradient kernels (2026-12-01 last, Blocks.stats_mode and src_mode): their candidates against the
#            tile and ring kernels at `small` and `medium`
#            (benchmarks.msar_tiles), the op's GPU tests, the `small` table of vanilla and msar_block, and
#            msar_block's 60-step training parity against its reference, eager, seeds 0 1
#   serial2  one GPU (about 580 s with the start; ARCHIVE=$OUT/t.tgz ... serial2 /tmp/t): what the serial kernels left
#            open: msar_block's `medium` peak and step beside vanilla (their per-call buffers), the serial source-
#            gradient kernel on 256 channels and both serial kernels with serial_fast (document masks only where a
#            boundary is in the window) at `small` and `medium`, and Nsight Compute's counters of MSAR's kernels
#   saved    one GPU (about 560 s with the start; ARCHIVE=$OUT/t.tgz ... saved /tmp/t): the serial stats kernel reducing
#            dR·E alone from the forward's saved logits and ρ, against recomputing them and with its loads a step ahead,
#            the source-gradient kernel on 256 channels against 128, the forward that saves them, at `small` and
#            `medium`; the op's GPU tests, msar_block's `small` step beside vanilla and its 60-step training parity
#   split    one GPU (about 300 s with the start): the split forward (two passes over channel tiles) against the tile
#            forward and its tiles, at `small` and `medium` (S = 5), and at `medium` with 17 sources
#   split2   one GPU (about 620 s with the start): with the split forward the default, the op's GPU tests, msar_block's
#            `small` and `medium` steps beside vanilla and its 60-step training parity
#   split3   one GPU (about 200 s with the start): Nsight Compute's counters of MSAR's kernels with the split forward,
#            and msar's `small` step beside vanilla
#   lean2    one GPU (about 620 s with the start): with the lean pass 2 and the forward's glue kernels the defaults
#            (the `lean` plan timed them on 2026-12-02, msar_tiles_nvidia_h200_lean*.md), the forward as first timed
#            and each change alone, the backward's glue kernel (Blocks.stats_glue) at `small` and `medium`; the op's
#            GPU tests; msar_block's and msar's `small` steps beside vanilla; msar_block's 60-step parity. Its
#            `medium` step: TEST_LIMIT=0 SMALL_LIMIT=0 PARITY_LIMIT=0 TAG=_lean2_medium ... split2
#   streams  one GPU (about 550 s with the start): msar_block with residual.recompute_streams (no R kept for the
#            mixer's backward) against the default, in one process, at `medium` and `small` (step and peak)
#   medium_all one GPU (about 400 s with the start): the `medium` table of MEDIUM_RESIDUALS (default vanilla
#            attnres_block mhc msar) in one process
#   lean3    one GPU (about 600 s with the start): with every glue kernel the default too, msar_block's `medium` step
#            beside vanilla, the `small` table of every study residual and ablation, the counters of MSAR's kernels
#   mhc      one GPU (about 600 s with the start): the mHC kernel variants of 2026-12-02 (kernels/mhc/fused.py, off by
#            default; MHC_VARIANTS) against the default in one process, bf16 streams at `small` and `medium`, fp32
#            streams at `small`; the mHC GPU tests (every variant); mhc's `small` step with bf16 streams (its default
#            under autocast since 2026-12-05) and fp32 streams (stream_dtype=input) beside vanilla (MHC_ROWS)
#   mhc2     one GPU (about 600 s with the start): with the tensor-core variants the default for bf16 streams (the `mhc`
#            plan's ops_mhc_variants.md), the defaults against the settings before, twice each in one process, bf16
#            and fp32 streams; the mHC GPU tests; mhc's `medium` and `small` steps with fp32 and bf16 streams beside
#            vanilla
#   mhc3     one GPU (about 400 s with the start): mhc's `small` step with fp32 and bf16 streams beside vanilla (the
#            defaults of the `mhc2` plan), and Nsight Compute's counters of mHC's kernels (bf16 streams)
#   where    one GPU (about 500 s with the start): where each residual's extra step time goes, by kind of kernel
#            (benchmarks.profile_step's _kinds table): vanilla and attnres_block graphed at `medium`, then vanilla,
#            attnres_block, mhc and msar_block at `small` (WHERE_SMALL)
#   wide     one GPU (about 560 s with the start): the phase-1 backward's tiles at `medium` (d = 1024, bf16 sources) for
#            the step's calls of 3, 4, 6 and 8 summaries (WIDE_CANDIDATES: more warps, one load of every source, a cap
#            on registers), then attnres_block's `medium` step beside vanilla with the fastest of them (fused.WIDE_BWD)
#            and without (re-timed last)
#   narrow   one GPU (about 380 s with the start): the depth-attention GPU tests, then attnres_block's `medium` step with
#            the phase-1 backward over 3 or 4 sources in one load over 4 warps (fused.NARROW_WIDE_BWD, the default) and
#            with the tiles before (WIDE_BWD=(2,2,True,0)), beside vanilla, the default re-timed last
#   split_bwd one GPU (about 560 s with the start): the depth-attention GPU tests, the phase-1 backward at `medium` (bf16
#            sources) split in two kernels (fused.SPLIT_BWD=True) against one, at each call of the step (SPLIT_OPS),
#            then attnres_block's `medium` step with each beside vanilla, the one-kernel backward re-timed last
#   rows_medium one GPU (about 480 s with the start): the depth-attention GPU tests, then attnres_block's `medium` step
#            with its defaults, with fp32 row gradients (buffer.ROW_GRADIENTS=float32), and with those and the one-kernel
#            phase-1 backward (the defaults before), beside vanilla, the default re-timed last
#   rows_small one GPU (about 420 s with the start): the same at `small` without the split (not taken there), then 60
#            training steps of attnres_block at `small` with bf16 row gradients against fp32 ones (2 seeds)
#   split_sweep one GPU (about 150 s with the start): the split phase-1 backward's tiles (SPLIT_CANDIDATES, as
#            fused.SPLIT_TILES) at each call of attnres_block's `medium` step, beside the one-kernel backward
#   scores_fwd one GPU (about 560 s with the start): SCORES_ONCE and the forward's FWD_WARPS=4 / FWD_TAIL alone at
#            each call of attnres_block's `medium` step, then the step with each beside vanilla and the default
#   fwd_check one GPU (about 420 s with the start): the depth-attention GPU tests, then the `medium` and `small` steps
#            with the defaults of 2026-12-04 beside the settings before them (BEFORE_DEC4), the default re-timed last
#   split_counters one GPU (about 300 s with the start): Nsight Compute's counters of Block AttnRes's kernels at
#            `medium`'s width over 8 summaries (kernel_counters attnres_medium), tabulated
#   scores_chunks one GPU (about 300 s with the start): the split scores kernel in chunks of 16 channels alone at 3,
#            5 and 8 sources, then attnres_block's `medium` step with it beside the default
#   logits   one GPU (about 500 s with the start): the split backward with its scores kernel taking the forward's logits
#            (SCORES_FROM_LOGITS) against summing them again, and its chunks and the gradients kernel's tiles, alone at
#            each call of attnres_block's `medium` step; then that step with each beside vanilla, the default re-timed
#   logits_check one GPU (about 480 s with the start): the depth-attention GPU tests, then the `medium` step with the
#            default alternating with the logits summed again, vanilla re-timed last
#   logits_where one GPU (about 330 s with the start): the split backward's tiles around the default alone, then where
#            the `medium` step goes by kind of kernel (benchmarks.profile_step)
#   grads_cap one GPU (about 420 s with the start): the split gradients kernel under a register cap alone, then the
#            `medium` step with the cap of 128 alternating with the default
#   grads_cap2 one GPU (about 300 s with the start): grads_cap's step in the opposite order
#   rows     one GPU (about 480 s with the start): the split gradients kernel over its sources as rows
#            (SPLIT_GRADS_ROWS): GPU tests with it, alone at each call of medium's step, then the step alternating
#            (the split as one kernel, timed by plan split_one on 2026-12-04 and 2.2-12x slower alone, is removed)
#   stream   one GPU (about 500 s with the start): the phase-1 forward with its sources streamed (FWD_STREAM): GPU
#            tests, alone at each call of medium's step (1 or 2 rows a load, prefetched or not), the step alternating
#   stream_rule one GPU (about 630 s with the start): the forward streamed from 9 sources (the rule) against the chunks
#            of before: the bf16 GPU test, full AttnRes and the final call alone, full AttnRes's small and medium steps
#   stream_pairs one GPU (about 600 s with the start): stream_rule's timings (no pytest) and MSAR's pass 2 two tokens a
#            trip (Blocks.split_trip): alone at small and medium, msar_block's small step alternating
#   pairs2   one GPU (about 330 s with the start): MSAR's op GPU tests with pass 2 two tokens a trip the default, then
#            msar_block's small step beside one token a trip
#   pairs_medium one GPU (about 600 s with the start): MSAR's op GPU tests, pass 2's forward alone with one, two
#            (the default) and four tokens a trip, msar_block's medium step beside one token a trip
#   msar_next one GPU (about 600 s with the start): pairs_medium with the token-major candidates of 2026-12-04 night
#            (Blocks.parts_layout, Blocks.coef_layout) timed alone at small and medium too
#   mhc_next one GPU (about 670 s with the start): the mHC read forward at 4×4 outputs a thread (PRE_FWD_BLOCKS=
#            'pre_fwd_w2', built 2026-12-04 night): the op's GPU tests, the op alone against the default in
#            interleaved rounds (fp32 streams, small and medium), mhc's small step beside the default; then the
#            streams kept every L_r sublayers (residual.recompute_every): small's and medium's step and peak
#   msar_sources one GPU (about 940 s with the start): the GPU test of MSAR over bf16 sources, msar_block's sources in bf16 under autocast
#            (residual.source_dtype=autocast, built 2026-12-05 on the CPU): medium's step and peak beside fp32 sources,
#            with and without recompute_streams, in one process; then training parity at small against fp32 sources
#   peaks    one GPU: the same medium rows (vanilla msar_block vanilla msar_block) with the compile caches on and off, each
#            in its own process: whether a repeated row's higher peak comes from a cached compile (PEAKS_LIMIT each)
#   parity_all one GPU (commands about 320 s on an H100 on 2026-12-05, msar 246 and mhc 67, plus the start): the
#            60-step training parity of the fused ops against their references (eager, seeds 0 1) for the variants
#            with no run of today's defaults on record: msar (never), mhc (last 2026-11-30, before the streams kept
#            every L_r* sublayers); PARITY_ALL_RESIDUALS, PARITY_LIMIT
#   mhc_long one GPU (its command 361 s on an H100 on 2026-12-05, plus the start): mHC's bf16 streams against its
#            fp32 streams (stream_dtype=input) over LONG_STEPS (default 1000) steps at small on the large corpus
#            (data=large: carry data/shards/large, built by `python -m data.build_corpus --large`), seeds LONG_SEEDS
#            (default 0 1), eager: whether a longer run than the 300 steps (two epochs of the shipped corpus) of
#            2026-12-02 still trains alike (LONG_LIMIT)
#   ahead    one GPU (about 520 s with the start on a cold host, estimated): MSAR's pass 2 loading a source's rows
#            one source ahead (Blocks.split_ahead): GPU tests, alone against the default, msar_block's small step
#            (249 s on a cold H200 with the start, 2026-12-05 late)
#   ahead_medium one GPU: msar_block's medium step with pass 2's rows a source ahead against the default, then the
#            training path's GPU tests (MSAR_MEDIUM_LIMIT, CLOSING_TEST_LIMIT)
#   src_ahead2 one GPU (about 450 s with the start, estimated): the source-gradient kernel with two tokens' loads in
#            flight (Blocks.serial_ahead2): GPU tests with it, the streams backward alone, msar_block's small step.
#            Its first two steps ran 2026-12-05 late on an H100 (tests pass; 32-35% slower alone, so the step was not
#            timed)
#   mhc_read_split one GPU (about 450 s with the start, estimated): the read forward as three kernels: GPU tests, alone
#              against the one-kernel read, then mhc's small step if it won alone; then the race reduced (wgmma_race)
#   mhc_split_step one GPU (about 400 s with the start, estimated): the split read in mhc's graphed small step, then
#              its kernels profiled beside the one-kernel read's
#   mhc_auto_read one GPU (about 450 s with the start, estimated): READ_LAYOUT="auto" (the default since 2026-12-06,
#              end): the mHC GPU tests, then mhc's graphed small step against the fused read
#   mhc_bwd_split one GPU (about 400 s with the start, estimated): PRE_BWD_LAYOUT="split": its GPU tests, then mhc's
#              graphed small step with it against the default, alternating (no vanilla row, for the budget)
#   mhc_phi_blocks one GPU (about 350 s with the start, estimated): the reads timed as CUDA graph replays (--timer
#              graphs), the block sweep of phi's gradient (a GPU_BLOCKS entry since 2026-12-06, end), mhc's GPU tests
#   mhc_race_bisect one GPU (about 150 s with the start, estimated): the read forward's racing blocks (64, 64, 4, 2)
#              against (64, 64, 4, 1) with 0, 1 and 20 Sinkhorn iterations and SINKHORN tile / token
#   msar_glue  one GPU (241 s on a cold H100, 2026-12-06 night; PARITY_LIMIT=200 adds the parity): MSAR's split
#              forward combining h from the kept bf16 streams that pass 2 writes (Blocks.combine_from=kept) and the
#              source gradients' partials summed by a kernel (Blocks.part_sums=triton), the defaults since, against the
#              settings before: the GPU tests, the sums alone at small and medium, msar_block's small step alternating
#              (each, and both), then the kept combine's 60-step training parity against the fp32 one, eager, seeds 0 1
#   msar_dr    one GPU (about 420 s with the start, estimated): dR in bf16 (Blocks.grad_streams=kept): the op's GPU tests
#              at the defaults and with it, msar_block's small step alternating, its 60-step training parity (eager,
#              seeds 0 1)
#   msar_partial one GPU (about 200 s with the start, estimated): msar_block's small step with the open block's partial
#              cast to the buffer's dtype by the write that sums it (BlockSummaries.cast_partial_in_write, a candidate)
#              alternating with the cast in each read (the default)
#   msar_views one GPU (about 520 s with the start, estimated): msar_block's small step with its per-consumer parameters
#              sliced once a forward (Msar.params_once) and the open block's partial cast by the write that sums it
#              (cast_partial_in_write, plan msar_partial's candidate), each alone and both, against the defaults; then
#              mhc's small step with its layers' parameters sliced once a forward (MHC.params_once) against the default
#   views_medium one GPU (about 560 s with the start, estimated): after msar_views, with its winners the defaults: the
#              graphed small step profiled (vanilla, msar_block, mhc), then medium's step of msar_block and mhc beside
#              vanilla against the settings before (BEFORE_MSAR, BEFORE_MHC: py: settings, empty leaves a row out)
#   mix_walk   one GPU (about 520 s with the start, estimated): dφ, Σ dz and Σ dz·y summed inside MSAR's mixer backward
#              (Blocks.mix_dphi=walk, a candidate): the op's GPU tests with it, the mixer backward alone with the walk's
#              tiles at small and medium, msar_block's small step alternating with the product (the default)
#   mix_next   one GPU (about 560 s with the start, estimated): after mix_walk (the walk lost), MSAR's mixer backward at
#              (4 tokens, 8 warps) at `small` (its fastest alone in mix_walk's sweep) and dφ's product partials in fp32
#              (Blocks.dphi_partials=float32), each and both, in msar_block's small step alternating with the defaults;
#              then the fp32 partials in the medium step (MEDIUM_LIMIT=0 leaves it out)
#   mix_default one GPU (about 480 s with the start, estimated): with dφ's product partials in fp32 the default
#              (Blocks.dphi_partials=float32, after mix_next): the op's GPU tests (with Blocks.pack_once too), msar_block's
#              small step with the backward taking what the forward packed (pack_once, a candidate) alternating with the
#              default, then msar_block's 60-step training parity against the partials in bf16 (eager, seeds 0 1)
#   dphi_reduce one GPU (about 520 s with the start, estimated): dφ, Σ dz and Σ dz·y by one reduction kernel after
#              MSAR's mixer backward (Blocks.mix_dphi=reduce, a candidate): the op's GPU tests with it, the mixer
#              backward alone with the reduction's tiles at small and medium, msar_block's small step alternating with
#              the product (the default); RED sets the candidate's fields (a dict's body, default 'mix_dphi':'reduce');
#              PARITY_LIMIT (default 0: left out) adds msar_block's 60-step training parity with it against the product
#              TEST_K picks the GPU tests (a pytest -k; default: plain, reduce and fp32)
#   glue_next  one GPU (about 700 s with the start on a cold host, estimated): three candidates of msar_block's glue,
#              the dφ reduction summing once at the end (LATE, default 'mix_dphi':'reduce','dphi_late':True,
#              'dphi_bt':4), Σ dz and Σ dz·y summed by the mixer backward's programs (SUMS, default
#              'mix_sums':'kernel') and the reads' packing once a step (Msar.pack_step): the op's GPU tests with the
#              first two (TEST_K), the graphed-step test with the third (GRAPHS_LIMIT=0 leaves it out), then
#              msar_block's small step beside vanilla alternating with all three
#   glue_both  one GPU (about 550 s with the start, estimated; split it by the limits): the two winners of glue_next
#              together (the dφ reduction summed late, LATE as in glue_next, and the reads packed once a step, the
#              default since its first run): the op's GPU tests of the first (TEST_K), the msar residuals' graphed-step
#              tests with the second on and off, msar_block's small and medium steps
#              alternating with the default, its 60-step training parity (eager, seeds 0 1) and the small step
#              profiled by kernel and kind (PROFILE_LIMIT=0 leaves it out). Since the late sum is the default
#              (2026-12-07, final session) its rows time LATE against it: set LATE to another setting, e.g. the
#              product before it, LATE="'mix_dphi':'product','dphi_late':False,'dphi_bt':8"
#   dphi_default one GPU (about 400 s with the start, estimated): with the dφ reduction summed late the default
#              (Blocks.mix_dphi="reduce", dphi_late), the msar residuals' graphed-step tests, then msar_block's 60-step
#              training parity (eager, seeds 0 1) of the default against the product before it (PRODUCT)
#   glue_medium one GPU (about 520 s with the start, estimated): msar_block's medium step alternating with CAND (fields
#              as a dict's body, default 'mix_sums':'kernel'; or CAND_ROW, a whole code setting such as
#              py:residuals.msar.Msar.pack_step=True), then its 60-step training parity against the default
#              (PARITY_LIMIT=0 leaves it out)
#   dphi_medium one GPU (about 480 s with the start, estimated): after dphi_reduce, msar_block's medium step alternating
#              with the reduction (RED as there), then msar_block's 60-step training parity with it against the product
#              (eager, seeds 0 1; PARITY_LIMIT=0 leaves it out)
#   mhc_phi_check one GPU (about 330 s with the start, estimated): the mHC GPU tests with φ's new blocks as the
#              default, the race reduction with the read's second sweep (wgmma_race), then vanilla, mhc and msar_block's
#              graphed small step profiled by kernel and kind (PROFILE_LIMIT=0 leaves it out)
#   mhc_phi_medium one GPU (250 s warm on an H100 with vanilla in front, 2026-12-06 evening): φ's gradient at the
#              blocks that won its `medium` sweep (the default since) against the blocks before (phi_r64): GPU chain
#              test, then mhc's `medium` step alternating (MODEL=small: 115 s)
#   mhc_dx_tb  one GPU (about 450 s with the start, estimated): the rows dX walking 4 or 8 token blocks a program
#              (DX_ROWS_TOKEN_BLOCKS): GPU chain tests, alone against the default, mhc's small step if one won alone
#   mhc_profile one GPU (about 200 s with the start, estimated): vanilla and mhc's graphed step profiled, by kernel and kind
#   mhc_bwd_blocks one GPU (about 300 s with the start, estimated): the block sweep of mHC's write backward and rows dX
#              with one-stage candidates (TEST_LIMIT=150 adds the mHC GPU tests)
#   mhc_read64 one GPU (about 500 s with the start, estimated; MEDIUM_LIMIT=300 SMALL_LIMIT=0 for medium alone): the read
#              forward at 64 tokens, one stage: GPU tests, alone against 32 tokens, mhc's steps beside vanilla
#   mhc_next2  one GPU (about 550 s with the start, estimated; PARITY_LIMIT=0 for the checks alone): the read
#              forward's 64-token blocks checked result by result and swept, then the rows dX's training parity (eager)
#   mhc_dx_rows one GPU (about 600 s with the start, estimated): the rows dX, the token Sinkhorn and the read's block
#              sweep alone, then mhc's small step with the variant that won alone
#   mhc_tc_bwd one GPU (about 480 s with the start, estimated): mHC's write backward (POST_BWD_PROJ=bf16x3) and the
#            read's sums (PRE_SUMS=bf16x3) on tensor cores: GPU tests, the ops alone in rounds at small and medium, mhc's
#            small step alternating
#   msar_full_sources one GPU (431 s on a cold H100, 2026-12-05 night): full msar's sources in bf16 under autocast
#            (residual.source_dtype=autocast, its default since): its 60-step parity against fp32 sources, eager, seeds
#            0 1; then medium's step and peak beside vanilla and fp32 sources (PARITY_LIMIT, MEDIUM_LIMIT)
#   attnres_next one GPU (about 450 s with the start): the bf16 GPU test of the forward's streaming rule, then full
#            AttnRes's medium step with the rule (ran 2026-12-05 late with the split gradients' two candidates, since
#            removed: they lost alone)
#   prefetch_all one GPU (about 400 s with the start): the split gradients kernel loading a trip's sources and scalars
#            a trip ahead (SPLIT_GRADS_PREFETCH='all'): GPU tests, alone at each call beside the sources alone, the step
#   rows8    one GPU (about 400 s with the start): the split gradients kernel as rows at 8 warps a token
#            (SPLIT_GRADS_ROWS with SPLIT_TILES' warps): GPU tests, alone at each call (also 1 source a trip), the step
#   prefetch one GPU (about 380 s with the start): the split gradients kernel loading each trip's sources a trip ahead
#            (SPLIT_GRADS_PREFETCH): GPU tests with it, alone at each call of medium's step, then the step alternating
#   dtiles   one GPU: the depth-attention kernels' tile sweep (benchmarks.depth_attn_tiles) at DTILES_SHAPES
#            (default small), fp32 and bf16 sources; DTILES_ARGS adds options (e.g. --dtypes fp32)
# Wheels: installed from .whl/ into /tmp/site when present (`make gpu-bundle`). At the end the new
# results, the logs and the host's MLflow store (mlruns/) are packed into one archive, ARCHIVE
# (default OUTDIR.tar.gz), so the runs can be read back on another machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PLANS="check study finish seeds scaling measure graphs kernels final closing sync lr mfu scope closing1 merge options combo sources glue attnref router counters dtiles verify evening evening2 evening3 buffered fixed parity eager memory serial serial2 saved split split2 split3 lean2 lean3 medium_all streams mhc mhc2 mhc3 chain chain2 chain3 closing2 ops_wide phase1 pairs phase1p phase1m delta closing3 launches folded auto_delta kept lean sources2 where wide narrow split_bwd rows_medium rows_small split_sweep scores_fwd fwd_check split_counters scores_chunks logits logits_check logits_where grads_cap grads_cap2 rows prefetch rows8 prefetch_all stream stream_rule stream_pairs pairs2 pairs_medium msar_full_sources attnres_next msar_next mhc_next msar_sources peaks mhc_long parity_all ahead ahead_medium src_ahead2 mhc_tc_bwd mhc_dx_rows mhc_next2 mhc_read64 mhc_bwd_blocks mhc_profile mhc_read_split mhc_split_step mhc_auto_read mhc_bwd_split mhc_phi_blocks mhc_race_bisect mhc_dx_tb mhc_phi_medium mhc_phi_check msar_glue msar_dr msar_partial msar_views views_medium mix_walk mix_next mix_default dphi_reduce dphi_medium glue_next glue_medium glue_both dphi_default ops_final timers apart final2"
PLAN=${1:?plan: ${PLANS// / | }}
case " $PLANS " in
  *" $PLAN "*) ;;
  *) echo "unknown plan $PLAN: ${PLANS// / | }" >&2
     exit 2 ;;
esac
OUTDIR=${2:-benchmarks/results/gpu_session}
ARCHIVE=${ARCHIVE:-$OUTDIR.tar.gz}
mkdir -p "$OUTDIR"
export MLFLOW_DISABLE_TELEMETRY=true HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
touch "$OUTDIR/.started"

# step LANE NAME LIMIT CMD...: run CMD under a time limit, log it, record the result.
step() {
  local lane=$1 name=$2 limit=$3; shift 3
  if [ "$limit" = 0 ]; then
    printf '%-6s %-22s skipped (limit 0)\n' "$lane" "$name" >> "$OUTDIR/summary.txt"
    return 0
  fi
  local t0=$SECONDS log="$OUTDIR/$lane.$name.txt"
  { echo "# \`$*\` ($(date -u +%FT%TZ), CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all})"; timeout -k 10 "$limit" "$@"; } > "$log" 2>&1
  local rc=$?
  printf '%-6s %-22s rc=%-3s %4ss  %s\n' "$lane" "$name" "$rc" "$((SECONDS - t0))" "$*" >> "$OUTDIR/summary.txt"
}

# mhc_small_if_won TAG OP: after `benchmarks.ops_mhc --variants ... --tag TAG`, mhc's small step beside vanilla,
# alternating with the variant whose OP time won by 3% or more at some shape (none: no step, said in the summary)
# the mHC kernels' GPU tests (mhc_tests LIMIT [PYTEST_K]): the whole file, or the tests -k selects
mhc_tests() { step gpu0 gpu_tests "$1" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
  tests/kernels/test_mhc_fused.py ${2:+-k "$2"}; }
# vanilla and other rows' graphed `small` (MODEL) step profiled by kernel and kind (mhc_profile_step LIMIT TAG ROWS...)
mhc_profile_step() { local limit=$1 tag=$2; shift 2
  step gpu0 profile "$limit" python3 -m benchmarks.profile_step --model "${MODEL:-small}" --residuals "$@" \
    --compile model --graphs on --top 40 --set $COMBO --tag "$tag"; }
mhc_small_if_won() {
  local row
  row=$(python3 -m benchmarks.ops_mhc --pick "benchmarks/results/ops_mhc$1.md" --op "$2" --gain 0.03 --row \
    2>> "$OUTDIR/summary.txt")
  if [ -z "$row" ]; then
    echo "small step skipped: no variant won alone ($2)" >> "$OUTDIR/summary.txt"
    return 0
  fi
  step gpu0 small "${SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small \
    --residuals vanilla mhc "mhc@$row" mhc "mhc@$row" --compile model --graphs on --steps 8 --set $COMBO --tag "$1"
}
STUDY=(python3 -m platform.compare compare=paper_small mlflow.depth_heatmaps=false)
SCALING=(python3 -m platform.scaling trainer=gpu data=large mlflow.depth_heatmaps=false)
# throughput LANE LIMIT: the training-step table of every study residual (alone on its GPU for timings)
throughput() {
  step "$1" throughput "$2" python3 -m benchmarks.throughput --models small \
    --residuals ${THROUGHPUT_RESIDUALS:-vanilla attnres attnres_block mhc msar_block attnres_mhc_sum} \
    --ablations ${THROUGHPUT_ABLATIONS:-wo_conv attnres_conv} --compile on --steps 8 --tag _session
}
APART=py:residuals.attnres_block.BlockSummaries.sum_in_merge=False  # Block AttnRes's partial by a separate add
ONCE=py:kernels.depth_attn.fused.SCORES_ONCE=True  # the split scores kernel reducing once
# Block AttnRes's phase-1 settings before 2026-12-04: scores a chunk at a time, the split from 5 sources, padded forward
BEFORE_DEC4="py:kernels.depth_attn.fused.SCORES_ONCE=False@py:kernels.depth_attn.fused.SPLIT_SOURCES=(5,9)"
BEFORE_DEC4="$BEFORE_DEC4@py:kernels.depth_attn.fused.FWD_TAIL=False"
RECOMPUTE=py:kernels.depth_attn.fused.SCORES_FROM_LOGITS=False  # the split scores kernel sums the logits again
CAP128=py:kernels.depth_attn.fused.SPLIT_GRADS_MAXNREG=128  # the split gradients kernel at 128 registers a thread
UNPAIRED="py:kernels.msar_attn.fused.FIELDS={'stats_pairs':False}"  # MSAR's stats kernel one token a trip (before)
PHASE1=py:residuals.attnres.DepthAttentionResidual.phase1_dtype=bfloat16  # phase-1 outputs in bf16 (full AttnRes)
STREAM1=py:residuals.attnres_block.AttnResBlock.phase1_dtype=stream  # Block AttnRes's phase-1 outputs in fp32 (before)
NODELTA=py:kernels.depth_attn.fused.DELTA_FROM_OUTPUTS=False  # phase 1's backward sums dO·o over the sources everywhere
COMBO=+trainer.compile_options.combo_kernels=true  # Inductor's combo kernels, as trainer=gpu trains
# table_small / table_medium NAME LIMIT TAG: every study residual and ablation at `small`, MEDIUM_RESIDUALS at
# `medium`, one process each, graphed, compiled per COMPILE (default model), with the overrides TABLE_SET
table_small() {
  step gpu0 "$1" "$2" python3 -m benchmarks.throughput --models small --residuals vanilla attnres attnres_block mhc \
    msar_block msar attnres_mhc_sum --ablations wo_conv attnres_conv --compile ${COMPILE:-model} --graphs on --steps 8 \
    ${TABLE_SET:+--set $TABLE_SET} --tag "$3"
}
table_medium() {
  step gpu0 "$1" "$2" python3 -m benchmarks.throughput --models medium --residuals \
    ${MEDIUM_RESIDUALS:-vanilla attnres_block mhc msar_block} --compile ${COMPILE:-model} --graphs on --steps 6 \
    ${TABLE_SET:+--set $TABLE_SET} --tag "$3"
}
# the MSAR plans' shared steps: the op's GPU tests, msar_block's step beside vanilla (small, medium), its 60-step
# training parity against the reference backends, Nsight Compute's counters of one op's kernels
# the depth-attention plans' shared steps: the op's GPU tests; attnres_block's small step with ROW beside the default
# and vanilla in one process, the default re-timed last (attnres_small LIMIT ROW TAG)
attnres_tests() { step gpu0 gpu_tests "$1" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
  tests/kernels/test_depth_attn_fused.py tests/residuals/test_attnres.py; }
attnres_small() { step gpu0 small "$1" python3 -m benchmarks.throughput --models small --residuals vanilla attnres_block \
  "attnres_block@$2" attnres_block --compile model --graphs on --steps 8 --set $COMBO --tag "$3"; }
medium_calls() {  # LIMIT TAG CANDIDATES...: the phase-1 kernels alone at each call of attnres_block's medium step
  local limit=$1 tag=$2; shift 2
  step gpu0 split_tiles "$limit" python3 -m benchmarks.depth_attn_tiles --shapes medium --dtypes bf16 \
    --ops ${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n6 block_n8 block_final9} --phase1 "$@" --tag "$tag"
}
medium_step() {  # LIMIT TAG ROWS...: the medium step of vanilla and ROWS in one process
  local limit=$1 tag=$2; shift 2
  step gpu0 medium "$limit" python3 -m benchmarks.throughput --models medium --residuals vanilla "$@" --compile model \
    --graphs on --steps 6 --set $COMBO --tag "$tag"
}
stream_rule_times() {  # TILES SMALL MEDIUM (limits; 0 skips): the forward streamed from 9 sources (the rule) against the
  # chunks of before (FWD_STREAM=0): full AttnRes and the final call alone at small and medium, full AttnRes's steps
  local chunks="py:kernels.depth_attn.fused.FWD_STREAM=0"
  step gpu0 tiles "$1" python3 -m benchmarks.depth_attn_tiles --shapes small medium --dtypes bf16 \
    --ops full block_final9 --phase1 default fwd-chunks default --tag "${TAG:-_stream_rule}"
  step gpu0 small "$2" python3 -m benchmarks.throughput --models small --residuals vanilla attnres "attnres@$chunks" \
    attnres --compile model --graphs on --steps 8 --set $COMBO --tag "${TAG:-_stream_rule}"
  step gpu0 medium "$3" python3 -m benchmarks.throughput --models medium --residuals vanilla attnres \
    "attnres@$chunks" --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_stream_rule}"
}
# the MSAR op's GPU tests (msar_tests LIMIT [PYTEST_K]): the whole file, or the tests -k selects
msar_tests() { step gpu0 gpu_tests "$1" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
  tests/kernels/test_msar_attn.py ${2:+-k "$2"}; }
msar_step() {  # MODEL TAG LIMIT STEPS
  step gpu0 "$1" "$3" python3 -m benchmarks.throughput --models "$1" --residuals ${SERIAL_RESIDUALS:-vanilla msar_block} \
    --compile model --graphs on --steps "$4" --set $COMBO --tag ${TAG:-$2}
}
# 60 training steps, seeds 0 1 (msar_parity NAME LIMIT [ARGS...]: ARGS go to backend_training, e.g. its two arms)
msar_parity() { step gpu0 parity "$2" python3 -m benchmarks.backend_training --residuals ${PARITY_RESIDUALS:-msar_block} \
  "${@:3}" --steps 60 --seeds 0 1 --set model=small trainer=gpu ${PARITY_SET:-trainer.compile=false} \
  --name ${PARITY_NAME:-$1}; }
counters_of() { step gpu0 "ncu_$1" "$2" ncu --clock-control none --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
  -c "${COUNTER_LAUNCHES:-8}" -k 'regex:^_[a-z_0-9]+_kernel$' python3 -m benchmarks.kernel_counters --ops "$1"; }

case "$PLAN" in
  check)
    # GPU_TESTS, MSAR_SHAPES, TILE_SHAPES, TRAIN_RESIDUALS narrow or widen a step (defaults below)
    (
      export CUDA_VISIBLE_DEVICES=0
      step gpu0 gpu_tests 280 python3 -m pytest -q -rf --tb=line -p no:cacheprovider -m gpu \
        ${GPU_TESTS:-tests/kernels tests/residuals tests/platform/test_gpu.py}
      step gpu0 msar_attn 100 python3 -m benchmarks.msar_attn --shapes ${MSAR_SHAPES:-small} --sources 5 --no-compile
      step gpu0 backend_training 150 python3 -m benchmarks.backend_training \
        --residuals ${TRAIN_RESIDUALS:-msar_block mhc attnres_block} --steps 60
    ) &
    (
      export CUDA_VISIBLE_DEVICES=1
      throughput gpu1 130
      step gpu1 msar_tiles 390 python3 -m benchmarks.msar_tiles --shapes ${TILE_SHAPES:-small}
    ) &
    wait
    ;;
  study)
    step all study "${STUDY_LIMIT:-500}" "${STUDY[@]}" compare.workers="${STUDY_WORKERS:-8}" \
      ${STUDY_STEPS:+trainer.max_steps=$STUDY_STEPS} ${STUDY_ARGS:-} &
    (
      step tests gpu_tests 340 python3 -m pytest -q -rf --tb=line -p no:cacheprovider -m gpu tests/kernels \
        tests/residuals tests/platform/test_gpu.py
      step tests backend_training 190 python3 -m benchmarks.backend_training --residuals attnres_block msar_block \
        mhc --steps 60
    ) &
    wait
    ;;
  finish)
    # What the 2026-11-30 study left, in a fresh store (the local one is not carried): attnres_conv seeds
    # 1 and 2 on GPU 0, the scaling points of Block AttnRes and Block MSAR on both GPUs. Back home:
    # `python -m platform.store merge <returned mlruns/mlflow.db>`, then the report and the fit with
    # compare.train=false / scaling.train=false (docs/study.md, section 4).
    step gpu0 study_rest "${STUDY_LIMIT:-500}" env CUDA_VISIBLE_DEVICES=0 "${STUDY[@]}" compare.runs=[attnres_conv] \
      compare.seeds=[1,2] compare.add_baselines=false compare.references=[] compare.target=null compare.report=null \
      compare.log_comparison=false compare.workers=2 &
    step all scaling_rest "${SCALING_LIMIT:-500}" "${SCALING[@]}" scaling.variants=[attnres_block,msar_block] \
      scaling.fit=false scaling.workers=4 &
    wait
    ;;
  measure)
    (export CUDA_VISIBLE_DEVICES=0; step gpu0 msar_attn 100 python3 -m benchmarks.msar_attn --shapes ${MSAR_SHAPES:-small} \
      --sources 5 --no-compile) &
    (export CUDA_VISIBLE_DEVICES=1; throughput gpu1 "${THROUGHPUT_LIMIT:-200}") &
    wait
    ;;
  graphs)
    # GPU0_FIRST / GPU1_FIRST: a command line run first in that lane (GPU0_FIRST_LIMIT / GPU1_FIRST_LIMIT
    # seconds, default 120), e.g. an op's GPU tests; GRAPH_TESTS=none skips the graph tests
    (
      export CUDA_VISIBLE_DEVICES=0
      [ -n "${GPU0_FIRST:-}" ] && step gpu0 first "${GPU0_FIRST_LIMIT:-120}" bash -c "$GPU0_FIRST"
      if [ -n "${PROFILE_RESIDUALS:-}" ]; then  # the kernels of a graphed step, per residual
        step gpu0 profile "${PROFILE_LIMIT:-150}" python3 -m benchmarks.profile_step --model small \
          --residuals $PROFILE_RESIDUALS --graphs on
      fi
      [ "${GRAPH_TESTS:-}" != none ] && step gpu0 graph_tests "${GRAPH_TEST_LIMIT:-200}" python3 -m pytest -q -rf \
        --tb=short -p no:cacheprovider -m gpu ${GRAPH_TESTS:-tests/platform/test_graphs.py}
      step gpu0 throughput_small "${SMALL_LIMIT:-300}" python3 -m benchmarks.throughput --models small \
        --residuals ${GRAPH_RESIDUALS:-vanilla attnres_block mhc msar_block msar} ${GRAPH_ABLATIONS:+--ablations $GRAPH_ABLATIONS} \
        --compile on --graphs ${SMALL_GRAPHS:-off on} --steps 8 --tag _graphs
    ) &
    (export CUDA_VISIBLE_DEVICES=1
     [ -n "${GPU1_FIRST:-}" ] && step gpu1 first "${GPU1_FIRST_LIMIT:-120}" bash -c "$GPU1_FIRST"
     step gpu1 throughput_medium "${MEDIUM_LIMIT:-500}" python3 -m benchmarks.throughput \
      --models medium --residuals ${MEDIUM_RESIDUALS:-vanilla attnres_block mhc msar_block} --compile on \
      --graphs ${MEDIUM_GRAPHS:-on off} --steps 6 --tag _graphs) &
    wait
    if [ -n "${DDP_RESIDUALS:-}" ]; then  # both GPUs, after the lanes: the 2-GPU scaling with graphs
      step all ddp "${DDP_LIMIT:-100}" python3 -m benchmarks.throughput --models small --residuals $DDP_RESIDUALS \
        --compile on --graphs on --ddp 2 --steps 8 --tag _graphs
    fi
    ;;
  kernels)
    # one GPU, in order: the fused kernels' GPU tests, the fused mHC variants side by side, the block
    # sweep of the kernels in SWEEP_KERNELS, the graphed small table (KERNEL_RESIDUALS)
    step gpu0 kernel_tests "${TEST_LIMIT:-150}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      ${KERNEL_TESTS:-tests/kernels/test_mhc_fused.py tests/kernels/test_msar_attn.py}
    step gpu0 ops_mhc "${OPS_LIMIT:-100}" python3 -m benchmarks.ops_mhc --shapes small medium --fused-only
    [ -n "${SWEEP_KERNELS:-}" ] && step gpu0 mhc_blocks "${SWEEP_LIMIT:-100}" python3 -m benchmarks.ops_mhc --sweep-blocks \
      --shapes small --kernels $SWEEP_KERNELS
    step gpu0 throughput_small "${SMALL_LIMIT:-80}" python3 -m benchmarks.throughput --models small \
      --residuals ${KERNEL_RESIDUALS:-vanilla mhc msar_block} --compile on --graphs on --steps 8 --tag _kernels
    ;;
  final)
    # the tables of a session's end, graphed: GPU 0 the GPU tests (FINAL_TESTS), the mHC block sweep and a
    # profile of PROFILE_RESIDUALS; GPU 1 every residual and ablation at small, vanilla at medium under
    # each recompute choice, the medium table (MEDIUM_RESIDUALS); then the 2-GPU scaling of vanilla
    (
      export CUDA_VISIBLE_DEVICES=0
      step gpu0 gpu_tests "${TEST_LIMIT:-200}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
        ${FINAL_TESTS:-tests/kernels/test_mhc_fused.py tests/residuals}
      step gpu0 mhc_blocks 90 python3 -m benchmarks.ops_mhc --sweep-blocks --shapes small --kernels pre_fwd pre_dx
      step gpu0 profile 100 python3 -m benchmarks.profile_step --model small --graphs on \
        --residuals ${PROFILE_RESIDUALS:-mhc attnres_block} --ablations attnres_conv
    ) &
    (
      export CUDA_VISIBLE_DEVICES=1
      step gpu1 throughput_small 150 python3 -m benchmarks.throughput --models small --residuals vanilla attnres \
        attnres_block mhc msar_block msar attnres_mhc_sum --ablations wo_conv attnres_conv --compile on --graphs on \
        --steps 8 --tag _final
      step gpu1 recompute_medium 120 python3 -m benchmarks.throughput --models medium --residuals vanilla \
        --recompute none attention mlp --compile on --graphs on --steps 6 --tag _recompute
      step gpu1 throughput_medium 200 python3 -m benchmarks.throughput --models medium \
        --residuals ${MEDIUM_RESIDUALS:-vanilla attnres_block mhc msar_block} --ablations attnres_conv --compile on \
        --graphs on --steps 6 --tag _final
    ) &
    wait
    step all ddp "${DDP_LIMIT:-90}" python3 -m benchmarks.throughput --models small --residuals vanilla --compile on \
      --graphs on --ddp 2 --steps 8 --tag _final
    ;;
  closing)
    # the closing tables with the final defaults: GPU 0 the mHC GPU tests, then every residual and ablation
    # at small; GPU 1 the medium table (its preset's recompute)
    (
      export CUDA_VISIBLE_DEVICES=0
      step gpu0 gpu_tests "${CLOSING_TEST_LIMIT:-100}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
        ${CLOSING_TESTS:-tests/kernels/test_mhc_fused.py}
      step gpu0 throughput_small 250 python3 -m benchmarks.throughput --models small --residuals vanilla attnres \
        attnres_block mhc msar_block msar attnres_mhc_sum --ablations wo_conv attnres_conv --compile on --graphs on \
        --steps 8 --tag ${TAG:-_closing}
    ) &
    (
      export CUDA_VISIBLE_DEVICES=1
      step gpu1 throughput_medium 330 python3 -m benchmarks.throughput --models medium --residuals vanilla \
        attnres_block mhc msar_block --ablations attnres_conv --compile on --graphs on --steps 6 --tag ${TAG:-_closing}
      [ -n "${CLOSING_ONLY:-}" ] && step gpu1 tiles 100 python3 -m benchmarks.msar_tiles --shapes small \
        medium --sources 5 --kernels "source gradients" --only ${CLOSING_ONLY} --tag ${TAG:-_closing}
    ) &
    wait
    [ -n "${CLOSING_DDP:-}" ] && step all ddp 100 python3 -m benchmarks.throughput --models small --residuals vanilla \
      --compile on --graphs on --ddp 2 --steps 8 --tag ${TAG:-_closing}
    ;;
  seeds)
    step gpu0 seeds "${SEED_LIMIT:-500}" env CUDA_VISIBLE_DEVICES=0 "${STUDY[@]}" \
      compare.runs="[${SEED_RUNS:-attnres_conv,msar_block}]" compare.seeds="[${SEEDS:-3,4,5,6}]" \
      compare.add_baselines=false compare.references=[] compare.target=null compare.report=null \
      compare.log_comparison=false compare.workers="${SEED_WORKERS:-4}" &
    (
      export CUDA_VISIBLE_DEVICES=1
      step gpu1 gpu_tests 260 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
        tests/platform/test_graphs.py tests/platform/test_gpu.py tests/platform/test_attention.py
      step gpu1 throughput_small 170 python3 -m benchmarks.throughput --models small \
        --residuals vanilla attnres_block --compile sublayers on --graphs on --steps 8 --tag _loss
      step gpu1 throughput_medium 120 python3 -m benchmarks.throughput --models medium --residuals vanilla \
        --compile sublayers on --graphs on --steps 6 --tag _loss
      step gpu1 profile 60 python3 -m benchmarks.profile_step --model small --residuals vanilla --graphs on --top 30
    ) &
    wait
    ;;
  sync)
    (
      export CUDA_VISIBLE_DEVICES=0
      [ -n "${SYNC_TILES:-}" ] && step gpu0 tiles "${TILES_LIMIT:-150}" python3 -m benchmarks.msar_tiles --shapes small \
        --sources 5 --kernels "source gradients" --only ${SYNC_TILES} --tag ${TAG:-_sync}
      [ -n "${SYNC_OPS:-}" ] && step gpu0 ops_attnres "${OPS_LIMIT:-150}" python3 -m benchmarks.ops_attnres ${SYNC_OPS}
    ) &
    (
      export CUDA_VISIBLE_DEVICES=1
      [ "${SYNC_TESTS:-}" != none ] && step gpu1 gpu_tests "${SYNC_TEST_LIMIT:-150}" python3 -m pytest -q -rf --tb=short \
        -p no:cacheprovider -m gpu ${SYNC_TESTS:-tests/kernels/test_msar_attn.py}
      [ "${PROFILE_RESIDUALS:-vanilla}" != none ] && step gpu1 profile "${PROFILE_LIMIT:-80}" python3 -m \
        benchmarks.profile_step --model small --residuals ${PROFILE_RESIDUALS:-vanilla} --graphs on --top ${PROFILE_TOP:-30}
    ) &
    wait
    [ "${SYNC_DDP:-1}" != 0 ] && step all ddp "${DDP_LIMIT:-260}" python3 -m benchmarks.throughput --models small \
      --residuals vanilla --compile on --graphs on --ddp 2 --ddp-sync ${DDP_SYNCS:-ddp flat} --ddp-comm fp32 bf16 --steps 8 \
      --tag ${TAG:-_sync}
    [ "${RUN_FLAT:-1}" != 0 ] && step all run_flat "${RUN_LIMIT:-150}" python3 -m platform.run trainer=gpu \
      trainer.devices=2 trainer.max_steps=30 mlflow.depth_heatmaps=false ${RUN_ARGS:-trainer.grad_sync=flat}
    ;;
  mfu)
    step gpu0 throughput "${MFU_LIMIT:-170}" python3 -m benchmarks.throughput --models small \
      --residuals ${MFU_RESIDUALS:-vanilla} --compile ${MFU_COMPILE:-on model} --graphs on --steps 8 --tag ${TAG:-_mfu}
    [ "${PROFILE_COMPILE:-model}" != none ] && step gpu0 profile "${PROFILE_LIMIT:-100}" python3 -m \
      benchmarks.profile_step --model small --residuals vanilla --compile ${PROFILE_COMPILE:-model} --graphs on \
      --top ${PROFILE_TOP:-40} --tag ${TAG:-_mfu}
    [ "${FLEX_SHAPES:-small}" != none ] && step gpu0 flex "${FLEX_LIMIT:-260}" python3 -m benchmarks.flex_tiles \
      --shapes ${FLEX_SHAPES:-small} --budget ${FLEX_BUDGET:-200}
    ;;
  closing1)
    # the closing tables on one GPU with the final defaults: the GPU tests of the training path (CLOSING_TESTS),
    # every residual and ablation at small, then the medium table; compiled per COMPILE (default model).
    # On a cold host (empty compile caches, 2026-12-05 evening, an H100) one call does not hold it: the tests passed 8 in
    # 110 s, the small table timed 5 rows in 230 s (about 45 s a row), medium 2 rows in 200 s. There, three calls:
    # SMALL_LIMIT=520 with the other limits 0; MEDIUM_LIMIT=450 alone; CLOSING_TEST_LIMIT=300 alone
    step gpu0 gpu_tests "${CLOSING_TEST_LIMIT:-110}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      ${CLOSING_TESTS:-tests/platform}
    table_small throughput_small "${SMALL_LIMIT:-230}" ${TAG:-_closing}
    table_medium throughput_medium "${MEDIUM_LIMIT:-200}" ${TAG:-_closing}
    ;;
  merge)
    step gpu0 merge "${MERGE_LIMIT:-300}" python3 -m benchmarks.throughput --models ${MERGE_MODELS:-small medium} \
      --residuals attnres attnres_block --compile model --graphs on --steps 8 --set --set residual.merge_backend=torch \
      --tag ${TAG:-_merge}
    ;;
  sources)
    step gpu0 sources "${SOURCES_LIMIT:-330}" python3 -m benchmarks.throughput --models ${SOURCES_MODELS:-small medium} \
      --residuals attnres attnres_block --compile model --graphs on --steps 8 --set \
      --set residual.source_dtype=bfloat16 --tag ${TAG:-_sources}
    step gpu0 parity "${PARITY_LIMIT:-200}" python3 -m benchmarks.backend_training --residuals attnres_block --steps 60 \
      --seeds 0 1 --set model=small trainer=gpu residual.source_dtype=bfloat16 --name small_bf16_sources
    ;;
  glue)
    [ "${GLUE_TESTS:-x}" != none ] && step gpu0 gpu_tests "${GLUE_TEST_LIMIT:-100}" python3 -m pytest -q -rf --tb=short \
      -p no:cacheprovider -m gpu ${GLUE_TESTS:-tests/kernels/test_depth_attn_fused.py tests/residuals/test_attnres.py}
    step gpu0 small "${GLUE_SMALL_LIMIT:-150}" python3 -m benchmarks.throughput --models small \
      --residuals ${GLUE_RESIDUALS:-vanilla attnres attnres_block} --compile model --graphs on --steps 8 \
      --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_glue}
    [ -n "${GLUE_OPTION:-}" ] && step gpu0 option "${GLUE_OPTION_LIMIT:-100}" python3 -m benchmarks.throughput --models \
      small --residuals vanilla --compile model --graphs on --steps 8 --set +trainer.compile_options.combo_kernels=true \
      --set +trainer.compile_options.combo_kernels=true +trainer.compile_options.$GLUE_OPTION --tag ${TAG:-_glue}_option
    [ "${PROFILE_RESIDUALS:-attnres_block}" != none ] && step gpu0 profile "${PROFILE_LIMIT:-100}" python3 -m \
      benchmarks.profile_step --model small --residuals ${PROFILE_RESIDUALS:-attnres_block} --compile model \
      --graphs on --top ${PROFILE_TOP:-60} --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_glue}
    [ "${GLUE_PARITY:-0}" = 1 ] && step gpu0 parity "${PARITY_LIMIT:-300}" python3 -m benchmarks.backend_training \
      --residuals ${PARITY_RESIDUALS:-attnres_block attnres} --steps 60 --seeds 0 1 --set model=small trainer=gpu \
      --name small${TAG:-_glue}
    ;;
  attnref)
    step gpu0 parity "${PARITY_LIMIT:-240}" python3 -m benchmarks.backend_training --residuals attnres --steps 60 \
      --seeds 0 1 --set model=small trainer=gpu trainer.compile_scope=sublayers --name small_attnres_sublayers
    step gpu0 ref_loop_order "${REF_LIMIT:-200}" python3 -m platform.run trainer=gpu model=small residual=attnres \
      residual.backend=torch trainer.max_steps=3 mlflow.depth_heatmaps=false \
      +trainer.compile_options.loop_ordering_after_fusion=false
    step gpu0 ops_attnres "${OPS_LIMIT:-100}" python3 -m benchmarks.ops_attnres \
      --quick --shapes small --impls fused reference
    ;;
  router)
    if [ "${ROUTER_ORDER:-}" = reverse ]; then
      sets=(--set model.moe_topk=argmax --set model.moe_topk=topk --set model.moe_topk=argmax)
    else
      sets=(--set --set model.moe_topk=argmax)
    fi
    step gpu0 small "${ROUTER_LIMIT:-200}" python3 -m benchmarks.throughput --models small \
      --residuals ${ROUTER_RESIDUALS:-vanilla attnres_block} --compile model --graphs on --steps 8 \
      "${sets[@]}" --tag ${TAG:-_router}
    [ "${ROUTER_PROFILE_SET:-x}" != none ] && step gpu0 profile "${PROFILE_LIMIT:-100}" python3 -m \
      benchmarks.profile_step --model small --residuals vanilla --compile model --graphs on --top ${PROFILE_TOP:-50} \
      --set ${ROUTER_PROFILE_SET:-model.moe_topk=argmax} --tag ${TAG:-_router}
    ;;
  combo)
    step gpu0 gpu_tests "${COMBO_TEST_LIMIT:-150}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      ${COMBO_TESTS:-tests/platform/test_gpu.py -k compiled_whole}
    step gpu0 small "${COMBO_SMALL_LIMIT:-240}" python3 -m benchmarks.throughput --models small --residuals \
      ${COMBO_RESIDUALS:-vanilla attnres_block mhc msar_block} --compile model --graphs on --steps 8 --set \
      --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_combo}
    ;;
  options)
    step gpu0 options "${OPTIONS_LIMIT:-260}" python3 -m benchmarks.throughput --models small \
      --residuals ${OPTIONS_RESIDUALS:-vanilla attnres_block mhc} --compile model --graphs on --steps 8 \
      --set --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_options}
    step gpu0 merge "${MERGE_LIMIT:-180}" python3 -m benchmarks.throughput --models ${MERGE_MODELS:-small} \
      --residuals attnres attnres_block --compile model --graphs on --steps 8 --set --set residual.merge_backend=torch \
      --tag ${TAG:-_merge}
    [ "${PROFILE_RESIDUALS:-attnres_block}" != none ] && step gpu0 profile "${PROFILE_LIMIT:-100}" python3 -m \
      benchmarks.profile_step --model small --residuals ${PROFILE_RESIDUALS:-attnres_block} --compile model \
      --graphs on --top ${PROFILE_TOP:-40} --tag ${TAG:-_options}
    ;;
  verify)
    step gpu0 parity "${PARITY_LIMIT:-220}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --steps 60 --seeds 0 1 --set model=small trainer=gpu --name small${TAG:-_verify}
    step gpu0 msar_views "${VIEWS_LIMIT:-150}" python3 -m benchmarks.msar_tiles --shapes small --only views_3d=True \
      views_3d=True,bt=1,warps=1 views_3d=True,bt=1,warps=2 views_3d=True,bt=2,warps=2
    step gpu0 dtiles "${DTILES_LIMIT:-110}" python3 -m benchmarks.depth_attn_tiles --shapes small --dtypes fp32
    ;;
  evening)
    step gpu0 parity "${PARITY_LIMIT:-290}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --steps 60 --seeds 0 1 --set model=small trainer=gpu --name small${TAG:-_evening}
    step gpu0 bf16 "${BF16_LIMIT:-150}" python3 -m benchmarks.throughput --models small --residuals attnres attnres_block \
      --compile model --graphs on --steps 8 --set +trainer.compile_options.combo_kernels=true \
      --set +trainer.compile_options.combo_kernels=true residual.source_dtype=bfloat16 --tag ${TAG:-_bf16_sources}
    step gpu0 msar_views "${VIEWS_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes medium --only views_3d=True
    ;;
  evening2)
    step gpu0 msar_one_warp "${ONE_WARP_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes small \
      --kernels stats "source gradients" --only stats_bt=1,stats_bd=128,stats_warps=1 \
      stats_bt=1,stats_bd=256,stats_warps=1 stats_bt=2,stats_bd=128,stats_warps=1 \
      views_3d=True,stats_bt=1,stats_bd=128,stats_warps=1 src_warps=1 src_warps=1,src_bd=16 --tag _one_warp
    step gpu0 small "${SMALL_LIMIT:-270}" python3 -m benchmarks.throughput --models small \
      --residuals ${SMALL_RESIDUALS:-vanilla attnres attnres_block mhc msar_block} --compile model --graphs on \
      --steps 8 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_evening}
    step gpu0 medium "${MEDIUM_LIMIT:-200}" python3 -m benchmarks.throughput --models medium \
      --residuals ${MEDIUM_RESIDUALS:-vanilla attnres_block} --compile model --graphs on \
      --steps 8 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_evening}
    ;;
  evening3)
    step gpu0 msar_stats "${STATS_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes medium --kernels stats \
      --only stats_bt=2,stats_bd=512,stats_warps=4 stats_bt=4,stats_bd=512,stats_warps=4 --tag _stats_medium
    step gpu0 gpu_tests "${TEST_LIMIT:-110}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_msar_attn.py
    step gpu0 small "${SMALL_LIMIT:-150}" python3 -m benchmarks.throughput --models small \
      --residuals ${SMALL_RESIDUALS:-vanilla msar_block} --compile model --graphs on \
      --steps 8 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_stats}
    ;;
  buffered)
    step gpu0 gpu_tests "${TEST_LIMIT:-200}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_msar_attn.py tests/platform/test_gpu.py -k "msar"
    step gpu0 small "${SMALL_LIMIT:-220}" python3 -m benchmarks.throughput --models small \
      --residuals ${SMALL_RESIDUALS:-vanilla msar_block msar} --compile model --graphs on \
      --steps 8 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_buffered}
    ;;
  fixed)
    step gpu0 tiles "${TILES_LIMIT:-70}" python3 -m benchmarks.msar_tiles --shapes small --kernels forward stats \
      "source gradients" --only views_3d=True --tag _fixed
    step gpu0 buffered "${BUFFERED_LIMIT:-90}" python3 -m benchmarks.msar_buffered --shapes small --sources 5 9
    step gpu0 small "${SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small \
      --residuals ${SMALL_RESIDUALS:-vanilla msar_block msar} --compile model --graphs on \
      --steps 8 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_fixed}
    step gpu0 gpu_tests "${TEST_LIMIT:-130}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      --durations=5 tests/kernels/test_msar_attn.py
    ;;
  parity)
    step gpu0 parity "${PARITY_LIMIT:-400}" python3 -m benchmarks.backend_training --residuals ${PARITY_RESIDUALS:-msar_block} \
      --steps 60 --seeds 0 1 --set model=small trainer=gpu ${PARITY_SET:-} --name ${PARITY_NAME:-small_buffered}
    step gpu0 gpu_tests "${TEST_LIMIT:-120}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      --durations=5 tests/platform/test_gpu.py -k "${PARITY_TESTS:-msar}"
    ;;
  eager)
    step gpu0 gpu_tests "${TEST_LIMIT:-300}" env TORCH_LOGS=recompiles python3 -m pytest -q -rf --tb=short \
      -p no:cacheprovider -m gpu --durations=5 tests/platform/test_gpu.py -k "compiled_whole and (${EAGER_TESTS:-attnres_block or msar_block})"
    step gpu0 small "${SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small \
      --residuals ${EAGER_RESIDUALS:-vanilla attnres_block msar_block} --compile model --graphs on \
      --steps 8 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_eager}
    ;;
  memory)
    step gpu0 medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium \
      --residuals ${MEMORY_RESIDUALS:-vanilla attnres_block msar_block} --compile model --graphs on \
      --steps 6 --set +trainer.compile_options.combo_kernels=true --tag ${TAG:-_memory}
    step gpu0 parity "${PARITY_LIMIT:-260}" python3 -m benchmarks.backend_training \
      --residuals ${PARITY_RESIDUALS:-msar_block attnres_block} --steps 60 --seeds 0 1 \
      --set model=small trainer=gpu ${PARITY_SET:-trainer.compile=false} --name ${PARITY_NAME:-small_memory}
    ;;
  serial)
    step gpu0 tiles_small "${TILES_LIMIT:-150}" python3 -m benchmarks.msar_tiles --shapes small --sources 5 \
      --kernels stats "source gradients" --only 'src_mode="ring"' 'stats_mode="tile"' 'src_mode="ring",stats_mode="tile"' serial_ch=64 serial_ch=256 \
      serial_bd=64,serial_warps=2 serial_bd=256,serial_warps=4 serial_prefetch=False \
      'stats_mode="serial",stats_serial_bd=64,stats_serial_ch=128' 'stats_mode="serial",stats_serial_bd=32,stats_serial_ch=256' \
      --tag _serial
    step gpu0 tiles_medium "${TILES_MEDIUM_LIMIT:-80}" python3 -m benchmarks.msar_tiles --shapes medium --sources 9 \
      --kernels stats "source gradients" --only 'src_mode="ring"' 'stats_mode="tile"' 'src_mode="ring",stats_mode="tile"' \
      serial_ch=256 --tag _serial_medium
    msar_tests "${TEST_LIMIT:-90}"
    msar_step small _serial "${SMALL_LIMIT:-160}" 8
    msar_parity small_serial "${PARITY_LIMIT:-150}"
    ;;
  serial2)
    msar_step medium _serial_medium "${MEDIUM_LIMIT:-240}" 6
    step gpu0 tiles "${TILES_LIMIT:-120}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels "source gradients" --only serial_bd=256,serial_warps=4 serial_fast=True 'src_mode="ring"' --tag _serial_bd
    counters_of msar "${COUNTER_LIMIT:-150}"
    ;;
  saved)
    step gpu0 tiles "${TILES_LIMIT:-100}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward stats "source gradients" --only stats_saved=False stats_prefetch=True \
      stats_prefetch=True,stats_serial_bd=64 serial_bd=128,serial_warps=4 --tag _saved
    msar_tests "${TEST_LIMIT:-90}"
    msar_step small _saved "${SMALL_LIMIT:-160}" 8
    msar_parity small_saved "${PARITY_LIMIT:-150}"
    ;;
  split)
    step gpu0 tiles "${TILES_LIMIT:-150}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward --only 'fwd_mode="split"' 'fwd_mode="split",split_bd=64,split_warps=1' \
      'fwd_mode="split",split_bd=128,split_warps=2' 'fwd_mode="split",split_bd=256,split_warps=2' \
      'fwd_mode="split",split_bd=256,split_warps=4' 'fwd_mode="split",split_logit_bd=32' \
      'fwd_mode="split",split_logit_bd=128' 'fwd_mode="split",split_ch=32' 'fwd_mode="split",split_ch=128' \
      'fwd_mode="split",split_ch=256' --tag _split
    step gpu0 tiles17 "${TILES17_LIMIT:-60}" python3 -m benchmarks.msar_tiles --shapes medium --sources 17 \
      --kernels forward --only 'fwd_mode="split"' --tag _split_s17
    ;;
  split2)
    msar_tests "${TEST_LIMIT:-80}"
    msar_step small _split "${SMALL_LIMIT:-150}" 8
    msar_parity small_split "${PARITY_LIMIT:-150}"
    msar_step medium _split_medium "${MEDIUM_LIMIT:-190}" 6
    ;;
  split3)
    counters_of msar "${COUNTER_LIMIT:-40}"
    SERIAL_RESIDUALS=${SERIAL_RESIDUALS:-vanilla msar} msar_step small _split_msar "${SMALL_LIMIT:-120}" 8
    ;;
  lean2)
    # the lean pass 2 and the forward's glue kernels as the defaults (timed on 2026-12-02 by the `lean` plan, since
    # replaced by this one: msar_tiles_nvidia_h200_lean*.md): the forward as first timed, each change alone, and the
    # backward's glue kernel (on a grid over views; when this plan first ran, the candidate against PyTorch, since
    # the default) against PyTorch, in one process; the op's GPU tests; msar_block's and msar's `small` steps beside
    # vanilla; msar_block's 60-step training parity
    step gpu0 tiles "${TILES_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward stats --only 'fwd_mode="split",split_lean=False,glue="torch"' \
      'fwd_mode="split",split_lean=False' 'fwd_mode="split",glue="torch"' 'stats_glue="torch"' --tag _lean2
    msar_tests "${TEST_LIMIT:-90}"
    SERIAL_RESIDUALS=${SERIAL_RESIDUALS:-vanilla msar_block msar} msar_step small _lean2 "${SMALL_LIMIT:-200}" 8
    msar_parity small_lean2 "${PARITY_LIMIT:-150}"
    ;;
  lean3)
    # with the lean pass 2 and every glue kernel the defaults (msar_tiles_nvidia_h200_lean2.md): msar_block's `medium`
    # step beside vanilla, the `small` table of every study residual and ablation (combo kernels, as msar_step), and
    # Nsight Compute's counters of MSAR's kernels
    SERIAL_RESIDUALS=${SERIAL_RESIDUALS:-vanilla msar_block} msar_step medium _lean3_medium "${MEDIUM_LIMIT:-190}" 6
    TABLE_SET=${TABLE_SET:-$COMBO} table_small small_all "${SMALL_LIMIT:-270}" ${TAG:-_lean3}
    counters_of msar "${COUNTER_LIMIT:-50}"
    ;;
  medium_all)
    # the `medium` table of MEDIUM_RESIDUALS beside vanilla in one process (combo kernels, as msar_step)
    MEDIUM_RESIDUALS=${MEDIUM_RESIDUALS:-vanilla attnres_block mhc msar} TABLE_SET=${TABLE_SET:-$COMBO} \
      table_medium medium_all "${MEDIUM_LIMIT:-330}" ${TAG:-_medium_all}
    ;;
  streams)
    # msar_block's read keeping no streams R for backward (residual.recompute_streams, built on the CPU on 2026-12-02
    # evening): step and peak against keeping them, both in one process, at `medium` then `small`
    for model in medium small; do
      step gpu0 "streams_$model" "${STREAMS_LIMIT:-250}" python3 -m benchmarks.throughput --models $model \
        --residuals ${STREAMS_RESIDUALS:-msar_block} --compile model --graphs on --steps 6 \
        --set $COMBO --set $COMBO residual.recompute_streams=true --tag ${TAG:-_streams}
    done
    ;;
  mhc)
    # the variants' parity against the fp32 reference comes first in each ops_mhc row; a failing one exits non-zero
    step gpu0 ops_bf16 "${OPS_LIMIT:-250}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants ${MHC_VARIANTS:-before default dx_tf32} \
      --tag _variants
    step gpu0 ops_fp32 "${OPS32_LIMIT:-70}" python3 -m benchmarks.ops_mhc --fused-only --dtype fp32 --shapes small \
      --variants ${MHC32_VARIANTS:-before default} --tag _variants
    mhc_tests "${TEST_LIMIT:-60}"
    step gpu0 small "${SMALL_LIMIT:-150}" python3 -m benchmarks.throughput --models small --residuals \
      ${MHC_ROWS:-vanilla mhc mhc@residual.stream_dtype=input} --compile model --graphs on --steps 8 --set $COMBO \
      --tag ${TAG:-_mhc}
    ;;
  mhc2)
    step gpu0 ops_bf16 "${OPS_LIMIT:-60}" python3 -m benchmarks.ops_mhc --fused-only --shapes medium small \
      --variants before default before default --tag _defaults
    step gpu0 ops_fp32 "${OPS32_LIMIT:-45}" python3 -m benchmarks.ops_mhc --fused-only --dtype fp32 --shapes medium \
      small --variants before default --tag _defaults
    mhc_tests "${TEST_LIMIT:-100}"
    for model in medium small; do
      step gpu0 "$model" "$([ $model = medium ] && echo "${MEDIUM_LIMIT:-220}" || echo "${SMALL_LIMIT:-110}")" \
        python3 -m benchmarks.throughput --models $model --residuals ${MHC_ROWS:-vanilla mhc mhc@residual.stream_dtype=input} \
        --compile model --graphs on --steps 6 --set $COMBO --tag ${TAG:-_mhc2}
    done
    ;;
  mhc3)
    step gpu0 small "${SMALL_LIMIT:-230}" python3 -m benchmarks.throughput --models small --residuals \
      ${MHC_ROWS:-vanilla mhc mhc@residual.stream_dtype=input} --compile model --graphs on --steps 6 --set $COMBO \
      --tag ${TAG:-_mhc3}
    COUNTER_LAUNCHES=${COUNTER_LAUNCHES:-10} counters_of mhc "${COUNTER_LIMIT:-90}"
    ;;
  chain)
    # Block AttnRes's partial summed inside the merge (BlockSummaries.sum_in_merge, built on 2026-12-02, last session)
    # against the separate add, in one process; the summing default timed before and after the other
    attnres_tests "${TEST_LIMIT:-120}"
    attnres_small "${SMALL_LIMIT:-360}" "$APART" "${TAG:-_chain}"
    ;;
  chain2)
    step gpu0 medium "${MEDIUM_LIMIT:-260}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block "attnres_block@$APART" --compile model --graphs on --steps 6 --set $COMBO --tag ${TAG:-_chain}
    step gpu0 parity "${PARITY_LIMIT:-280}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --steps 60 --seeds 0 1 --set model=small trainer=gpu ${PARITY_SET:-trainer.compile=false} --name ${PARITY_NAME:-small_chain}
    ;;
  chain3)
    # mHC's streams in bf16 against its default fp32 streams in training (the candidate held to the default's seed
    # spread); where a graphed attnres_block step's time goes now; mHC's kernels before and now at small, in rounds
    step gpu0 mhc_streams "${STREAMS_LIMIT:-300}" python3 -m benchmarks.backend_training --residuals mhc \
      --reference residual.stream_dtype=input --candidate residual.stream_dtype=bf16 --steps ${STREAM_STEPS:-300} \
      --seeds 0 1 2 --set model=small trainer=gpu trainer.compile=false --name small_mhc_bf16_streams
    step gpu0 profile "${PROFILE_LIMIT:-120}" python3 -m benchmarks.profile_step --model small --residuals vanilla \
      attnres_block --compile model --graphs on --top 40 --set $COMBO --tag _chain
    step gpu0 ops_rounds "${OPS_LIMIT:-100}" python3 -m benchmarks.ops_mhc --fused-only --shapes small \
      --variants before default --rounds 5 --tag _rounds
    ;;
  closing2)
    # every study residual and ablation at small in one process with the session's defaults, mhc's bf16 streams beside
    step gpu0 small_all "${SMALL_LIMIT:-340}" python3 -m benchmarks.throughput --models small --residuals vanilla attnres \
      attnres_block mhc mhc@residual.stream_dtype=input msar_block msar attnres_mhc_sum --ablations wo_conv attnres_conv \
      --compile model --graphs on --steps 8 --set $COMBO --tag ${TAG:-_closing2}
    ;;
  phase1)
    attnres_tests "${TEST_LIMIT:-150}"
    step gpu0 small "${SMALL_LIMIT:-260}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      attnres_block "attnres_block@$STREAM1" attnres "attnres@$PHASE1" attnres_block --compile model --graphs on \
      --steps 8 --set $COMBO --tag ${TAG:-_phase1}
    step gpu0 parity "${PARITY_LIMIT:-240}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --reference "$STREAM1" --candidate residual.backend=auto --steps ${PARITY_STEPS:-300} --seeds 0 1 2 \
      --set model=small trainer=gpu ${TRAIN_SET:-trainer.compile=false} --name small_attnres_block_bf16_phase1
    ;;
  pairs)
    msar_tests "${TEST_LIMIT:-120}"
    step gpu0 medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      msar_block "msar_block@$UNPAIRED" msar_block --compile model --graphs on --steps 6 --set $COMBO --tag ${TAG:-_pairs}
    ;;
  phase1p)
    step gpu0 profile "${PROFILE_LIMIT:-150}" python3 -m benchmarks.profile_step --model small --residuals attnres_block \
      "attnres_block@$STREAM1" --compile model --graphs on --top 40 --set $COMBO --tag _phase1
    ;;
  phase1m)
    step gpu0 parity "${PARITY_LIMIT:-300}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --reference "$STREAM1" --candidate residual.backend=auto --steps ${PARITY_STEPS:-300} --seeds 0 1 2 \
      --set model=small trainer=gpu trainer.compile=true --name small_attnres_block_bf16_phase1_compiled
    step gpu0 medium "${MEDIUM_LIMIT:-220}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block "attnres_block@$STREAM1" attnres_block --compile model --graphs on --steps 6 --set $COMBO \
      --tag ${TAG:-_phase1}
    ;;
  delta)
    attnres_tests "${TEST_LIMIT:-150}"
    attnres_small "${SMALL_LIMIT:-200}" "$NODELTA" "${TAG:-_delta}"
    step gpu0 parity "${PARITY_LIMIT:-170}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --reference "$NODELTA" --candidate residual.backend=auto --steps 60 --seeds 0 1 \
      --set model=small trainer=gpu trainer.compile=false --name small_attnres_block_delta
    ;;
  closing3)
    step gpu0 dtiles "${DTILES_LIMIT:-90}" python3 -m benchmarks.depth_attn_tiles --shapes small medium --ops block \
      --dtypes fp32 --default-only
    step gpu0 small_all "${SMALL_LIMIT:-290}" python3 -m benchmarks.throughput --models small --residuals vanilla attnres \
      attnres_block mhc msar_block msar attnres_mhc_sum --ablations wo_conv attnres_conv \
      --compile model --graphs on --steps 8 --set $COMBO --tag ${TAG:-_closing3}
    step gpu0 medium "${MEDIUM_LIMIT:-190}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block "attnres_block@$NODELTA" --compile model --graphs on --steps 6 --set $COMBO --tag _delta
    ;;
  launches)
    # the phase-1 backward alone with bf16 outputs (as training keeps them), then every kernel of a graphed small step
    # of vanilla and attnres_block, for what the residual adds beyond its depth-attention kernels
    step gpu0 dtiles "${DTILES_LIMIT:-90}" python3 -m benchmarks.depth_attn_tiles --shapes small medium --ops block \
      --dtypes fp32 --default-only
    step gpu0 profile "${PROFILE_LIMIT:-170}" python3 -m benchmarks.profile_step --model small --residuals vanilla \
      attnres_block --compile model --graphs on --top 400 --set $COMBO --tag ${TAG:-_launches}
    ;;
  folded)
    # the depth-attention GPU tests, the phase-1 backward of each call of the step with and without dO·o from the
    # outputs, then attnres_block's small and medium steps beside vanilla with the queries folded once a forward and
    # one-kernel stores (the default), and with its sources stored in bf16 (residual.source_dtype)
    attnres_tests "${TEST_LIMIT:-150}"
    step gpu0 dtiles "${DTILES_LIMIT:-80}" python3 -m benchmarks.depth_attn_tiles --shapes small medium --ops block_n2 \
      block_n3 block_n4 block_final --dtypes fp32 --default-only
    attnres_small "${SMALL_LIMIT:-200}" "residual.source_dtype=bfloat16" "${TAG:-_folded}"
    step gpu0 medium "${MEDIUM_LIMIT:-200}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block "attnres_block@residual.source_dtype=bfloat16" --compile model --graphs on --steps 6 --set $COMBO \
      --tag ${TAG:-_folded}
    step gpu0 profile "${PROFILE_LIMIT:-100}" python3 -m benchmarks.profile_step --model small --residuals attnres_block \
      --compile model --graphs on --top 400 --set $COMBO --tag ${TAG:-_folded}
    ;;
  auto_delta)
    # attnres_block's small step with dO·o from the outputs everywhere (fused.DELTA_FROM_OUTPUTS True, the default) and
    # only where it was faster alone ("auto"), beside vanilla; then its medium step beside vanilla (there "auto" is True)
    attnres_small "${SMALL_LIMIT:-200}" "py:kernels.depth_attn.fused.DELTA_FROM_OUTPUTS=auto" "${TAG:-_auto_delta}"
    step gpu0 medium "${MEDIUM_LIMIT:-250}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block --compile model --graphs on --steps 6 --set $COMBO --tag ${TAG:-_auto_delta}
    ;;
  kept)
    # the merges keep the phase-1 outputs phase 1 keeps (the default) or their own h: what a compiled medium forward
    # saves and its peak, then the small step; the GPU tests first
    keep_h="py:residuals.attnres.DepthAttentionResidual.merges_keep_outputs=False"
    attnres_tests "${TEST_LIMIT:-120}"
    step gpu0 saved "${SAVED_LIMIT:-220}" python3 -m benchmarks.saved_bytes --model medium --batch 16 --vocab 8192 \
      --compile model --residuals vanilla attnres_block "attnres_block@$keep_h" --by-node 6 --tag ${TAG:-_kept}
    attnres_small "${SMALL_LIMIT:-170}" "$keep_h" "${TAG:-_kept}"
    ;;
  narrow)
    attnres_tests "${TEST_LIMIT:-100}"
    step gpu0 medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block "attnres_block@py:kernels.depth_attn.fused.WIDE_BWD=(2,2,True,0)" attnres_block --compile model \
      --graphs on --steps 6 --set $COMBO --tag ${TAG:-_narrow}
    ;;
  split_bwd)
    # the phase-1 backward in two kernels (scalars, then gradients) against one: GPU tests, each call of medium's step
    # alone, then the step with each in one process
    attnres_tests "${TEST_LIMIT:-90}"
    medium_calls "${TILES_LIMIT:-130}" "${TAG:-_split}" default split one-kernel
    medium_step "${MEDIUM_LIMIT:-330}" "${TAG:-_split}" "attnres_block@py:kernels.depth_attn.fused.SPLIT_BWD=False" \
      "attnres_block@py:kernels.depth_attn.fused.SPLIT_BWD=True" "attnres_block@py:kernels.depth_attn.fused.SPLIT_BWD=False"
    ;;
  split_sweep)
    # the split backward's tiles (fused.SPLIT_TILES) at each call of medium's step, beside one kernel
    medium_calls "${TILES_LIMIT:-150}" "${TAG:-_split_sweep}" one-kernel split ${SPLIT_CANDIDATES:-split:4,32,4,2,4 \
      split:4,64,4,1,4 split:4,32,4,1,4 split:8,64,8,2,8 split:4,128,4,2,4}
    ;;
  scores_fwd)
    # SCORES_ONCE and the forward's settings (FWD_WARPS=4, FWD_TAIL) alone at each call of medium's step, then the
    # step: the default, SCORES_ONCE, and SCORES_ONCE with the forward's two loads, at 2 and at 4 warps
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-150}" "${TAG:-_scores_fwd}" one-kernel split split-once fwd4 fwd-tail fwd4-tail
    medium_step "${MEDIUM_LIMIT:-380}" "${TAG:-_scores_fwd}" attnres_block "attnres_block@$ONCE" \
      "attnres_block@$ONCE@py:kernels.depth_attn.fused.FWD_TAIL=True" \
      "attnres_block@$ONCE@py:kernels.depth_attn.fused.FWD_TAIL=True@py:kernels.depth_attn.fused.FWD_WARPS=4"
    ;;
  scores_chunks)
    # the split scores kernel (reduced once) in chunks of 16 channels (80 registers and 3 layout conversions at 8
    # sources by the sm_90 compiler, against 168 and 9 at 32) alone, then in the medium step beside the default
    SPLIT_OPS=${SPLIT_OPS:-block_n3 block_n5 block_n8} medium_calls "${TILES_LIMIT:-60}" "${TAG:-_scores_chunks}" \
      split-once split-once:4,16,4,2,4 split-once:8,16,8,2,4 split-once:2,16,2,2,4 split-once:4,32,4,2,4
    medium_step "${MEDIUM_LIMIT:-200}" "${TAG:-_scores_chunks}" \
      "attnres_block@py:kernels.depth_attn.fused.SPLIT_TILES=(4,16,4,2,4)" attnres_block
    ;;
  logits)
    # the scores kernel from the forward's logits (half its accumulators: 48-72 registers and 2-3 layout conversions by
    # the sm_90 compiler, against 72-126 and 3-8 summing them again) and the gradients kernel at 1 source a load (95
    # registers) or 8 warps (128), alone; then the medium step with the logits and without
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-150}" "${TAG:-_logits}" split-recompute split-logits ${LOGITS_CANDIDATES:-\
      split-logits:4,32,4,2,4 split-logits:4,64,4,2,4 split-logits:4,16,4,1,4 split-logits:4,16,4,2,8}
    medium_step "${MEDIUM_LIMIT:-270}" "${TAG:-_logits}" attnres_block "attnres_block@$RECOMPUTE" attnres_block
    ;;
  logits_check)
    # the GPU tests, then the medium step with the scores from the forward's logits (chunks of 64 from 5 sources)
    # alternating with the logits summed again (the split applies at d = 1024 only: `small` is unchanged), vanilla
    # re-timed last to show the drift of the process
    attnres_tests "${TEST_LIMIT:-110}"
    medium_step "${MEDIUM_LIMIT:-330}" "${TAG:-_logits_check}" attnres_block "attnres_block@$RECOMPUTE" attnres_block \
      "attnres_block@$RECOMPUTE" attnres_block vanilla
    ;;
  logits_where)
    # the split backward's tiles around the default with the forward's logits (the gradients kernel 4 or 8 sources a
    # load, the scores kernel 2 or 8 tokens a program, chunks of 128) alone, then the medium step by kind of kernel
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-120}" "${TAG:-_logits_where}" split-logits ${LOGITS_CANDIDATES:-\
      split-logits:4,64,4,4,4 split-logits:4,64,4,8,4 split-logits:8,64,8,2,4 split-logits:2,64,2,2,4 \
      split-logits:4,128,4,2,4}
    step gpu0 where_medium "${MEDIUM_LIMIT:-260}" python3 -m benchmarks.profile_step --model medium --residuals vanilla \
      attnres_block --compile model --graphs on --top 40 --set $COMBO --tag ${TAG:-_logits}
    ;;
  grads_cap)
    # the split gradients kernel capped at 128 registers (no spills by the sm_90 compiler: 4 programs an SM against 3)
    # or 96 (184 bytes of spills) alone, then the medium step with the cap alternating with the default, vanilla again
    # last
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-80}" "${TAG:-_grads_cap}" split-logits split-cap128 split-cap96
    medium_step "${MEDIUM_LIMIT:-320}" "${TAG:-_grads_cap}" attnres_block "attnres_block@$CAP128" attnres_block \
      "attnres_block@$CAP128" vanilla
    ;;
  grads_cap2)
    # the medium step with the gradients kernel's cap of 128 and without, in the order opposite to grads_cap's (the
    # cap first), so that a drift of the process over its rows does not read as the cap's gain
    medium_step "${MEDIUM_LIMIT:-260}" "${TAG:-_grads_cap2}" "attnres_block@$CAP128" attnres_block \
      "attnres_block@$CAP128" attnres_block
    ;;
  rows)
    # the split gradients kernel over a trip's sources as separate rows, each consumer's query-gradient partial apart
    # (fused.SPLIT_GRADS_ROWS: 476 instructions a trip of 2 sources against 581 by the sm_90 compiler): the GPU tests
    # (with it among them), alone at each call of medium's step (also 4 sources a trip), then the step alternating
    ROWS=py:kernels.depth_attn.fused.SPLIT_GRADS_ROWS=True
    attnres_tests "${TEST_LIMIT:-110}"  # the bf16 test takes the rows too (split-rows)
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-100}" "${TAG:-_rows}" split-blocks split-rows split-rows:4,64,4,4,4 split-blocks
    medium_step "${MEDIUM_LIMIT:-300}" "${TAG:-_rows}" "attnres_block@$ROWS" attnres_block "attnres_block@$ROWS" \
      attnres_block
    ;;
  prefetch)
    # the split gradients kernel loading each trip's sources a trip ahead (fused.SPLIT_GRADS_PREFETCH, capped at 168
    # registers: 3 programs an SM as without): the GPU tests (with it among them), alone at each call of medium's step
    # (also one source a trip), then the step alternating
    PREFETCH=py:kernels.depth_attn.fused.SPLIT_GRADS_PREFETCH=True
    attnres_tests "${TEST_LIMIT:-110}"  # the bf16 test takes the prefetch too (split-prefetch)
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-100}" "${TAG:-_prefetch}" split-blocks split-prefetch split-prefetch:4,64,4,1,4 \
      split-blocks
    medium_step "${MEDIUM_LIMIT:-300}" "${TAG:-_prefetch}" "attnres_block@$PREFETCH" attnres_block \
      "attnres_block@$PREFETCH" attnres_block
    ;;
  rows8)
    # the split gradients kernel as rows at 8 warps a token (no sum over the sources, so nothing crosses a warp: 78
    # registers, 3 programs of 8 warps an SM against 3 of 4): the GPU tests, alone at each call of medium's step (also 1
    # source a trip, 64 registers: 4 programs), then the step alternating (the last row 1 source a trip). On 2026-12-04
    # a rule gave the rows 8 warps; since it is gone SPLIT_TILES sets them (its scores chunk at 2 sources is 64, the
    # rule's 128)
    ROWS=py:kernels.depth_attn.fused.SPLIT_GRADS_ROWS=True@py:kernels.depth_attn.fused.SPLIT_TILES=
    attnres_tests "${TEST_LIMIT:-110}"
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-100}" "${TAG:-_rows8}" split-blocks split-rows:4,64,4,2,8 split-rows:4,64,4,1,8 \
      split-blocks
    medium_step "${MEDIUM_LIMIT:-290}" "${TAG:-_rows8}" "attnres_block@$ROWS(4,64,4,2,8)" attnres_block \
      "attnres_block@$ROWS(4,64,4,2,8)" attnres_block "attnres_block@$ROWS(4,64,4,1,8)"
    ;;
  prefetch_all)
    # the split gradients kernel loading each trip's sources and its scalars (w, dlogit·r, the key norm's coefficient)
    # a trip ahead (fused.SPLIT_GRADS_PREFETCH='all', built 2026-12-04 and tested on the CPU only): the GPU tests (the
    # bf16 test takes it: split-prefetch-all), alone at each call of medium's step beside the sources alone, then the
    # step alternating
    ALL="py:kernels.depth_attn.fused.SPLIT_GRADS_PREFETCH='all'"
    attnres_tests "${TEST_LIMIT:-110}"
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-100}" "${TAG:-_prefetch_all}" split-blocks split-prefetch-all split-prefetch \
      split-blocks
    medium_step "${MEDIUM_LIMIT:-290}" "${TAG:-_prefetch_all}" "attnres_block@$ALL" attnres_block \
      "attnres_block@$ALL" attnres_block
    ;;
  stream)
    # the phase-1 forward with its sources streamed (fused.FWD_STREAM, built 2026-12-04 and tested on the CPU only: 1 or
    # 2 rows a load folded into every consumer's online softmax, 127 / 187 registers against 151-219): the GPU tests
    # (the bf16 test takes fwd-stream1 and fwd-stream2-prefetch), alone at each call of medium's step with 1 and 2 rows
    # a load, the next load in flight or not, then the step alternating with 1 row a load at every source count
    S1="py:kernels.depth_attn.fused.FWD_STREAM=1@py:kernels.depth_attn.fused.FWD_STREAM_FROM=1"
    attnres_tests "${TEST_LIMIT:-130}"
    SPLIT_OPS=${SPLIT_OPS:-block_n2 block_n3 block_n4 block_n5 block_n6 block_n7 block_n8 block_final9} \
      medium_calls "${TILES_LIMIT:-120}" "${TAG:-_stream}" default fwd-stream1 fwd-stream1-prefetch fwd-stream2 \
      fwd-stream2-prefetch default
    medium_step "${MEDIUM_LIMIT:-290}" "${TAG:-_stream}" "attnres_block@$S1" attnres_block \
      "attnres_block@$S1@py:kernels.depth_attn.fused.FWD_STREAM_PREFETCH=True" attnres_block
    ;;
  stream_rule)
    # the rule of 2026-12-04 evening (the forward streams 1 row a load, prefetched, from 9 sources): the bf16 GPU test,
    # full AttnRes and Block AttnRes's final call alone at small and medium against the chunks of before, then full
    # AttnRes's step at small and medium with and without it
    step gpu0 gpu_tests "${TEST_LIMIT:-90}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_depth_attn_fused.py -k "bf16_matches_fp32_reference and (rule or one-kernel)"
    stream_rule_times "${TILES_LIMIT:-60}" "${SMALL_LIMIT:-110}" "${MEDIUM_LIMIT:-310}"  # full AttnRes's medium compile
    # outlasted 150 s on 2026-12-04 evening
    ;;
  stream_pairs)
    # in one call: MSAR's pass 2 two tokens a trip (Blocks.split_trip, built 2026-12-04 and tested on the CPU only):
    # alone at small and medium (each checked against the default first), then msar_block's small step alternating;
    # and the forward's streaming rule against the chunks of before (as stream_rule, without its pytest step: the
    # tiles check every candidate against the reference)
    PAIRS2="py:kernels.msar_attn.fused.FIELDS={'split_trip':2}"
    step gpu0 msar_tiles "${MSAR_TILES_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward --only split_trip=2 split_trip=2,split_ch=128 --tag "${TAG:-_pass2_pairs}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-130}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$PAIRS2" msar_block "msar_block@$PAIRS2" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_pass2_pairs}"
    stream_rule_times "${TILES_LIMIT:-60}" "${SMALL_LIMIT:-110}" "${MEDIUM_LIMIT:-150}"
    ;;
  pairs2)
    # with MSAR's pass 2 two tokens a trip the default (Blocks.split_trip, 2026-12-04 evening): the op's GPU tests, then
    # msar_block's small step beside one token a trip, alternating
    ONE2="py:kernels.msar_attn.fused.FIELDS={'split_trip':1}"
    msar_tests "${TEST_LIMIT:-150}"  # 90 s cut them at 8 passed on 2026-12-04 evening
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-160}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$ONE2" msar_block --compile model --graphs on --steps 8 --set $COMBO --tag "${TAG:-_pairs2}"
    ;;
  msar_next)
    # pairs_medium (the op's GPU tests; pass 2's forward alone with one and four tokens a trip beside the default two;
    # msar_block's medium step beside one token a trip) and the two token-major layouts built 2026-12-04 night and
    # CPU-tested only, alone beside the default: pass 1's and the stats' sums (Blocks.parts_layout, in the forward and
    # the streams backward) and the backward's w, κ, μ (Blocks.coef_layout, the streams backward); since they won
    # (2026-12-05) and are the defaults, the planes are the candidates here
    ONE2="py:kernels.msar_attn.fused.FIELDS={'split_trip':1}"
    msar_tests "${TEST_LIMIT:-140}"
    step gpu0 msar_tiles "${MSAR_TILES_LIMIT:-80}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward --only split_trip=1 split_trip=4,split_bd=64 parts_layout=planes --tag "${TAG:-_pass2_trips}"
    step gpu0 coef_tiles "${COEF_LIMIT:-80}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels stats "source gradients" --only parts_layout=planes coef_layout=planes --tag "${TAG:-_token_major}"
    step gpu0 medium "${MEDIUM_LIMIT:-250}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      msar_block "msar_block@$ONE2" msar_block --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_pairs_medium}"
    ;;
  msar_sources)
    # msar_block's buffer and the open block's partial in bf16 under autocast (residual.source_dtype=autocast, 2026-12-05,
    # CPU only): the medium peak (1.45x vanilla's with fp32 sources, 1.28x with recompute_streams; target 1.10x) and
    # step beside fp32 sources in one process, with the token-major layouts (the defaults since the 2026-12-05 later
    # session) beside the planes, then PARITY_STEPS (150) steps at small, seeds PARITY_SEEDS (0 1 2), eager, against
    # fp32 sources
    SRC=residual.source_dtype=autocast
    PLANES="py:kernels.msar_attn.fused.FIELDS={'coef_layout':'planes','parts_layout':'planes'}"
    step gpu0 gpu_tests "${TEST_LIMIT:-90}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/residuals/test_attnres.py tests/kernels/test_msar_attn.py -k "msar"
    step gpu0 medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      msar_block "msar_block@$PLANES" "msar_block@$SRC" "msar_block@residual.recompute_streams=true@$SRC" msar_block \
      --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_msar_sources}"
    step gpu0 parity "${PARITY_LIMIT:-480}" python3 -m benchmarks.backend_training --residuals msar_block \
      --reference residual.backend=auto --candidate residual.backend=auto $SRC --steps ${PARITY_STEPS:-150} \
      --seeds ${PARITY_SEEDS:-0 1 2} --set model=small trainer=gpu trainer.compile=false --name small_msar_block_bf16_sources
    ;;
  peaks)
    # the peaks of repeated rows (2026-12-05 later session: in one process a row after the first read about 2.5 GiB
    # above the first row of the same settings, msar_block 47.61 then 50.05-50.24 GiB at medium, though what stays
    # allocated after each run grows by 0.06 GiB): the same rows with Inductor's and AOTAutograd's caches on (the
    # default) and off, each in its own process; if the repeats agree with the caches off, a cached compile is what
    # plans the memory differently
    step gpu0 cached "${PEAKS_LIMIT:-200}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      msar_block vanilla msar_block --compile model --graphs on --steps 3 --set $COMBO --tag "${TAG:-_peaks_cached}"
    step gpu0 uncached "${PEAKS_LIMIT:-200}" env TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0 \
      python3 -m benchmarks.throughput --models medium --residuals vanilla msar_block vanilla msar_block --compile model \
      --graphs on --steps 3 --set $COMBO --tag "${TAG:-_peaks_uncached}"
    ;;
  parity_all)
    # "a 60-step training run per fused variant": msar's fused read (S up to 17 at small) has never been held to its
    # reference in training, mhc's not since the streams are kept every L_r* sublayers by default (2026-12-05)
    PARITY_RESIDUALS="${PARITY_ALL_RESIDUALS:-msar mhc}" msar_parity small_parity_all "${PARITY_LIMIT:-540}"
    ;;
  mhc_long)
    # the mHC targets need bf16 streams (residual_floor_dec5.md: with fp32 streams 0.786x small and 0.821x medium at
    # best): whether they train as the fp32 streams do past the shipped corpus's 162 steps an epoch (ran 2026-12-05:
    # they do, and bf16 under autocast is the default since; the reference arm is the fp32 "input" streams)
    if [ ! -f data/shards/large/manifest.json ]; then
      echo "mhc_long: data/shards/large is missing: build it with python -m data.build_corpus --large and carry it" >&2
      exit 2
    fi
    step gpu0 long "${LONG_LIMIT:-540}" python3 -m benchmarks.backend_training --residuals mhc \
      --reference residual.stream_dtype=input --candidate residual.stream_dtype=bf16 --steps "${LONG_STEPS:-1000}" \
      --seeds ${LONG_SEEDS:-0 1} --set model=small trainer=gpu data=large trainer.compile=false \
      --name small_mhc_bf16_streams_long
    ;;
  mhc_next)
    # the read forward's fp32 projection at 32 tokens on 2 warps (4×4 outputs a thread: half the shared-memory bytes a
    # multiply-add, 14 warps an SM against 32; built 2026-12-04 night, CPU-tested only): GPU tests (the variant
    # fixture takes it), the op alone in interleaved rounds, then mhc's small step, the default timed before and after
    W2="py:kernels.mhc.fused.PRE_FWD_BLOCKS=pre_fwd_w2"
    mhc_tests "${TEST_LIMIT:-100}"
    step gpu0 ops_fp32 "${OPS32_LIMIT:-100}" python3 -m benchmarks.ops_mhc --fused-only --dtype fp32 --shapes small \
      medium --variants default pre_fwd_w2 --rounds 5 --tag _pre_fwd_w2
    step gpu0 small "${SMALL_LIMIT:-170}" python3 -m benchmarks.throughput --models small --residuals vanilla mhc \
      "mhc@$W2" mhc "mhc@residual.recompute_every=0" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_pre_fwd_w2}"
    # the streams kept every L_r sublayers and rebuilt in backward (residual.recompute_every; the paper's L_r*, 5 at
    # medium, by default on the fused writes since 2026-12-05): medium's peak and step beside keeping every stream,
    # fp32 and bf16 streams
    step gpu0 medium "${MEDIUM_LIMIT:-240}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      "mhc@residual.recompute_every=0" "mhc@residual.stream_dtype=input" mhc --compile model \
      --graphs on --steps 6 --set $COMBO --tag "${TAG:-_mhc_recompute}"
    ;;
  ahead)
    # MSAR's pass 2 loading a source's rows one source ahead in its unmasked loop (Blocks.split_ahead, built 2026-12-05
    # night and tested on the CPU only; sm_90a at small: 243 registers as the default, 392 against 345 instructions a
    # trip of two tokens): the op's GPU tests, the forward alone at small and medium (checked against the default
    # first), then msar_block's small step alternating
    # Run 2026-12-05 late with the rows ahead as the candidate; the default since, so the candidate row now has them
    # where they are used (split_ahead=False)
    AHEAD="py:kernels.msar_attn.fused.FIELDS={'split_ahead':False}"
    msar_tests "${TEST_LIMIT:-150}"
    step gpu0 msar_tiles "${MSAR_TILES_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward --only fwd_mode=split,split_ahead=False --tag "${TAG:-_pass2_ahead}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$AHEAD" msar_block "msar_block@$AHEAD" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_pass2_ahead}"
    ;;
  ahead_medium)
    # msar_block's medium step with pass 2's rows a source ahead, alternating with the default (vanilla first for the
    # ratio), then the training path's GPU tests (the closing run's third part); run 2026-12-05 late (352 s on a warm
    # H200) with the rows ahead as the candidate, now the default: the candidate row loads them where they are used
    AHEAD="py:kernels.msar_attn.fused.FIELDS={'split_ahead':False}"
    step gpu0 msar_medium "${MSAR_MEDIUM_LIMIT:-290}" python3 -m benchmarks.throughput --models medium --residuals \
      vanilla msar_block "msar_block@$AHEAD" msar_block "msar_block@$AHEAD" --compile model --graphs on --steps 6 \
      --tag "${TAG:-_pass2_ahead}"
    step gpu0 gpu_tests "${CLOSING_TEST_LIMIT:-260}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      ${CLOSING_TESTS:-tests/platform}
    ;;
  src_ahead2)
    # the source-gradient kernel with two tokens' loads in flight (Blocks.serial_ahead2, built 2026-12-05 last session,
    # CPU only; sm_90a at small 255 registers and 32 bytes spilled against 252 and none): the op's GPU tests (its
    # own variant among them), the streams backward alone beside the default at small and medium, then msar_block's
    # small step alternating with the default
    AHEAD2="py:kernels.msar_attn.fused.FIELDS={'serial_ahead2':True}"
    msar_tests "${TEST_LIMIT:-150}"
    step gpu0 src_tiles "${SRC_TILES_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels "source gradients" --only serial_ahead2=True --tag "${TAG:-_src_ahead2}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small --residuals \
      vanilla msar_block "msar_block@$AHEAD2" msar_block "msar_block@$AHEAD2" --compile model --graphs on --steps 8 \
      --set $COMBO --tag "${TAG:-_src_ahead2}"
    ;;
  mhc_tc_bwd)
    # mHC's write backward with every reduction on tensor cores (POST_BWD_PROJ=bf16x3, built 2026-12-05, CPU only;
    # sm_90a: 116 registers, 160 instructions a 16-token chunk without shuffles, against 64 and 371 a 8-token chunk):
    # the GPU tests (the variant fixture takes it), the op alone in interleaved rounds at small and medium, then mhc's
    # small step alternating with the default
    # and the read's sums over the streams the same way (PRE_SUMS=bf16x3; both together: variant tc_sums)
    TC="py:kernels.mhc.fused.POST_BWD_PROJ=bf16x3"
    BOTH="$TC@py:kernels.mhc.fused.PRE_SUMS=bf16x3"
    mhc_tests "${TEST_LIMIT:-100}" "default or tc_sums or bf16_matches"
    step gpu0 ops "${OPS_LIMIT:-120}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default post_bwd_tc tc_sums --rounds 5 --tag "${TAG:-_post_bwd_tc}"
    step gpu0 small "${SMALL_LIMIT:-220}" python3 -m benchmarks.throughput --models small --residuals vanilla mhc \
      "mhc@$BOTH" "mhc@$TC" mhc "mhc@$BOTH" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_post_bwd_tc}"
    ;;
  mhc_dx_rows)
    # mHC's read: dX on the block's stream rows (DX_LAYOUT=rows, built 2026-12-05, CPU only; sm_90a 154 registers at 64
    # channels, 241 at 128 = DX_ROWS_BLOCKS=pre_dx_rows_d128) and the Sinkhorn iterations a thread a token
    # (SINKHORN=token, 2026-12-06: no barriers, 484 against 291 instructions an iteration): the GPU tests (the
    # variant fixture takes them), each alone in interleaved rounds at small and medium against the default, the
    # read's block sweep with more stages, then mhc's small step alternating with the variant that won alone (3% or
    # more off the write + read forward and backward at some shape; none: no step)
    mhc_tests "${TEST_LIMIT:-100}" "dx_rows or token_sinkhorn or bf16_matches"
    step gpu0 ops "${OPS_LIMIT:-170}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default dx_rows dx_rows_d128 token_sinkhorn --rounds 5 --tag "${TAG:-_dx_rows}"
    step gpu0 sweep "${SWEEP_LIMIT:-120}" python3 -m benchmarks.ops_mhc --sweep-blocks --shapes small medium \
      --kernels pre_fwd_tc pre_dx --tag "${TAG:-_dx_rows}"
    mhc_small_if_won "${TAG:-_dx_rows}" "post+pre fwd+bwd"
    ;;
  mhc_read_split)
    # mHC's read forward as three kernels (READ_LAYOUT=split, built 2026-12-06 late on the CPU; the one-kernel read is
    # at 19% of its bytes' time at small, 256 programs for 132 SMs): its GPU tests (launch to launch the same bits,
    # every result near the fp64 read; the chain against the reference), alone in interleaved rounds against the
    # one-kernel read, then mhc's small step alternating with it if it won alone (3% or more off some op)
    mhc_tests "${TEST_LIMIT:-120}" "tensor_core_read or read_split or write_and_next_read"
    step gpu0 ops "${OPS_LIMIT:-120}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default read_split --rounds 5 --tag "${TAG:-_read_split}"
    mhc_small_if_won "${TAG:-_read_split}" "post+pre"
    # and the read's race of 2026-12-06 late reduced to a projection alone (benchmarks.wgmma_race)
    step gpu0 race "${RACE_LIMIT:-60}" python3 -m benchmarks.wgmma_race
    ;;
  mhc_split_step)
    # the split read in mhc's graphed `small` step whatever its alone timing: alone (mhc_read_split, 2026-12-06) the
    # ops' `small` times were launch-bound (do_bench without graphs, 0.12-0.30 ms a round), so the step decides;
    # then its kernels in the profile beside the one-kernel read
    SPLIT=$(python3 -m benchmarks.ops_mhc --row-of read_split)
    step gpu0 small "${SMALL_LIMIT:-300}" python3 -m benchmarks.throughput --models small \
      --residuals vanilla mhc "mhc@$SPLIT" mhc "mhc@$SPLIT" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_read_split}"
    step gpu0 profile "${PROFILE_LIMIT:-150}" python3 -m benchmarks.profile_step --model small \
      --residuals mhc "mhc@$SPLIT" --compile model --graphs on --top 40 --set $COMBO --tag "${TAG:-_read_split}"
    ;;
  mhc_auto_read)
    # READ_LAYOUT="auto" (the split read below two programs an SM, the default since 2026-12-06, end): every mHC GPU
    # test (the chain with read_fused and the default, which splits at the tests' token counts), then mhc's graphed
    # `small` step (auto: split) against the fused read, alternating
    FUSED=$(python3 -m benchmarks.ops_mhc --row-of read_fused)
    mhc_tests "${TEST_LIMIT:-150}"
    step gpu0 small "${SMALL_LIMIT:-260}" python3 -m benchmarks.throughput --models small \
      --residuals vanilla mhc "mhc@$FUSED" mhc "mhc@$FUSED" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_auto_read}"
    ;;
  mhc_bwd_split)
    # the read's backward with its sweep as a kernel of its own (PRE_BWD_LAYOUT="split", built 2026-12-06 end): the
    # GPU chain test with it (and the other variants) and its launch-to-launch test, then mhc's graphed `small` step
    # against the default, alternating
    BWD=$(python3 -m benchmarks.ops_mhc --row-of bwd_split)
    mhc_tests "${TEST_LIMIT:-90}" "write_and_next_read and (bwd_split or default)"
    step gpu0 small "${SMALL_LIMIT:-230}" python3 -m benchmarks.throughput --models small \
      --residuals mhc "mhc@$BWD" mhc "mhc@$BWD" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_bwd_split}"
    ;;
  mhc_phi_blocks)
    # first the ops timed as CUDA graph replays (--timer graphs, new 2026-12-06 end; untried on a GPU): the split and
    # one-kernel reads alone without launch gaps, which should side with the graphed step (split faster at `small`);
    # then φ's gradient (`_phi_grad_kernel`, 43% of its bytes' time at `small` on an H100) in the block sweep: more rows
    # of n·d a program (fewer reloads of w), more tokens a step, stages; a candidate whose two launches differ or whose
    # results are 1e-3 off fails; then the mHC GPU tests (TEST_LIMIT=0 skips them)
    step gpu0 ops "${OPS_LIMIT:-100}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default read_fused read_split --rounds 3 --timer graphs --tag "${TAG:-_phi_grad}_graphs"
    step gpu0 sweep "${SWEEP_LIMIT:-150}" python3 -m benchmarks.ops_mhc --sweep-blocks --shapes small medium \
      --kernels phi_grad --tag "${TAG:-_phi_grad}"
    mhc_tests "${TEST_LIMIT:-120}"
    ;;
  mhc_race_bisect)
    # what the read forward's race at (64, 64, 4, 2) needs (the projection alone does not race, 2026-12-06 end): the
    # racing and the right blocks with 0, 1 and 20 Sinkhorn iterations, each tiled (shared memory, barriers) or a
    # thread a token; two launches each, every result against the fp64 read with as many iterations
    step gpu0 bisect "${BISECT_LIMIT:-100}" python3 -m benchmarks.mhc_read_check --shapes small \
      --blocks 64,64,4,1 64,64,4,2 --iters 0 1 20 --sinkhorn tile token --tag "${TAG:-_bisect}"
    ;;
  mhc_phi_check)
    # after φ's gradient took (64, 128, 8, 3) (2026-12-06 evening): the whole mHC GPU test file with it as the default;
    # the race reduction with the read's second sweep after the projection; where the step goes now, mHC's and MSAR's
    mhc_tests "${TEST_LIMIT:-90}"
    step gpu0 race "${RACE_LIMIT:-60}" python3 -m benchmarks.wgmma_race --tag "${TAG:-_sweep2}"
    mhc_profile_step "${PROFILE_LIMIT:-200}" "${TAG:-_sweep2}" vanilla mhc msar_block
    ;;
  msar_glue)
    # after the step's profile (2026-12-06 night, profile_step_small_graphs_phi_check_h100.md): msar_block's combine
    # read and wrote the fp32 streams (1.39 ms of its 41 ms), five reductions a read took 1.12 ms. Ran that night with
    # the kept combine and the partial sums as the candidates; both the defaults since, so the rows here time the
    # settings before (the fp32 combine, torch's sums) against them, each alone and both
    F32="py:kernels.msar_attn.fused.FIELDS={'combine_from':'float32'}"
    TORCH="py:kernels.msar_attn.fused.FIELDS={'part_sums':'torch'}"
    BEFORE="py:kernels.msar_attn.fused.FIELDS={'combine_from':'float32','part_sums':'torch'}"
    step gpu0 gpu_tests "${TEST_LIMIT:-100}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_msar_attn.py -k "combine or sums or plain"
    step gpu0 src_tiles "${SRC_TILES_LIMIT:-80}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels "source gradients" --only part_sums=torch --tag "${TAG:-_part_sums}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-300}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$F32" "msar_block@$TORCH" "msar_block@$BEFORE" msar_block "msar_block@$F32" \
      "msar_block@$TORCH" "msar_block@$BEFORE" --compile model --graphs on --steps 8 --set $COMBO --tag "${TAG:-_msar_glue}"
    step gpu0 parity "${PARITY_LIMIT:-0}" python3 -m benchmarks.backend_training --residuals msar_block \
      --reference residual.backend=auto "$F32" --candidate residual.backend=auto --steps 60 --seeds 0 1 \
      --set model=small trainer=gpu trainer.compile=false --name small_msar_block_combine_kept
    ;;
  msar_partial)
    # the partial's bf16 copy made where the compiled graph sums it (built 2026-12-06 night; the same values, tested
    # on the CPU): the profile's copies (about 32 cast kernels a small step, 0.67 ms) against the cast in each read
    WRITE_CAST="py:residuals.attnres_block.BlockSummaries.cast_partial_in_write=True"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$WRITE_CAST" msar_block "msar_block@$WRITE_CAST" --compile model --graphs on --steps 8 \
      --set $COMBO --tag "${TAG:-_msar_partial}"
    ;;
  msar_views)
    # the glue around msar_block's eager reads (profile_step_small_graphs_phi_check_h100.md): each read's backward made a
    # whole-parameter gradient of zeros for each of its 8 parameter slices, and each read cast the open block's partial
    # (built 2026-12-06 night and last session, the same values to the bit, tested on the CPU); mHC's layers slice 5
    # parameters a layer alike
    VIEWS="py:residuals.msar.Msar.params_once=True"
    WRITE_CAST="py:residuals.attnres_block.BlockSummaries.cast_partial_in_write=True"
    MHC_VIEWS="py:residuals.mhc.MHC.params_once=True"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-300}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$VIEWS@$WRITE_CAST" "msar_block@$VIEWS" "msar_block@$WRITE_CAST" msar_block \
      "msar_block@$VIEWS@$WRITE_CAST" --compile model --graphs on --steps 8 --set $COMBO --tag "${TAG:-_msar_views}"
    step gpu0 mhc_small "${MHC_SMALL_LIMIT:-170}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      mhc "mhc@$MHC_VIEWS" mhc "mhc@$MHC_VIEWS" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_mhc_views}"
    ;;
  mix_walk)
    # the mixer's backward summing dφ, Σ dz and Σ dz·y in registers as a program walks its tokens, instead of a batched
    # product that reads R a third time and two torch sums (built 2026-12-06, CPU only; sm_90a at small: 225 registers
    # at 8 warps, one program an SM, no spills)
    WALK="py:kernels.msar_attn.fused.FIELDS={'mix_dphi':'walk'}"
    msar_tests "${TEST_LIMIT:-120}" "plain or walk or test_gpu_fp32"
    step gpu0 mix_tiles "${TILES_LIMIT:-150}" python3 -m benchmarks.msar_tiles --shapes small medium \
      --kernels "mixer backward" --tag "${TAG:-_mix_walk}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-230}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$WALK" msar_block "msar_block@$WALK" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_mix_walk}"
    ;;
  mix_next)
    TILES="py:kernels.msar_attn.fused.FIELDS={'bwd_bt':4,'mix_warps':8}"
    FP32="py:kernels.msar_attn.fused.FIELDS={'dphi_partials':'float32'}"
    BOTH="py:kernels.msar_attn.fused.FIELDS={'bwd_bt':4,'mix_warps':8,'dphi_partials':'float32'}"
    msar_tests "${TEST_LIMIT:-60}" "dphi_partials"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-260}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$TILES" "msar_block@$FP32" "msar_block@$BOTH" msar_block "msar_block@$TILES" \
      "msar_block@$FP32" "msar_block@$BOTH" --compile model --graphs on --steps 8 --set $COMBO --tag "${TAG:-_mix_next}"
    [ "${MEDIUM_LIMIT:-230}" != 0 ] && step gpu0 msar_medium "${MEDIUM_LIMIT:-230}" python3 -m benchmarks.throughput \
      --models medium --residuals msar_block "msar_block@$FP32" msar_block "msar_block@$FP32" --compile model \
      --graphs on --steps 6 --set $COMBO --tag "${TAG:-_mix_next_medium}"
    ;;
  mix_default)
    KEPT="py:kernels.msar_attn.fused.FIELDS={'dphi_partials':'kept'}"
    PACK="py:kernels.msar_attn.fused.FIELDS={'pack_once':True}"
    msar_tests "${TEST_LIMIT:-150}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-120}" python3 -m benchmarks.throughput --models small --residuals \
      msar_block "msar_block@$PACK" msar_block "msar_block@$PACK" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_pack_once}"
    step gpu0 parity "${PARITY_LIMIT:-230}" python3 -m benchmarks.backend_training --residuals msar_block \
      --reference residual.backend=auto "$KEPT" --candidate residual.backend=auto --steps 60 --seeds 0 1 \
      --set model=small trainer=gpu trainer.compile=false --name small_msar_block_dphi_fp32
    ;;
  dphi_reduce)
    RED="py:kernels.msar_attn.fused.FIELDS={${RED:-'mix_dphi':'reduce'}}"
    msar_tests "${TEST_LIMIT:-90}" "${TEST_K:-plain or reduce or test_gpu_fp32}"
    step gpu0 mix_tiles "${TILES_LIMIT:-120}" python3 -m benchmarks.msar_tiles --shapes small medium \
      --kernels "mixer backward" --only mix_dphi=reduce mix_dphi=reduce,dphi_bt=4 mix_dphi=reduce,dphi_bt=16 \
      mix_dphi=reduce,dphi_bd=256 mix_dphi=reduce,dphi_bd=256,dphi_warps=8 mix_dphi=reduce,dphi_bd=64,dphi_warps=2 \
      mix_dphi=reduce,dphi_waves=2 mix_dphi=reduce,dphi_waves=8 --tag "${TAG:-_dphi_reduce}"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-230}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$RED" msar_block "msar_block@$RED" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_dphi_reduce}"
    [ "${PARITY_LIMIT:-0}" != 0 ] && msar_parity small_msar_block_dphi_reduce "$PARITY_LIMIT" \
      --reference residual.backend=auto --candidate residual.backend=auto "$RED"
    ;;
  glue_next)
    LATE="py:kernels.msar_attn.fused.FIELDS={${LATE:-'mix_dphi':'reduce','dphi_late':True,'dphi_bt':4}}"
    SUMS="py:kernels.msar_attn.fused.FIELDS={${SUMS:-'mix_sums':'kernel'}}"
    PACK="py:residuals.msar.Msar.pack_step=True"
    msar_tests "${TEST_LIMIT:-150}" "${TEST_K:-mix-dphi-late or mix-sums-kernel}"
    step gpu0 graphs_tests "${GRAPHS_LIMIT:-100}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/platform/test_graphs.py -k 'msar and (match_eager or their_own)'
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-430}" python3 -m benchmarks.throughput --models small \
      --residuals vanilla msar_block "msar_block@$LATE" "msar_block@$SUMS" "msar_block@$PACK" msar_block \
      "msar_block@$LATE" "msar_block@$SUMS" "msar_block@$PACK" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_glue_next}"
    ;;
  glue_both)
    # Msar.pack_step is the default since this plan's first run: its rows time the late sum beside it
    BOTH="py:kernels.msar_attn.fused.FIELDS={${LATE:-'mix_dphi':'reduce','dphi_late':True,'dphi_bt':4}}"
    msar_tests "${TEST_LIMIT:-90}" "${TEST_K:-mix-dphi-late}"
    step gpu0 graphs_tests "${GRAPHS_LIMIT:-100}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/platform/test_graphs.py -k 'msar and (match_eager or their_own)'
    step gpu0 msar_small "${SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$BOTH" msar_block "msar_block@$BOTH" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_glue_both}"
    step gpu0 msar_medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals \
      msar_block "msar_block@$BOTH" msar_block "msar_block@$BOTH" --compile model --graphs on --steps 6 --set $COMBO \
      --tag "${TAG:-_glue_both}"
    [ "${PARITY_LIMIT:-200}" != 0 ] && msar_parity "small_msar_block${TAG:-_glue_both}" "${PARITY_LIMIT:-200}" \
      --reference residual.backend=auto --candidate residual.backend=auto "$BOTH"
    [ "${PROFILE_LIMIT:-120}" != 0 ] && mhc_profile_step "${PROFILE_LIMIT:-120}" "${TAG:-_glue_both}" vanilla \
      msar_block "msar_block@$BOTH"
    ;;
  dphi_default)
    PRODUCT="py:kernels.msar_attn.fused.FIELDS={'mix_dphi':'product','dphi_late':False,'dphi_bt':8}"
    step gpu0 graphs_tests "${GRAPHS_LIMIT:-100}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/platform/test_graphs.py -k 'msar and (match_eager or their_own)'
    [ "${PARITY_LIMIT:-250}" != 0 ] && msar_parity "small_msar_block${TAG:-_dphi_default}" "${PARITY_LIMIT:-250}" \
      --reference residual.backend=auto "$PRODUCT" --candidate residual.backend=auto
    ;;
  glue_medium)
    CAND="py:kernels.msar_attn.fused.FIELDS={${CAND:-'mix_sums':'kernel'}}"
    [ -n "${CAND_ROW:-}" ] && CAND=$CAND_ROW
    step gpu0 msar_medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals \
      msar_block "msar_block@$CAND" msar_block "msar_block@$CAND" --compile model --graphs on --steps 6 --set $COMBO \
      --tag "${TAG:-_glue_medium}"
    [ "${PARITY_LIMIT:-200}" != 0 ] && msar_parity "small_msar_block${TAG:-_glue_medium}" "${PARITY_LIMIT:-200}" \
      --reference residual.backend=auto --candidate residual.backend=auto "$CAND"
    ;;
  dphi_medium)
    RED="py:kernels.msar_attn.fused.FIELDS={${RED:-'mix_dphi':'reduce'}}"
    step gpu0 msar_medium "${MEDIUM_LIMIT:-240}" python3 -m benchmarks.throughput --models medium --residuals \
      msar_block "msar_block@$RED" msar_block "msar_block@$RED" --compile model --graphs on --steps 6 --set $COMBO \
      --tag "${TAG:-_dphi_medium}"
    [ "${PARITY_LIMIT:-200}" != 0 ] && msar_parity small_msar_block_dphi_reduce "${PARITY_LIMIT:-200}" \
      --reference residual.backend=auto --candidate residual.backend=auto "$RED"
    ;;
  views_medium)
    # msar_views' winners as the defaults: where the graphed small step goes now, then medium's steps against the
    # settings before (BEFORE_MSAR / BEFORE_MHC: the py: settings of the rows before; empty: the residual left out)
    mhc_profile_step "${PROFILE_LIMIT:-170}" "${TAG:-_views}" vanilla msar_block mhc
    rows=()
    [ -n "${BEFORE_MSAR:-}" ] && rows+=(msar_block "msar_block@$BEFORE_MSAR")
    [ -n "${BEFORE_MHC:-}" ] && rows+=(mhc "mhc@$BEFORE_MHC")
    step gpu0 medium "${MEDIUM_LIMIT:-360}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      "${rows[@]}" --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_views_medium}"
    ;;
  msar_dr)
    # the mixer's backward writing dR in the kept streams' dtype (bf16 under autocast), read by the stats and the
    # source-gradient kernels, each program of which is one source's (Blocks.grad_streams="kept", built 2026-12-06
    # night, CPU only; sm_90a at small: the source gradients 252 -> 249 registers, the stats 150 -> 146, no spills)
    DR="py:kernels.msar_attn.fused.FIELDS={'grad_streams':'kept'}"
    step gpu0 gpu_tests "${TEST_LIMIT:-100}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_msar_attn.py -k "plain or grad or fp32"
    step gpu0 msar_small "${MSAR_SMALL_LIMIT:-200}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      msar_block "msar_block@$DR" msar_block "msar_block@$DR" --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_msar_dr}"
    step gpu0 parity "${PARITY_LIMIT:-200}" python3 -m benchmarks.backend_training --residuals msar_block \
      --reference residual.backend=auto --candidate residual.backend=auto "$DR" --steps 60 --seeds 0 1 \
      --set model=small trainer=gpu trainer.compile=false --name small_msar_block_grad_streams
    ;;
  mhc_phi_medium)
    # φ's gradient at 64 tokens and 128 rows a program, 8 warps: 5% off a `medium` write + read forward and backward
    # in the block sweep (2026-12-06 evening; ran then as the variant phi_r128 against the default, since swapped: the
    # blocks are the default and phi_r64 the blocks before); its GPU chain test, then mhc's `medium` step alternating
    # with the blocks before (MEDIUM_RESIDUALS adds rows in front, e.g. vanilla; MODEL=small for small)
    PHI=$(python3 -m benchmarks.ops_mhc --row-of phi_r64)
    mhc_tests "${TEST_LIMIT:-60}" "write_and_next_read and (phi_r64 or default)"
    step gpu0 "${MODEL:-medium}" "${MEDIUM_LIMIT:-420}" python3 -m benchmarks.throughput --models "${MODEL:-medium}" \
      --residuals ${MEDIUM_RESIDUALS:-} mhc "mhc@$PHI" mhc "mhc@$PHI" --compile model --graphs on --steps 6 --set $COMBO \
      --tag "${TAG:-_phi_medium}"
    ;;
  mhc_dx_tb)
    # the read's rows dX with a program walking 4 or 8 token blocks of its channel tile, Φ loaded once for them
    # (DX_ROWS_TOKEN_BLOCKS, built 2026-12-06 end; 196 registers against 112 on sm_90a, no spills): the GPU chain test
    # with them, alone in interleaved rounds (events and graph replays), then mhc's small step if one won alone
    mhc_tests "${TEST_LIMIT:-90}" "write_and_next_read and (dx_rows_tb4 or dx_rows_tb8 or default)"
    step gpu0 ops "${OPS_LIMIT:-120}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default dx_rows_tb4 dx_rows_tb8 --rounds 5 --tag "${TAG:-_dx_tb}"
    step gpu0 ops_graphs "${GRAPHS_LIMIT:-100}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default dx_rows_tb4 dx_rows_tb8 --rounds 3 --timer graphs --tag "${TAG:-_dx_tb}_graphs"
    mhc_small_if_won "${TAG:-_dx_tb}" "post+pre fwd+bwd"
    ;;
  mhc_profile)
    # where mHC's step goes with the day's defaults (2026-12-06 late): vanilla and mhc graphed at `small`, every
    # residual kernel listed, and the kinds table (MODEL=medium for medium; PROFILE_RESIDUALS for other rows)
    mhc_profile_step "${PROFILE_LIMIT:-200}" "${TAG:-_read64}" ${PROFILE_RESIDUALS:-vanilla mhc}
    ;;
  mhc_bwd_blocks)
    # mHC's backward kernels at one stage and 32 tokens (8 warps), as the read's forward gained at 64 tokens and one
    # stage (2026-12-06 late): the write's backward on tensor cores and the read's rows dX in the block sweep, which
    # fails a candidate whose two launches differ; then the mHC GPU tests
    step gpu0 sweep "${SWEEP_LIMIT:-180}" python3 -m benchmarks.ops_mhc --sweep-blocks --shapes small medium \
      --kernels post_bwd_tc pre_dx_rows --tag "${TAG:-_bwd_blocks}"
    mhc_tests "${TEST_LIMIT:-0}"
    ;;
  mhc_read64)
    # mHC's read forward on tensor cores at 64 tokens and one stage (READ_BLOCKS=pre_fwd_tc, the default since
    # 2026-12-06 late; mhc_next2 found two stages racing and one stage right): the mHC GPU tests, the write + read
    # alone in interleaved rounds against 32 tokens (read_t32), then mhc's steps beside vanilla and the 32-token read
    # (MEDIUM_LIMIT=0 by default: medium's three rows need a call of their own on a cold host)
    T32=$(python3 -m benchmarks.ops_mhc --row-of read_t32)
    mhc_tests "${TEST_LIMIT:-150}"
    step gpu0 ops "${OPS_LIMIT:-120}" python3 -m benchmarks.ops_mhc --fused-only --shapes small medium \
      --variants default read_t32 --rounds 5 --tag "${TAG:-_read64}"
    step gpu0 small "${SMALL_LIMIT:-240}" python3 -m benchmarks.throughput --models small \
      --residuals vanilla "mhc@$T32" mhc "mhc@$T32" mhc --compile model --graphs on --steps 8 --set $COMBO \
      --tag "${TAG:-_read64}"
    step gpu0 medium "${MEDIUM_LIMIT:-0}" python3 -m benchmarks.throughput --models medium \
      --residuals vanilla "mhc@$T32" mhc --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_read64}"
    ;;
  mhc_next2)
    # the next session's mHC calls (2026-12-06): the read forward's 64-token blocks (wgmma: 0.57-0.68x of the time,
    # results off by 5e-3-1.5e-2 on the GPU only) result by result against the fp64 reference, with the positions in
    # the block of the tokens that are off and whether two launches agree (benchmarks.mhc_read_check); the block
    # sweep; then the rows dX's 60-step training parity, eager as mHC's parities before it (compiled, the reference
    # backend's mHC ran past 330 s)
    step gpu0 read_check "${CHECK_LIMIT:-120}" python3 -m benchmarks.mhc_read_check --shapes small medium \
      --sums fp32 bf16x3 --tag "${TAG:-_read64}"
    step gpu0 sweep "${SWEEP_LIMIT:-90}" python3 -m benchmarks.ops_mhc --sweep-blocks --shapes small medium \
      --kernels pre_fwd_tc --tag "${TAG:-_read64}"
    step gpu0 parity "${PARITY_LIMIT:-300}" python3 -m benchmarks.backend_training --residuals mhc --steps 60 \
      --seeds 0 1 --set model=small trainer=gpu trainer.compile=false --name small_mhc_dx_rows
    ;;
  msar_full_sources)
    # full MSAR's sources in bf16 under autocast (residual.source_dtype=autocast): its 60-step parity against the
    # stream's dtype (eager, seeds 0 1, both arms fused), then medium's step and peak beside vanilla and fp32 sources.
    # Ran 2026-12-05 night on an H100 (431 s): parity ok, 741.1 against 842.8 ms, peak 47.88 against 54.13 GiB; msar's
    # default since, so both arms now name their dtype (the run itself named only the candidate's)
    SRC=residual.source_dtype=autocast FP32=residual.source_dtype=stream
    step gpu0 parity "${PARITY_LIMIT:-260}" python3 -m benchmarks.backend_training --residuals msar \
      --reference residual.backend=auto $FP32 --candidate residual.backend=auto $SRC --steps 60 --seeds 0 1 \
      --set model=small trainer=gpu trainer.compile=false --name small_msar_bf16_sources
    step gpu0 medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      "msar@$SRC" "msar@$FP32" --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_msar_full_sources}"
    ;;
  attnres_next)
    # the forward's streaming rule (from 9 sources): its bf16 GPU test, then full AttnRes's medium step with and
    # without it. Ran 2026-12-05 late on an H100 with the split gradients kernel's two candidates of 2026-12-04 night
    # (the partial per token block, the consumers outside the sources) timed alone too: both lost and were removed
    step gpu0 gpu_tests "${TEST_LIMIT:-80}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_depth_attn_fused.py -k "bf16_matches_fp32_reference and (rule or one-kernel)"
    stream_rule_times "${TILES_LIMIT:-60}" "${SMALL_LIMIT:-0}" "${MEDIUM_LIMIT:-290}"  # small's step: 2026-12-04 evening
    ;;
  pairs_medium)
    # MSAR's pass 2 two tokens a trip (the default since 2026-12-04 evening) at medium, where its 243 registers may bind:
    # the op's GPU tests, the forward alone at small and medium beside one token a trip and four on 64 channels (built
    # 2026-12-04 evening, tested on the CPU only), then msar_block's medium step beside one token a trip, alternating
    ONE2="py:kernels.msar_attn.fused.FIELDS={'split_trip':1}"
    msar_tests "${TEST_LIMIT:-150}"
    step gpu0 msar_tiles "${MSAR_TILES_LIMIT:-90}" python3 -m benchmarks.msar_tiles --shapes small medium --sources 5 \
      --kernels forward --only split_trip=1 split_trip=4,split_bd=64 --tag "${TAG:-_pass2_trips}"
    step gpu0 medium "${MEDIUM_LIMIT:-300}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      msar_block "msar_block@$ONE2" msar_block --compile model --graphs on --steps 6 --set $COMBO --tag "${TAG:-_pairs_medium}"
    ;;
  split_counters)
    # Nsight Compute's counters of one Block AttnRes block at medium's width over 8 summaries (the split backward's two
    # kernels, the forward, the merges), then tabulated
    COUNTER_LAUNCHES=${COUNTER_LAUNCHES:-16} counters_of attnres_medium "${COUNTER_LIMIT:-240}"
    python3 -m benchmarks.kernel_counters --summarize "$OUTDIR/gpu0.ncu_attnres_medium.txt" --tag _split_medium \
      > "$OUTDIR/gpu0.summary_counters.txt" 2>&1
    ;;
  fwd_check)
    # the GPU tests, then the medium and small steps with the defaults of 2026-12-04 (SCORES_ONCE from 2 consumers,
    # the split from 2 sources, the forward's one-row tails) beside those before (re-timed between)
    attnres_tests "${TEST_LIMIT:-110}"
    medium_step "${MEDIUM_LIMIT:-260}" "${TAG:-_fwd_check}" attnres_block "attnres_block@$BEFORE_DEC4" attnres_block
    attnres_small "${SMALL_LIMIT:-120}" "$BEFORE_DEC4" "${TAG:-_fwd_check}"
    ;;
  rows_medium)
    # the row gradients in the rows' dtype (bf16 under autocast) and the split backward, each undone, at medium
    attnres_tests "${TEST_LIMIT:-90}"
    medium_step "${MEDIUM_LIMIT:-340}" "${TAG:-_rows}" attnres_block \
      "attnres_block@py:kernels.depth_attn.buffer.ROW_GRADIENTS=float32" \
      "attnres_block@py:kernels.depth_attn.buffer.ROW_GRADIENTS=float32@py:kernels.depth_attn.fused.SPLIT_BWD=False" \
      attnres_block
    ;;
  rows_small)
    # the same at small (no split there), then training with bf16 row gradients against fp32 ones
    step gpu0 small "${SMALL_LIMIT:-150}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      attnres_block "attnres_block@py:kernels.depth_attn.buffer.ROW_GRADIENTS=float32" attnres_block --compile model \
      --graphs on --steps 8 --set $COMBO --tag ${TAG:-_rows}
    step gpu0 parity "${PARITY_LIMIT:-240}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --reference py:kernels.depth_attn.buffer.ROW_GRADIENTS=float32 --candidate residual.backend=auto --steps 60 \
      --seeds 0 1 --set model=small trainer=gpu trainer.compile=false --name small_attnres_block_row_gradients
    ;;
  wide)
    # the phase-1 backward's tiles at d = 1024 alone, then the step with the fastest
    step gpu0 wide_tiles "${TILES_LIMIT:-170}" python3 -m benchmarks.depth_attn_tiles --shapes medium --dtypes bf16 \
      --ops block_n3 block_n4 block_n6 block_n8 --phase1 default ${WIDE_CANDIDATES:-1,2,8,2,0,2,168 1,2,8,2,0,4,128 \
      1,2,8,4,0,4,168 1,2,8,8,0,8,128 1,2,8,8,0,8 1,2,8,4,0,4} --tag ${TAG:-_wide}
    best=$(python3 -m benchmarks.depth_attn_tiles --best-wide "benchmarks/results/depth_attn_tiles_nvidia_h200_medium${TAG:-_wide}.md" 2>/dev/null | tail -1)
    echo "fastest backward tiles: ${best:-none}" >> "$OUTDIR/summary.txt"
    if [ -n "$best" ] && [ "$best" != None ]; then
      step gpu0 medium "${MEDIUM_LIMIT:-340}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
        attnres_block "attnres_block@py:kernels.depth_attn.fused.WIDE_BWD=${best// /}" attnres_block --compile model \
        --graphs on --steps 6 --set $COMBO --tag ${TAG:-_wide}
    fi
    ;;
  where)
    # each residual's step beside vanilla's, by kind of kernel: medium first, then small
    step gpu0 where_medium "${MEDIUM_LIMIT:-260}" python3 -m benchmarks.profile_step --model medium --residuals vanilla \
      attnres_block --compile model --graphs on --top 40 --set $COMBO --tag ${TAG:-_where}
    step gpu0 where_small "${SMALL_LIMIT:-220}" python3 -m benchmarks.profile_step --model small --residuals \
      ${WHERE_SMALL:-vanilla attnres_block mhc msar_block} --compile model --graphs on --top 40 --set $COMBO \
      --tag ${TAG:-_where}
    ;;
  lean)
    # what frees each group's phase-1 outputs at medium (bf16 sources, or dO·o from the sources), against the default
    attnres_tests "${TEST_LIMIT:-100}"
    step gpu0 medium "${MEDIUM_LIMIT:-400}" python3 -m benchmarks.throughput --models medium --residuals vanilla \
      attnres_block "attnres_block@residual.source_dtype=bfloat16" \
      "attnres_block@py:kernels.depth_attn.fused.DELTA_FROM_OUTPUTS=False" --compile model --graphs on --steps 6 \
      --set $COMBO --tag ${TAG:-_lean}
    ;;
  sources2)
    # bf16 sources under autocast (the default) against fp32 ones: training parity, then the small step
    step gpu0 parity "${PARITY_LIMIT:-300}" python3 -m benchmarks.backend_training --residuals attnres_block \
      --reference residual.source_dtype=stream --candidate residual.backend=auto --steps ${PARITY_STEPS:-300} \
      --seeds 0 1 2 --set model=small trainer=gpu trainer.compile=true --name small_attnres_block_bf16_sources_compiled
    attnres_small "${SMALL_LIMIT:-180}" "residual.source_dtype=stream" "${TAG:-_sources2}"
    ;;
  ops_final)
    # the issue's per-op tables with the day's defaults, each op in one process at small, medium and d = 2048: the fused
    # op, its reference and torch.compile of it (for AttnRes also fast-attnres and fla, from .whl/ when present), its
    # minimal bytes, FLOPs and roofline; PROFILE_LIMIT > 0 first profiles attnres_block's medium step beside vanilla by
    # kind of kernel (about 200 s on a cold host)
    step gpu0 where_medium "${PROFILE_LIMIT:-0}" python3 -m benchmarks.profile_step --model medium --residuals vanilla \
      attnres_block --compile model --graphs on --top 40 --set $COMBO --tag ${TAG:-_final}
    step gpu0 ops_attnres "${ATTNRES_LIMIT:-330}" python3 -m benchmarks.ops_attnres --shapes ${ATTNRES_SHAPES:-small medium d2048} \
      --ops ${ATTNRES_OPS:-block full}
    step gpu0 msar_attn "${MSAR_LIMIT:-240}" python3 -m benchmarks.msar_attn --shapes ${MSAR_SHAPES:-small medium wide} \
      --sources 5
    step gpu0 ops_mhc "${MHC_LIMIT:-240}" python3 -m benchmarks.ops_mhc --shapes ${MHC_SHAPES:-small medium d2048} \
      --variants ${MHC_VARIANTS:-default one_pass} --tag ${TAG:-_final}
    ;;
  final2)
    # what ops_final left: the public AttnRes ops at d = 2048; Block AttnRes against them as CUDA-graph replays at small
    # and medium (no launch gaps, as a graphed step runs them); mHC's op beside its reference at medium and d = 2048
    step gpu0 attnres_d2048 "${D2048_LIMIT:-80}" python3 -m benchmarks.ops_attnres --shapes d2048 --ops block \
      --impls fused fast-attnres "fla fused_attnres" --no-breakdown
    step gpu0 attnres_graphs "${GRAPHS_LIMIT:-100}" python3 -m benchmarks.ops_attnres --shapes small medium --ops block \
      --impls fused fast-attnres "fla fused_attnres" --no-breakdown --timer graphs
    step gpu0 ops_mhc "${MHC_LIMIT:-260}" python3 -m benchmarks.ops_mhc --shapes ${MHC_SHAPES:-medium d2048} \
      --variants default --tag ${TAG:-_final_md}
    ;;
  apart)
    # phase 1's first output of a group in a tensor of its own (fused.FIRST_APART: no copy in the residual) against
    # the one tensor of all C and the copy of before, alternating in attnres_block's medium step beside vanilla;
    # first the depth-attention op's and the residual's GPU tests
    step gpu0 gpu_tests "${TEST_LIMIT:-90}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
      tests/kernels/test_depth_attn_fused.py tests/residuals/test_attnres.py
    medium_step "${MEDIUM_LIMIT:-400}" "${TAG:-_apart}" attnres_block "attnres_block@py:kernels.depth_attn.fused.FIRST_APART=False" \
      attnres_block "attnres_block@py:kernels.depth_attn.fused.FIRST_APART=False"
    ;;
  timers)
    # the op tables' host side: the public AttnRes ops at medium and d = 2048 (block, events timer), then MSAR and
    # Block AttnRes timed as replays of a CUDA graph (--timer graphs: no launch gaps, as a graphed step runs them)
    step gpu0 ops_attnres "${ATTNRES_LIMIT:-300}" python3 -m benchmarks.ops_attnres --shapes ${ATTNRES_SHAPES:-medium d2048} \
      --ops block
    step gpu0 msar_graphs "${MSAR_LIMIT:-120}" python3 -m benchmarks.msar_attn --shapes ${MSAR_SHAPES:-small medium} \
      --sources 5 --no-compile --timer graphs
    step gpu0 attnres_graphs "${GRAPHS_LIMIT:-90}" python3 -m benchmarks.ops_attnres --shapes small --ops block \
      --impls fused fast-attnres "fla fused_attnres" --timer graphs
    step gpu0 msar_events "${EVENTS_LIMIT:-70}" python3 -m benchmarks.msar_attn --shapes medium --sources 5 --no-compile
    ;;
  ops_wide)
    # the depth-attention op beside its reference (and torch.compile of it at medium) at the issue's wider shapes
    step gpu0 ops_medium "${OPS_LIMIT:-130}" python3 -m benchmarks.ops_attnres --shapes medium --impls fused reference \
      "torch.compile(reference)"
    step gpu0 ops_d2048 "${OPS2048_LIMIT:-100}" python3 -m benchmarks.ops_attnres --shapes d2048 --impls fused reference
    ;;
  dtiles)
    step gpu0 dtiles "${DTILES_LIMIT:-240}" python3 -m benchmarks.depth_attn_tiles --shapes ${DTILES_SHAPES:-small} ${DTILES_ARGS:-}
    ;;
  counters)
    for op in ${COUNTER_OPS:-mhc msar attnres}; do
      counters_of "$op" "${COUNTER_LIMIT:-90}"
    done
    ;;
  scope)
    step gpu0 tiles "${TILES_LIMIT:-100}" python3 -m benchmarks.throughput --models small --residuals vanilla \
      --compile model --graphs on --steps 8 --set 'model.flex_fwd=[]' 'model.flex_bwd=[]' --set --tag ${TAG:-_tiles}
    step gpu0 scope "${SCOPE_LIMIT:-330}" python3 -m benchmarks.throughput --models small \
      --residuals ${SCOPE_RESIDUALS:-vanilla attnres attnres_block mhc msar_block} --compile on model --graphs on \
      --steps 8 --tag ${TAG:-_scope}
    [ "${FLEX_SHAPES:-medium}" != none ] && step gpu0 flex "${FLEX_LIMIT:-110}" python3 -m benchmarks.flex_tiles --quick \
      --shapes ${FLEX_SHAPES:-medium} --budget ${FLEX_BUDGET:-90} --tag _quick
    ;;
  lr)
    step all lr "${LR_LIMIT:-500}" "${STUDY[@]}" compare.runs="[${LR_RUNS:-vanilla,attnres_block,msar_block}]" \
      compare.seeds="[${SEEDS:-0,1,2}]" trainer.lr="${LR:-3e-3}" compare.name="lr_${LR:-3e-3}_small" \
      compare.report="benchmarks/results/compare_lr_${LR:-3e-3}_small.md" compare.workers="${STUDY_WORKERS:-8}"
    ;;
  scaling)
    (export CUDA_VISIBLE_DEVICES=1; throughput gpu1 200) &
    (export CUDA_VISIBLE_DEVICES=0; step gpu0 scaling "${SCALING_LIMIT:-540}" "${SCALING[@]}" scaling.workers=4) &
    wait
    ;;
esac
find benchmarks/results -maxdepth 1 -newer "$OUTDIR/.started" -type f -exec cp {} "$OUTDIR/" \;
cat "$OUTDIR/summary.txt"
tar czf "$ARCHIVE" "$OUTDIR" $( [ -d mlruns ] && echo mlruns ) $(ls -d outputs/compare/*/runs/*/train.log outputs/scaling/*/logs 2>/dev/null)
