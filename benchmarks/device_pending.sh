#!/usr/bin/env bash
# One device call for what was built without a GPU (session 7) and has not compiled or been measured yet, cheapest
# and most needed first. Carry .baselines (mamba_ssm source) and .wheels (pytest-xdist, execnet, fla).
# Usage on the GPU machine:  OUT=... bash benchmarks/device_pending.sh [steps...]
#   steps (default all, in this order): tests breakdown knobs readcopy anchor compile
#   tests      GPU tests of every Mamba-2 / delta kernel incl. the moved pre launches and the restructured read-copy
#              kernel (pytest -n 6 when pytest-xdist is carried)
#   breakdown  diag_stream_ceiling.py --delta: per-kernel time of the GDN / KDA step and the fp8 delta read copy
#              (flush_list 0 and 1), bs256
#   knobs      the pre step's apply_early_x / fold_advance at bs128 and 256 against the default
#   readcopy   the Mamba-2 read copy with flush_list=1 against the default, bs128 and 256
#   anchor     the second anchor against the real mamba_ssm kernel
#   compile    compile time at bs512 of the Mamba-2-only model (validation states now drawn on the GPU)
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
XDIST=""
if ls .wheels/pytest_xdist-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps .wheels/pytest_xdist-*.whl .wheels/execnet-*.whl >> "$OUT/install.log" 2>&1 \
    && XDIST="-n 6"
fi
steps=${*:-tests breakdown knobs readcopy anchor compile}
for s in $steps; do case $s in
  tests) timeout 300 python3 -m pytest -q $XDIST -p no:cacheprovider tests/test_mamba2_triton_gpu.py \
           tests/test_mamba2_triton.py tests/test_mamba2_readcopy.py tests/test_delta_readcopy_triton.py \
           tests/test_delta_triton.py tests/test_kernel_call_anchor.py 2>&1 | tail -8 | tee "$OUT/pytest.txt" ;;
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
