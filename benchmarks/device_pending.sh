#!/usr/bin/env bash
# One device call for what was built without a GPU and has not compiled or been measured yet, most needed first.
# Carry .baselines (mamba_ssm source) and .wheels (pytest-xdist, execnet, fla); benchmarks/fetch_device_wheels.sh
# rebuilds both where a checkout lacks them (git does not hold them).
# Usage on the GPU machine:  OUT=... bash benchmarks/device_pending.sh [steps...]
#   steps (default: tests dsweep sweep: the GPU suite and both sweeps of record; session 21 ran every step built
#   before it). The device returns at most 8 files, no more than 2 folders below $OUT: steps keep to that. Steps
#   that run a benchmark outside pytest need the package importable: this script installs it; a bare command needs
#   PYTHONPATH=$PWD.
#   tests      GPU tests of every Mamba-2 / delta kernel (pytest -n 6 when pytest-xdist is carried)
#   ncu        Nsight Compute on one launch each of $NCU_SPECS ("kernel,family,geom,dtype,cursor,skip"; default: the
#              KDA apply / window and the Mamba-2 pass bf16 / fp32 at bs256, non-flush), benchmarks/diag_ncu_step.py
#   maxnreg    the delta checkpoint pass's register cap vs uncapped, bs256 ($DR);  s18v  its GPU tests and bs 8-512
#   tests16    session 16's changes on the GPU: 300 staggered rows, the inline tests through the memo's shared
#              fake / TensorBox key, validation stopping after its last check
#   pdlchain   issue 3: launch-chain configs $M2P at bs 128 / 256 after the PDL GPU tests (session 17: flush_pdl,
#              zero_pdl; flush_pdl lost and was removed, zero_pdl became the default)
#   bf16diag   issue 3: the bf16 checkpoint's stream ceiling and the pre step's per-launch times at bs 128 / 512
#   m2flags    issue 3: $M2F configs vs the default at bs 128 / 256 (session 16: flush_flags=1, since removed)
#   bs1default issue 5's batch 1 in default mode (combo kernels on for our graphs since session 15), 3 models
#   final15    session 15's last call: Qwen3.5 fp32 parity in default mode, bs1 default, bs256 reduce-overhead
#   combo      combo kernels and static launch of our kernels at bs1, default mode
#   prof2      default-mode bs1 launcher census (diag_step_profile --census) and static launch of our kernels
#   dbreak     diag_stream_ceiling.py --delta: per-kernel time of the GDN / KDA split step for $DK configs, bs256
#   dconfigs   bench_delta_kernel.py --configs $DK: the same configs as whole steps vs fla, bs256, fp32
#   sweep      the Mamba-2 kernel sweep (bench_mamba2_kernel.py) with the session-8 defaults
#   desync     the delta step desynchronised (every row at its own ring position) and lockstep, bs 128-512 fp32
#   kdacfg     session 21: KDA bs256 split configs $KC (register cap 104-136, window warps, flush stages)
#   dtests     the delta kernel tests only;  dsweep  the delta kernel sweep vs fla (bench_delta_kernel.py)
#   e2e_qwen   replay-compile bench, Qwen3.5-4B dims, 8 layers, bs 1 and 256, reduce-overhead both sides
#   check_mamba2  256-token greedy parity at fp32 of the Mamba-2-only model (issue 5)
#   ksmall     small-batch configs $KS of the delta kernels (KDA bs1 0.88x, bs2-8 0.68-0.80x of fla)
#   m2tests    the Mamba-2 GPU tests only (kernels, read copy, the mamba_ssm anchor, inline kernels)
#   m2hints    session 23: the Mamba-2 window scratch's L2 hint on and off, bs 128-512
#   (m2chunks, m2inline: session 23 measured p_chunks and window_inline, both lost and were removed;
#   results/s23/)
#   m2bs128    Mamba-2 pre-step tile / warp configs at bs128 (non-flush at 85% of the floor; issue 3 asks 90%)
#   spec       the speculative verify kernels' window warps and slice width at bs256 (issue 6)
#   rcbreak    the delta read copy's per-kernel times for slice configs (issue 7)
#   ftests     GPU tests of the delta, delta read-copy and both spec-verify kernels (session-8 defaults)
#   dsmall     the delta sweep at bs 1, 2, 4, 8 (fused / split crossover), fp32
#   specsweep  the T=4 verify+commit sweep, both geometries, bs 1..512 (issue 6)
#   e2e_rc     Qwen3.5-4B dims, 8 layers, bs256: exact replay vs the fp8 delta read copy vs plain (issue 7)
#   e2e_nem    Nemotron-Nano-4B dims, 8 layers, bs 1 and 256, reduce-overhead both sides (issue 5)
#   check_qwen 256-token greedy parity at fp32 of Qwen3.5-4B dims (issue 5)
#   e2e_full   issue 5's whole sweep on every GPU of the host (kind nvidia-h200-x2: --gpus 2), $E2E_MODELS
#   spec_copy  issue 6's end-to-end prompt lookup on a repetitive prompt set: each model first trained on the copy
#              task (testing/copy_task.py) so that it continues repeated phrases, then generate vs our loop
#   flushgrid  the listed flush walks with more programs per SM: the read copy's flush step got 25% slower when
#              listed (fp8 1567 -> 1957 µs at bs256, 1-warp programs, 32 per SM), so try 64 and 128 per SM (and the
#              full grid) for it, and 48 / 64 warps per SM for the exact Mamba-2 flush walk
#   rctests    GPU tests of both read-copy kernels;  rcflush  the Mamba-2 fp8 read copy's flush with the hardware
#              e4m3 rounding (hw_e4m3) and flush tiles, bs256 ($RCF);  rcapply  the non-flush copy pass's tile and warps,
#              bs256 ($RCA);  rcdelta  the delta read copy with and without hw_e4m3. nvfp4_row
#              (tensor scale per row, encoded inside the flush launch) beside nvfp4 in both
#   prof1      issue 5's batch-1 question: kernels, launches and device time per whole decode step, plain
#              torch.compile vs replayssm (reduce-overhead both), Nemotron-Nano and Qwen3.5 dims, 8 layers
#   inlinediag the inline tests with their failures in full, and diag_inline.py on $INLINE_CASES (per-step diffs,
#              generated code)
#   inlinefinal the inline tests, then default-mode whole steps (inlined) at bs 1 / 32 for the three models, and
#              Nemotron bs32 with REPLAY_COMPILE_INLINE_KERNELS=0 (the pre kernels opaque)
#   cold       issue 5's compile time: every mode compiled cold in its own process (bench --cold-compile), bs1
#   coldrep    issue 5's cold compile, bench --cold-compile --rounds $COLD_ROUNDS (3) of $COLD_MODES, $E2E_MODELS
#   coldq      Qwen3.5's cold compile: plain, ours, ours without the memoised mutation analysis; compile phases
#   bs1rounds  issue 5's batch-1 targets, both modes, --rounds 2 (modes in alternating order, averaged), $E2E_MODELS
#   inline256  Nemotron-Nano dims bs256, default mode and reduce-overhead, with REPLAY_COMPILE_INLINE_KERNELS=1 (the
#              default: latency variants only), all and 0: step time and decode-loop peak (the ~2 GiB question)
#   pdl        programmatic dependent launch (the window launch's checkpoint pass starts at once): GPU tests (PDL
#              on / off bit-identical, the kernel tests, the inline tests), Mamba-2 pre and delta split with and
#              without it (bs 32 / 128 / 256, fp32; issue 3's bs128 non-flush, issue 4's KDA)
#   nvmma      issue 7's NVFP4 non-flush readout on tensor cores (nvfp4_mma), the copy pass forming the window
#              (win_cb) and the cheaper nvfp4 encode: their tests, per-kernel times of the nvfp4 step (Super bs256)
#              and whole steps vs selective_state_update at bs 128 / 256 for $NVC configs; bf16 / fp8 with win_cb
#   rcfinal    the read-copy GPU tests (both families) and the exact Mamba-2 kernel tests, then the Mamba-2 read-copy
#              sweep with the session-13 defaults (bf16 / fp8 / nvfp4 vs selective_state_update, bs 1..512)
#   rcsmall    the read copies at bs 1 / 8 / 32, the pre step against the one-launch fused kernel (0.42-0.52x of
#              selective_state_update at bs1 with pre, session 13): for a batch threshold
#   m2cfg      issue 3's non-flush floor at bs128: the pre step's per-launch device times (fp32, both geometries) and
#              $M2C at bs 128 / 256 for $M2D (default bf16 and fp32): the padded window head axis (win_pad=1: Nano's
#              12 heads per group in one program, not three; its window launch is 6.5 µs vs Super's 5.0) and 32-row
#              apply tiles
#   inlinefix  the inline GPU tests (incl. the strided decay), then Nemotron bs256 (inline all / 0) and the Mamba-2
#              model at bs32 (plain, inline default, all) in default mode: step time and decode-loop peak
#   hostprof   diag_host_overhead.py under cProfile (where an op call's host time goes, dispatcher vs Triton entry)
#   host       diag_host_overhead.py (host µs per op call, dispatcher vs Triton entry) and the default-mode (no CUDA
#              graphs) whole step of Qwen3.5-4B / Nemotron-Nano-4B dims at bs 1 and 256 (issue 5)
#   rcdefaults the Mamba-2 read copies' defaults at bs256 (issue 7's table);  dquick  the delta kernels' defaults
#              vs fla at bs 1 and 256, fp32 (issue 4's targets)
#   knobs readcopy anchor compile: session 7's pending measurements (done in session 8's first call)
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# the install log stays out of $OUT (8 files come back at most) unless an install fails
INSTALL_LOG=/tmp/install.log
python3 -m pip install -q --no-build-isolation --no-deps -e . > $INSTALL_LOG 2>&1 || cp $INSTALL_LOG "$OUT/"
if ls .wheels/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps .wheels/fla_core-*.whl .wheels/flash_linear_attention-*.whl >> $INSTALL_LOG 2>&1 \
    || cp $INSTALL_LOG "$OUT/"
fi
# delta configurations to compare at bs256 (kernels/delta_triton.py TUNING; the default first). Session 15 measured
# (and dropped) 2 / 4 value heads per window program, flush_stages=8|16 and the fused kernel on 128-wide rows
DK=${DK:-"split;split:flush_stages=2;split:BLOCK_V=64,num_warps=4"}
# the default-mode batch-1 profile: where Qwen3.5's step loses ~60 µs per GDN layer (session 14)
PROF_MODELS=${PROF_MODELS:-qwen35_4b}
PROF_MODES=${PROF_MODES:-inductor,replayssm}
# small-batch delta configurations (the default fused kernel first: 32-wide slices, 4 warps)
KS=${KS:-"fused;fused:BLOCK_V=64,num_warps=4;fused:BLOCK_V=64,num_warps=8;fused:BLOCK_V=128,num_warps=8;fused:num_warps=2"}
SG=";window_warps=1;window_warps=1,BLOCK_V=32,num_warps=2;window_warps=2,BLOCK_V=32,num_warps=2"
SG="$SG;window_warps=1,BLOCK_V=32,num_warps=1"
# session 21's KDA configurations (the default split first)
KC=${KC:-"split;split:maxnreg=104;split:maxnreg=112;split:maxnreg=120;split:maxnreg=136;split:window_warps=2"}
KC="$KC${KC_MORE-;split:flush_stages=3;split:flush_stages=5;split}"
XDIST=""
if ls .wheels/pytest_xdist-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps .wheels/pytest_xdist-*.whl .wheels/execnet-*.whl >> $INSTALL_LOG 2>&1 \
    && XDIST="-n 6"
fi
# Nsight Compute's command line (empty where none is installed)
ncu_path() { command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; }
steps=${*:-tests dsweep sweep}
for s in $steps; do echo "== step $s at ${SECONDS}s"; case $s in
  tests) timeout 300 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_mamba2_triton_gpu.py \
           tests/test_mamba2_triton.py tests/test_mamba2_readcopy.py tests/test_delta_readcopy_triton.py --tb=line \
           tests/test_delta_triton.py tests/test_delta_triton_gpu.py tests/test_kernel_call_anchor.py \
           tests/test_inline_kernels_gpu.py -p no:logging 2>&1 \
           | grep -v "warnings.warn" | tail -40 | tee "$OUT/pytest.txt" ;;
  ncu)     # Nsight Compute on one non-flush launch each: KDA's checkpoint pass and window launch (issue 4, bs256 fp32)
           # and the Mamba-2 pass on a bf16 Super checkpoint (issue 3, bs256 at 87-88% of the floor)
           NCU=$(ncu_path)
           echo "ncu: ${NCU:-none}" | tee "$OUT/ncu.txt"
           SECS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats"
           if [ -n "$NCU" ]; then
             # kernel, family, geometry, checkpoint dtype, cursor (15 of L = 16: a flush step), launches to skip
             for spec in ${NCU_SPECS:-"_delta_apply_kernel,delta,kimi_linear,float32,7,3" \
                         "_delta_window_rows_kernel,delta,kimi_linear,float32,7,3" \
                         "_mamba2_prepass_apply_kernel,mamba2,super,bfloat16,7,3" \
                         "_mamba2_prepass_apply_kernel,mamba2,super,float32,7,3"}; do
               IFS=, read -r kn fam geom sd cur skip <<< "$spec"
               echo "=== $kn $fam $geom $sd cursor $cur" >> "$OUT/ncu.txt"
               timeout 150 $NCU --kernel-name regex:"^$kn\$" --launch-skip $skip --launch-count 1 $SECS \
                 python3 benchmarks/diag_ncu_step.py --family $fam --geom $geom --batch 256 --state-dtype $sd \
                 --cursor $cur --steps $((skip + 1)) >> "$OUT/ncu.txt" 2>&1
             done
           fi ;;
  ncu1)    # session 19: batch 1, ours (fused, non-flush) against fla's kernel on the same inputs, KDA and GDN: duration,
           # stall reasons, launch statistics (KDA bs1 4.9 vs fla 4.5-4.8 µs in graph replays)
           NCU=$(ncu_path)
           SECS="--section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis"
           for geom in kimi_linear qwen35_4b; do
             for who in "" "--baseline"; do
               kn=$([ -z "$who" ] && echo "_delta_replay_step_kernel" || echo "fused_recurrent.*")
               echo "=== $geom ${who:-ours}" >> "$OUT/ncu1.txt"
               timeout 120 $NCU --kernel-name regex:"$kn" --launch-skip 3 --launch-count 1 $SECS \
                 python3 benchmarks/diag_ncu_step.py --family delta --geom $geom --batch 1 --cursor 7 --steps 5 $who \
                 >> "$OUT/ncu1.txt" 2>&1
             done
           done
           grep -E "===|Duration|Registers Per|Elapsed Cycles|Memory Throughput|Stall|Warp Cycles Per Issued|Issued Ipc" \
             "$OUT/ncu1.txt" | head -80 ;;
  maxnreg) # session 18: the delta checkpoint pass's register cap (ncu: 161 registers held it to 6 programs, 12 warps
           # per SM; capped at 128 by default from 8192 rows x value heads since), bs256. (The Mamba-2 pass lost with
           # any cap: spills)
           timeout 200 python3 benchmarks/bench_delta_kernel.py --out /tmp/dmnr --batches 256 \
           --geoms kimi_linear,qwen35_4b --configs "${DR:-split:maxnreg=0;split;split:maxnreg=96;split:num_warps=4}" \
           2>&1 | grep -v Warn | tee "$OUT/delta_maxnreg.txt" ;;
  s18v)    # session 18: the delta checkpoint pass capped at 128 registers: GPU tests, then capped (forced: maxnreg=128)
           # against uncapped (maxnreg=0) at the other split batches
           timeout 200 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_delta_triton.py \
           tests/test_delta_triton_gpu.py tests/test_delta_readcopy_triton.py --tb=short 2>&1 | tail -3 \
           | tee "$OUT/pytest_delta_maxnreg.txt"
           timeout 240 python3 benchmarks/bench_delta_kernel.py --out /tmp/dmnr2 --batches ${DRB:-8,32,128,512} \
           --geoms kimi_linear,qwen35_4b --configs "split:maxnreg=0;split:maxnreg=128" 2>&1 | grep -v Warn \
           | tee "$OUT/delta_maxnreg_batches.txt" ;;
  cumgates) # branch cumgates (session 18): the delta rings hold summed log-gates, so no window scan. GPU tests of
           # every delta kernel first, then bs 1 / 2 / 4 and bs256 vs fla (main, same H200: KDA bs1 5.3 µs, 0.88x;
           # bs256 L-avg 186.5 µs, 1.44x; GDN-4B bs1 3.9 µs, 0.94x; removing the scan by hand gave KDA bs1 4.71 µs)
           timeout 240 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_delta_triton.py \
           tests/test_delta_triton_gpu.py tests/test_delta_readcopy_triton.py tests/test_delta_spec_triton.py \
           tests/test_spec_baselines.py --tb=short 2>&1 | grep -v "warnings.warn" | tail -8 | tee "$OUT/pytest_cumgates.txt"
           timeout 150 python3 benchmarks/bench_delta_kernel.py --out /tmp/cg1 --batches 1,2,4,256 \
           --geoms kimi_linear,qwen35_4b --configs "fused;split" 2>&1 | grep -v Warn | tee "$OUT/delta_cumgates.txt"
           timeout 280 python3 benchmarks/bench_delta_kernel.py --out "$OUT" 2>&1 | grep -v Warn \
           | tee "$OUT/delta_sweep.txt" ;;
  s19)     # session 19: the fused delta kernel and Mamba-2's whole kernel issue every load before the cursor atomic
           # (SASS showed the atomic, its barrier, then the loads). GPU tests of both, fused configs at bs 1 / 2 vs fla,
           # the Mamba-2 sweep at bs 1 / 8 (s18: Super fp32 1.28x, bf16 1.11x, Nano 1.16x / 1.05x at bs1)
           timeout 200 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_delta_triton_gpu.py \
           tests/test_mamba2_triton_gpu.py tests/test_delta_triton.py --tb=short 2>&1 | grep -v "warnings.warn" \
           | tail -4 | tee "$OUT/pytest_s19.txt"
           timeout 150 python3 benchmarks/bench_delta_kernel.py --out /tmp/s19 --batches 1,2 \
           --geoms kimi_linear,qwen35_4b --configs "${FK:-fused;fused:num_warps=2;fused:num_warps=8;fused:BLOCK_V=64,num_warps=4;fused:BLOCK_V=16,num_warps=2}" \
           2>&1 | grep -v Warn | tee "$OUT/delta_fused_s19.txt"
           timeout 150 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/s19m --batches 1,8 2>&1 | grep -v Warn \
           | tee "$OUT/mamba2_small_s19.txt" ;;
  dbreak) timeout 200 python3 benchmarks/diag_stream_ceiling.py --delta qwen35_4b,kimi_linear \
           --delta-configs "$DK" \
           2>&1 | grep -v Warn | tee "$OUT/delta_breakdown_knobs.txt" ;;
  dconfigs) timeout 300 python3 benchmarks/bench_delta_kernel.py --out "$OUT" --batches 256 \
           --geoms qwen35_4b,kimi_linear --configs "$DK" 2>&1 | grep -v Warn | tee "$OUT/delta_configs.txt" ;;
  dtests) timeout 150 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_delta_triton.py \
           tests/test_delta_triton_gpu.py tests/test_delta_readcopy_triton.py --tb=line 2>&1 | grep -v "warnings.warn" \
           | tail -20 | tee "$OUT/pytest_delta.txt" ;;
  dsweep) timeout 280 python3 benchmarks/bench_delta_kernel.py --out "$OUT" 2>&1 | grep -v Warn \
           | tee "$OUT/delta_sweep.txt" ;;
  gluon)   # session 20: the KDA flush fold on the tensor cores in Gluon (mma_v2, the slice in the accumulator's layout),
           # checked against the FMA record loop on the same inputs and timed beside it, bs256 fp32, every row flushing
           timeout 150 python3 benchmarks/diag_delta_gluon.py 2>&1 | grep -v Warn | tee "$OUT/delta_gluon.txt" ;;
  kdacfg)  # session 21: KDA's split step at bs256 (1.5x needs ~3 µs less L-avg): the pass's register cap around 128
           # (104 / 112: 9 programs of 2 warps per SM instead of 8; 136: 7), the window launch on 2 warps, 3 / 5 flush
           # stages; fp32, vs fla in the same call ($KC)
           timeout 200 python3 benchmarks/bench_delta_kernel.py --out /tmp/kdacfg --batches ${KC_BATCHES:-256} \
           --geoms kimi_linear --configs "$KC" 2>&1 | grep -v Warn | tee "$OUT/kda_configs.txt" ;;
  desync)  # the delta step with every row at its own ring position (as in serving) beside lockstep, bs 128-512 fp32
           timeout 200 python3 benchmarks/bench_delta_kernel.py --out /tmp/desync --batches 128,256,512 --desync \
           --geoms kimi_linear,qwen35_4b --dtypes float32 2>&1 | grep -v Warn | tee "$OUT/delta_desync.txt" ;;
  gdnrows) # session 20: launch 1's rows form computes only the held records now; GDN keeps the tile form (session 9:
           # rows 17 vs tile 16 µs, before the skip). Both GDN geometries, fp32, vs fla in the same call
           timeout 200 python3 benchmarks/bench_delta_kernel.py --out /tmp/gdnrows --batches 8,64,128,256,512 \
           --geoms qwen35_4b,qwen35_122b --configs "split;split:window_rows=1" 2>&1 | grep -v Warn \
           | tee "$OUT/gdn_window_rows.txt" ;;
  e2e_qwen) timeout 200 replay-compile bench --models qwen35_4b --layers 8 --batches 1,256 --steps 32 \
           --modes inductor-ro,replayssm-ro --out "$OUT/e2e_qwen" 2>&1 | grep "^|" | tee "$OUT/e2e_qwen.txt" ;;
  check_mamba2) timeout 150 replay-compile bench --models mamba2_2p7b --layers 8 --check 256 --dtype float32 \
           --out "$OUT/check_mamba2" 2>&1 | tail -12 | tee "$OUT/check_mamba2.txt" ;;
  ksmall) timeout 200 python3 benchmarks/bench_delta_kernel.py --out "$OUT" --batches 1,2,4,8 \
           --geoms kimi_linear,qwen35_4b --configs "$KS" 2>&1 | grep -v Warn | tee "$OUT/delta_small_configs.txt" ;;
  spec) timeout 200 python3 benchmarks/bench_spec_step.py --out "$OUT/spec_gdn" --geoms qwen35_4b --batches 256 \
           --configs "$SG" 2>&1 | grep -v Warn | tee "$OUT/spec_configs.txt"
        timeout 120 python3 benchmarks/bench_spec_step.py --out "$OUT/spec_super" --geoms super --batches 256 \
           --configs ";window_warps=1;window_warps=2" 2>&1 | grep -v Warn | tee -a "$OUT/spec_configs.txt" ;;
  rcbreak) timeout 120 python3 benchmarks/diag_stream_ceiling.py --delta qwen35_4b --delta-configs "" \
           --delta-rc-configs "rc;rc:BLOCK_V=32,num_warps=2;rc:BLOCK_V=32,num_warps=1" 2>&1 | grep -v Warn \
           | tee "$OUT/delta_rc_breakdown.txt" ;;
  ftests) timeout 100 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_delta_triton.py \
           tests/test_delta_triton_gpu.py tests/test_delta_readcopy_triton.py tests/test_delta_spec_triton.py \
           tests/test_mamba2_spec_triton.py tests/test_spec_baselines.py --tb=line 2>&1 \
           | grep -v "warnings.warn\|Benchmark" | tail -8 | tee "$OUT/pytest_final.txt" ;;
  dsmall) timeout 60 python3 benchmarks/bench_delta_kernel.py --out "$OUT/dsmall" --batches 1,2,4,8 \
           --dtypes float32 --geoms qwen35_4b,kimi_linear 2>&1 | grep -v Warn | tee "$OUT/delta_small.txt" ;;
  specsweep) timeout 150 python3 benchmarks/bench_spec_step.py --out "$OUT/spec" --batches 1,32,256,512 2>&1 | grep -v Warn \
           | tee "$OUT/spec_sweep.txt" ;;
  e2e_rc) REPLAY_COMPILE_READ_COPY_FAMILIES=mamba2,gdn,kda timeout 240 replay-compile bench --models qwen35_4b \
           --layers 8 --batches 256 --steps 32 --modes inductor-ro,replayssm-ro,replayssm-ro:fp8_e4m3 \
           --out "$OUT/e2e_rc" 2>&1 | grep "^|" | tee "$OUT/e2e_rc.txt" ;;
  e2e_nem) timeout 150 replay-compile bench --models nemotron_h_nano4b --layers 8 --batches 1,256 --steps 32 \
           --modes inductor-ro,replayssm-ro --out "$OUT/e2e_nem" 2>&1 | grep "^|" | tee "$OUT/e2e_nem.txt" ;;
  check_qwen) timeout 120 replay-compile bench --models qwen35_4b --layers 8 --check 256 --dtype float32 \
           --out "$OUT/check_qwen" 2>&1 | tail -3 | tee "$OUT/check_qwen.txt" ;;
  e2e_full) # outputs outside $OUT, the merged files copied flat: the device returns 8 files at most, 2 folders deep
           # (session 9 lost a whole sweep to that: worker CSVs sat 3 folders down, the merge cut by the timeout)
           NG=$(nvidia-smi -L | wc -l); E2E=/tmp/e2e_full; rm -rf $E2E
           timeout 590 replay-compile bench --layers 8 --gpus "$NG" --time-limit "${E2E_LIMIT:-530}" \
           --models "${E2E_MODELS:-nemotron_h_nano4b,qwen35_4b,mamba2_2p7b}" --batches "${E2E_BATCHES:-1,8,32,64,128,256,512}" \
           --out $E2E 2>&1 | grep "^|\|worker\|wrote" | tee "$OUT/e2e_full.txt"
           for f in $E2E/worker*/*/log.txt; do echo "== $f"; tail -3 "$f"; done >> "$OUT/e2e_full.txt" 2>/dev/null
           cp $E2E/bench.csv $E2E/bench.md "$OUT/" 2>/dev/null; cp $E2E/*.png "$OUT/" 2>/dev/null ;;
  spec_copy) timeout 400 python3 benchmarks/bench_spec_generate.py --out "$OUT/spec_copy" --train-copy 600 \
           --models "${GEN_MODELS:-nemotron_h_nano4b,qwen35_4b}" --batches 1,8,32 --layers 8 --new 64 2>&1 \
           | grep -v "^\[transformers\]" | tee "$OUT/spec_copy.txt" ;;
  flushgrid) SM=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)")
           timeout 200 python3 benchmarks/bench_readcopy_kernel.py --out "$OUT/flushgrid" --batches 256 \
           --configs "pre:;pre:flush_programs=$((64 * SM));pre:flush_programs=$((128 * SM));pre:flush_list=0" 2>&1 \
           | grep -v Warn | tee "$OUT/readcopy_flushgrid.txt"
           timeout 150 python3 benchmarks/bench_mamba2_kernel.py --out "$OUT/flushgrid" --batches 128,256 \
           --configs "pre;pre:flush_per_sm=12;pre:flush_per_sm=16" 2>&1 | grep -v Warn \
           | tee "$OUT/mamba2_flushgrid.txt" ;;
  rctests) timeout 200 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_mamba2_readcopy.py \
           tests/test_delta_readcopy_triton.py tests/test_delta_triton.py tests/test_delta_triton_gpu.py --tb=line \
           2>&1 | grep -v "warnings.warn" | tail -8 \
           | tee "$OUT/pytest_readcopy.txt" ;;
  rcflush) timeout 240 python3 benchmarks/bench_readcopy_kernel.py --out "$OUT/rcflush" --batches 256 \
           --formats fp8_e4m3,nvfp4,nvfp4_row --configs "${RCF:-pre:;pre:hw_e4m3=1;pre:hw_e4m3=1,FLUSH_P=16,flush_warps=1;pre:hw_e4m3=1,FLUSH_P=16,flush_warps=4;pre:enc_warps=4;pre:enc_warps=2}" \
           2>&1 | grep -v Warn | tee "$OUT/readcopy_flush_configs.txt" ;;
  rcapply) timeout 240 python3 benchmarks/bench_readcopy_kernel.py --out "$OUT/rcapply" --batches 256 \
           --formats fp8_e4m3,nvfp4_row --configs "${RCA:-pre:;pre:APPLY_P=16;pre:APPLY_P=32,apply_warps=2;pre:APPLY_P=64,apply_warps=2;pre:APPLY_P=64,apply_warps=4}" \
           2>&1 | grep -v Warn | tee "$OUT/readcopy_apply_configs.txt" ;;
  rcdelta) timeout 120 python3 benchmarks/diag_stream_ceiling.py --delta qwen35_4b,kimi_linear --delta-configs "" \
           --delta-rc-configs "rc;rc:hw_e4m3=0" 2>&1 | grep -v Warn \
           | tee "$OUT/delta_rc_flush_stages.txt" ;;
  inlinediag) timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_inline_kernels_gpu.py \
           --tb=short 2>&1 | grep -v "warnings.warn" | tail -150 > "$OUT/pytest_inline.txt"; tail -12 "$OUT/pytest_inline.txt"
         timeout 200 python3 benchmarks/diag_inline.py --out "$OUT/inline_code" --cases ${INLINE_CASES:-1,3,8} 2>&1 \
           | grep -v Warn | tee "$OUT/inline_diag.txt" ;;
  inlinefinal) timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_inline_kernels_gpu.py \
           --tb=short 2>&1 | grep -v "warnings.warn" | tail -60 > "$OUT/pytest_inline.txt"; tail -6 "$OUT/pytest_inline.txt"
         timeout 330 replay-compile bench --models nemotron_h_nano4b,qwen35_4b,mamba2_2p7b --layers 8 --batches 1,32 \
           --steps 32 --modes inductor,replayssm --out /tmp/e2e_if 2>&1 | grep "^|" | tee "$OUT/inline_default_mode.txt"
         REPLAY_COMPILE_INLINE_KERNELS=0 timeout 60 replay-compile bench --models nemotron_h_nano4b --layers 8 \
           --batches 32 --steps 32 --modes replayssm --out /tmp/e2e_of 2>&1 | grep "^|" \
           | tee -a "$OUT/inline_default_mode.txt" ;;
  bs1rounds) timeout 560 replay-compile bench --models ${E2E_MODELS:-nemotron_h_nano4b,qwen35_4b,mamba2_2p7b} \
           --layers 8 --batches 1 --steps 32 --rounds 2 --modes inductor,replayssm,inductor-ro,replayssm-ro \
           --out /tmp/e2e_bs1r 2>&1 | grep "^|" | tee "$OUT/bs1_rounds.txt" ;;
  tests16) timeout 150 python3 -m pytest -q $XDIST -p no:cacheprovider -p no:logging tests/test_mamba2_triton_gpu.py \
           tests/test_inline_kernels_gpu.py tests/test_mutation_cache.py tests/test_pass_spellings.py --tb=short \
           -k "staggered or inline or mutation or lowering or validation or install" 2>&1 \
           | grep -v "warnings.warn" | tail -25 | tee "$OUT/pytest16.txt" ;;
  bs1default) # issue 5's batch 1 in default mode with the shipped combo kernels: 3 models, 2 rounds (alternating)
           timeout 420 replay-compile bench --models ${E2E_MODELS:-nemotron_h_nano4b,qwen35_4b,mamba2_2p7b} \
           --layers 8 --batches 1 --steps 32 --rounds 2 --modes inductor,replayssm --out /tmp/e2e_bs1d 2>&1 \
           | grep "^|" | tee "$OUT/bs1_default.txt" ;;
  pdlchain) # issue 3's bs128 non-flush: the PDL chain (zeroing -> window -> pass -> listed flush), GPU tests first
           timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_mamba2_triton.py \
           -k "pdl or poisoned or launch_options" --tb=short 2>&1 | tail -15 | tee "$OUT/pytest_pdlchain.txt"
           timeout 330 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/pdlchain --batches 128,256 \
           --configs "${M2P:-pre;pre:zero_pdl=0}" 2>&1 | grep -v Warn \
           | tee "$OUT/mamba2_pdlchain.txt" ;;
  bf16diag) # issue 3's bf16 cells: what a bf16 checkpoint stream reaches (GEMV tiles, whole heads per program) and
           # the pre step's per-launch times, bs 128 and 512
           for bs in ${BF_BATCHES:-128 512}; do timeout 120 python3 benchmarks/diag_stream_ceiling.py \
           --state-dtype ${BF_DTYPE:-bfloat16} --batch $bs 2>&1 | grep -v Warn; done | tee "$OUT/bf16_ceiling.txt" ;;
  m2flags) timeout 240 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/m2flags --batches 128,256 \
           --configs "${M2F:-pre}" 2>&1 | grep -v Warn | tee "$OUT/mamba2_flush_flags.txt" ;;
  cold)    # issue 5's compile-time target: every mode compiled cold in a process of its own (bench --cold-compile)
           timeout 580 replay-compile bench --models ${E2E_MODELS:-nemotron_h_nano4b,qwen35_4b,mamba2_2p7b} \
           --layers 8 --batches ${COLD_BATCHES:-1} --steps 8 --cold-compile --time-limit 540 \
           --modes ${COLD_MODES:-inductor-ro,replayssm-ro,inductor,replayssm} --out /tmp/cold 2>&1 | grep -v Warn \
           | tail -30 | tee "$OUT/cold_compile.txt" ;;
  coldrep) # issue 5's compile time, repeated: one cold sample per mode swung 12.5-20.3 s for plain alone (sessions
           # 14-16); bench --cold-compile --rounds: every round of every mode cold in its own process, alternating
           # order, first steps averaged (each round's kept in the CSV); the pass and its check as phases
           REPLAY_COMPILE_BENCH_COMPILE_TIMES=1 timeout ${COLD_LIMIT:-560} replay-compile bench \
             --models ${E2E_MODELS:-qwen35_4b} --layers 8 --batches 1 --steps 8 --cold-compile \
             --rounds ${COLD_ROUNDS:-3} --time-limit $(( ${COLD_LIMIT:-560} - 20 )) \
             --modes ${COLD_MODES:-inductor,replayssm} --out /tmp/coldrep 2>&1 | grep "^| \|^#\|worker" \
             | tee "$OUT/cold_rounds.txt"
           cp /tmp/coldrep/bench.csv "$OUT/cold_rounds.csv" 2>/dev/null
           for f in /tmp/coldrep/worker0/*/log.txt; do echo "== $f"; grep -A90 "compile times" $f | grep -v Warn \
             | grep -i "compile_inner\|call_user\|aot_collect\|fw_compiler\|async_compile\|replay_compile"; \
             done > "$OUT/cold_rounds_phases.txt" ;;
  coldq)   # Qwen3.5's cold compile (1.08-1.27x of plain in session 14): plain, ours (the mutation analysis memoised,
           # ops/mutation_cache.py) and ours with REPLAY_COMPILE_MUTATION_CACHE=0; dynamo's compile phases per run
           for arm in "1 ${COLDQ_MODES:-inductor-ro,replayssm-ro}" "0 replayssm-ro"; do set -- $arm
             mkdir -p /tmp/coldq$1; REPLAY_COMPILE_MUTATION_CACHE=$1 REPLAY_COMPILE_BENCH_COMPILE_TIMES=1 \
             timeout 280 replay-compile bench --models qwen35_4b --layers 8 --batches 1 --steps 8 --cold-compile \
             --modes $2 --out /tmp/coldq$1 2>&1 | grep "^|" | tee -a "$OUT/coldq.txt"
             for f in /tmp/coldq$1/worker0/*/log.txt; do echo "== mutation cache $1 $f"; grep -A90 "compile times" $f \
               | grep -v Warn | grep -i "compile_inner\|call_user\|aot_collect\|fw_compiler\|async_compile\|codegen\|replay_compile"; \
               done >> "$OUT/coldq_phases.txt"; done ;;
  inline256) for v in 1 all 0; do REPLAY_COMPILE_INLINE_KERNELS=$v timeout 200 replay-compile bench \
           --models nemotron_h_nano4b --layers 8 --batches 256 --steps 32 --modes replayssm,replayssm-ro \
           --out /tmp/e2e_i256_$v 2>&1 | grep "^| nem" | sed "s/^/inline=$v /" | tee -a "$OUT/inline_bs256.txt"; done ;;
  pdl) timeout 240 python3 -m pytest -q $XDIST -p no:cacheprovider -p no:logging tests/test_pdl.py \
           tests/test_mamba2_triton_gpu.py tests/test_delta_triton_gpu.py tests/test_inline_kernels_gpu.py --tb=short 2>&1 \
           | grep -v "warnings.warn" | tail -40 | tee "$OUT/pytest_pdl.txt"
         timeout 200 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/pdl_m2 --batches 32,128,256 --dtypes float32 \
           --configs "pre;pre:pdl=0" 2>&1 | grep -v Warn | tee "$OUT/pdl_mamba2.txt"
         timeout 200 python3 benchmarks/bench_delta_kernel.py --out /tmp/pdl_delta --batches 32,256 --dtypes float32 \
           --configs "split;split:pdl=0" 2>&1 | grep -v Warn | tee "$OUT/pdl_delta.txt" ;;
  nvmma) [ -z "${NVT-1}" ] || timeout 200 python3 -m pytest -q $XDIST -p no:cacheprovider -p no:logging tests/test_mamba2_readcopy.py \
           -k "mma or win_cb or e2m1 or encode or nvfp4_fold or (step_by_step and nvfp4)" --tb=short 2>&1 \
           | grep -v "warnings.warn" | tail -30 \
           | tee "$OUT/pytest_nvmma.txt"
         timeout 150 python3 benchmarks/diag_stream_ceiling.py --read-copy nvfp4 --geoms super --batch 256 \
           --rc-configs "${NVC:-;nvfp4_mma=1;nvfp4_mma=1,APPLY_P=32;nvfp4_mma=1,APPLY_P=64,apply_warps=4}" 2>&1 \
           | grep -v Warn | tee "$OUT/nvfp4_breakdown.txt"
         timeout 240 python3 benchmarks/bench_readcopy_kernel.py --out /tmp/nvmma --batches 128,256 --formats nvfp4 \
           --configs "${NVC:-;nvfp4_mma=1;nvfp4_mma=1,APPLY_P=32;nvfp4_mma=1,APPLY_P=64,apply_warps=4}" 2>&1 \
           | grep -v Warn | tee "$OUT/nvfp4_configs.txt"
         [ -z "${NVF2-bf16,fp8_e4m3}" ] || timeout 200 python3 benchmarks/bench_readcopy_kernel.py --out /tmp/rcwin \
           --batches 128,256 --formats ${NVF2-bf16,fp8_e4m3} --configs ";win_cb=1" 2>&1 | grep -v Warn \
           | tee -a "$OUT/nvfp4_configs.txt" ;;
  rcfinal) timeout 280 python3 -m pytest -q $XDIST -p no:cacheprovider -p no:logging tests/test_mamba2_readcopy.py \
           tests/test_delta_readcopy_triton.py tests/test_mamba2_triton_gpu.py tests/test_mamba2_triton.py --tb=short \
           2>&1 | grep -v "warnings.warn" | tail -30 | tee "$OUT/pytest_rcfinal.txt"
         timeout 280 python3 benchmarks/bench_readcopy_kernel.py --out "$OUT" --batches 1,8,32,128,256,512 2>&1 \
           | grep -v Warn | tee "$OUT/readcopy_sweep.txt" ;;
  rcsmall) timeout 240 python3 benchmarks/bench_readcopy_kernel.py --out /tmp/rcsmall --batches 1,8,32 \
           --configs ";fused:;fused:num_warps=2" 2>&1 | grep -v Warn | tee "$OUT/readcopy_small.txt" ;;
  m2cfg) timeout 150 python3 benchmarks/diag_stream_ceiling.py --breakdown-only --batch 128 2>&1 | grep -v Warn \
           | tee "$OUT/mamba2_breakdown_bs128.txt"
         timeout 300 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/m2cfg --batches 128,256 \
           --dtypes ${M2D:-bfloat16,float32} --configs "${M2C:-pre;pre:win_pad=1;pre:BLOCK_P=32,num_warps=2;pre:win_pad=1,BLOCK_P=32,num_warps=2}" \
           2>&1 | grep -v Warn | tee "$OUT/mamba2_configs.txt" ;;
  inlinefix) timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_inline_kernels_gpu.py \
           --tb=short 2>&1 | grep -v "warnings.warn" | tail -30 | tee "$OUT/pytest_inline.txt"
         for v in all 0; do REPLAY_COMPILE_INLINE_KERNELS=$v timeout 150 replay-compile bench --models nemotron_h_nano4b \
           --layers 8 --batches 256 --steps 32 --modes replayssm --out /tmp/e2e_if256_$v 2>&1 | grep "^| nem" \
           | sed "s/^/inline=$v /" | tee -a "$OUT/inline_fix.txt"; done
         timeout 150 replay-compile bench --models mamba2_2p7b --layers 8 --batches 32 --steps 32 --modes inductor,replayssm \
           --out /tmp/e2e_ifm1 2>&1 | grep "^| mam" | sed "s/^/inline=1 /" | tee -a "$OUT/inline_fix.txt"
         REPLAY_COMPILE_INLINE_KERNELS=all timeout 150 replay-compile bench --models mamba2_2p7b --layers 8 --batches 32 \
           --steps 32 --modes replayssm --out /tmp/e2e_ifma 2>&1 | grep "^| mam" | sed "s/^/inline=all /" \
           | tee -a "$OUT/inline_fix.txt" ;;
  hostprof) timeout 150 python3 -m cProfile -s tottime benchmarks/diag_host_overhead.py --calls 2000 2>&1 \
           | grep -v Warn | head -70 | tee "$OUT/host_cprofile.txt" ;;
  hostdiag) timeout 120 python3 benchmarks/diag_host_overhead.py 2>&1 | grep -v Warn | tee -a "$OUT/host_overhead.txt" ;;
  host) timeout 90 python3 benchmarks/diag_host_overhead.py 2>&1 | grep -v Warn | tee -a "$OUT/host_overhead.txt"
        timeout 300 replay-compile bench --models qwen35_4b,nemotron_h_nano4b --layers 8 --batches 1,256 --steps 32 \
           --modes inductor,replayssm --out /tmp/e2e_default 2>&1 | grep "^|" | tee -a "$OUT/host_overhead.txt" ;;
  rcdefaults) timeout 150 python3 benchmarks/bench_readcopy_kernel.py --out /tmp/rcdefaults --batches 256 \
           --formats bf16,fp8_e4m3,nvfp4 2>&1 | grep -v Warn | tee "$OUT/readcopy_defaults.txt" ;;
  dquick) timeout 150 python3 benchmarks/bench_delta_kernel.py --out /tmp/dquick --batches 1,256 --dtypes float32 \
           2>&1 | grep -v Warn | tee "$OUT/delta_defaults.txt" ;;
  combo)   # default mode at bs1 (issue 5): our graph has 5 small prologue kernels per GDN layer where plain Inductor
           # fuses them into its recurrence kernel; Inductor's combo kernels (horizontal fusion) for our compile, and
           # our kernels statically launched (the env var reaches the compile workers)
           TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=${COMBO_SL:-1} timeout 330 replay-compile bench \
             --models ${E2E_MODELS:-qwen35_4b,mamba2_2p7b} --layers 8 --batches 1 --steps 32 --rounds 2 \
             --modes inductor,replayssm,replayssm@combo_kernels=1,inductor@combo_kernels=1 --out /tmp/e2e_combo 2>&1 \
             | grep "^|" | tee "$OUT/combo_bs1.txt" ;;
  prof2)  # default mode's bs1 host cost (session 15: Qwen3.5 4.68 vs 4.13 ms per step under the profiler, device
           # 1.23 vs 1.36 ms): every Triton launch with its launcher, then our kernels statically launched
           # (TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1, read by the compile workers too); bench rounds
           for sl in 0 1; do echo "== static launch of user kernels: $sl"
             TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=$sl timeout 150 python3 \
             benchmarks/diag_step_profile.py --model qwen35_4b --batch 1 --layers 8 --modes inductor,replayssm \
             --census --cpu-rows 0 2>&1 | grep -v "^\[transformers\]\|Warn\|USDT\|Assertion" | tail -90; done \
             | tee "$OUT/census_bs1.txt"
           for sl in 0 1; do TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=$sl timeout 200 replay-compile \
             bench --models ${E2E_MODELS:-qwen35_4b} --layers 8 --batches 1 --steps 32 --rounds 2 \
             --modes inductor,replayssm --out /tmp/e2e_sl$sl 2>&1 | grep "^|" | sed "s/^/sl=$sl /"; done \
             | tee "$OUT/static_launch_bs1.txt" ;;
  prof1) for m in ${PROF_MODELS:-nemotron_h_nano4b qwen35_4b}; do timeout 200 python3 benchmarks/diag_step_profile.py \
           --model $m --batch ${PROF_BATCH:-1} --layers 8 ${PROF_MODES:+--modes $PROF_MODES} --cpu-rows 16 --py-rows 25 2>&1 | grep -v "^\[transformers\]\|Warn\|USDT" \
           | tail -150; done | tee "$OUT/profile_bs1.txt" ;;
  m2bs128) timeout 200 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/m2bs128 --batches 128 \
           --configs "pre;pre:BLOCK_P=32,num_warps=2;pre:BLOCK_P=32,num_warps=1;pre:BLOCK_P=8;pre:win_heads=8" 2>&1 \
           | grep -v Warn | tee "$OUT/mamba2_bs128.txt" ;;
  m2hints) # session 23 (issue 3's bf16 cells): the window scratch's L2 hint, default now, against it off ($M2H;
           # tiles as BLOCK_P / num_warps configs), bs 128 / 256 / 512, bf16 and fp32; GPU tests first
           timeout 120 python3 -m pytest -q $XDIST -p no:cacheprovider \
           tests/test_mamba2_triton.py -k "launch_options or bitwise" --tb=short 2>&1 | grep -v "warnings.warn" \
           | tail -4 | tee "$OUT/pytest_m2hints.txt"
           timeout 400 python3 benchmarks/bench_mamba2_kernel.py --out /tmp/m2hints --batches 128,256,512 \
           --dtypes bfloat16,float32 --configs "${M2H:-pre;pre:scratch_evict=0;pre}" \
           2>&1 | grep -v Warn | tee "$OUT/mamba2_hints.txt" ;;
  m2tests) timeout 200 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_mamba2_triton_gpu.py \
           tests/test_mamba2_triton.py tests/test_mamba2_readcopy.py tests/test_kernel_call_anchor.py \
           tests/test_inline_kernels_gpu.py --tb=short -p no:logging 2>&1 | grep -v "warnings.warn" | tail -12 \
           | tee "$OUT/pytest_mamba2.txt" ;;
  sweep) timeout 330 python3 benchmarks/bench_mamba2_kernel.py --out "$OUT" 2>&1 | grep -v Warn \
           | tee "$OUT/mamba2_sweep.txt" ;;
  breakdown) timeout 150 python3 benchmarks/diag_stream_ceiling.py --delta qwen35_4b,kimi_linear 2>&1 \
           | grep -v Warn | tee "$OUT/delta_breakdown.txt" ;;
  knobs) timeout 200 python3 benchmarks/bench_mamba2_kernel.py --out "$OUT" --batches 128,256 \
           --configs "pre;pre:apply_early_x=1;pre:fold_advance=1;pre:apply_early_x=1,fold_advance=1" 2>&1 \
           | grep -v Warn | tee "$OUT/pre_knobs.txt" ;;
  readcopy) timeout 200 python3 benchmarks/bench_readcopy_kernel.py --out "$OUT" --batches 128,256 \
           --configs "pre:;pre:flush_list=1" 2>&1 | grep -v Warn | tee "$OUT/readcopy_flush_list.txt" ;;
  anchor) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_call_anchor.py -k real 2>&1 \
           | tail -4 | tee "$OUT/anchor_gpu.txt" ;;
  compile) timeout 200 replay-compile bench --models mamba2_2p7b --layers 8 --batches 512 \
           --modes inductor-ro,replayssm-ro --out "$OUT/compile" 2>&1 | grep "^|" | tee "$OUT/compile_bs512.txt" ;;
esac; done
