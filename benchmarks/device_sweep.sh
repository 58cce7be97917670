#!/usr/bin/env bash
# One device call: kernel GPU tests, the full kernel sweep (both variants, baseline in the same run), the CUDA-graph
# check under the image's transformers and (if carried in .wheels/) a newer one, the mamba_ssm-form diagnostic, and
# the delta-rule kernel tests + sweep against fla (fla-core wheels carried in .wheels/:
#   pip download fla-core flash-linear-attention --no-deps -d .wheels).
# Usage on the GPU machine:  OUT=... bash benchmarks/device_sweep.sh [steps...]
#   (steps: tests sweep configs graphs form delta delta-configs; default: tests sweep graphs form)
#   configs: launch configs compared at $CONFIG_BATCHES (default 64,256) on both geometries; set $CONFIGS to
#   a ';'-separated list of mamba2_triton.parse_tuning strings.
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
if ls .wheels/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps .wheels/fla_core-*.whl .wheels/flash_linear_attention-*.whl >> "$OUT/install.log" 2>&1
fi
NEWTF=""
if ls .wheels/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target /tmp/newtf .wheels/*.whl >> "$OUT/install.log" 2>&1 && NEWTF=/tmp/newtf
fi
steps=${*:-tests sweep graphs form}
for s in $steps; do case $s in
  tests) timeout 200 python3 -m pytest -q tests/test_mamba2_triton_gpu.py tests/test_mamba2_triton.py \
           -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest_kernels.txt" ;;
  sweep) timeout 330 python3 benchmarks/bench_mamba2_kernel.py --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/sweep.txt" ;;
  configs) timeout 300 python3 benchmarks/bench_mamba2_kernel.py --out "$OUT" --batches "${CONFIG_BATCHES:-64,256}" \
            --configs "${CONFIGS:-whole;tiled}" 2>&1 | grep -v Warn | tee "$OUT/configs.txt" ;;
  delta-configs) timeout 100 python3 -m pytest -q tests/test_delta_triton_gpu.py -p no:cacheprovider 2>&1 | tail -3 \
           | tee "$OUT/pytest_delta_gpu.txt"
         timeout 240 python3 benchmarks/bench_delta_kernel.py --out "$OUT" --batches "${CONFIG_BATCHES:-1,32,256}" \
           --geoms qwen35_4b,kimi_linear --configs "${DELTA_CONFIGS:-fused;split}" 2>&1 | grep -v Warn \
           | tee "$OUT/delta_configs.txt" ;;
  graphs) timeout 120 python3 benchmarks/check_cudagraphs.py 2>&1 | grep -v "^\[transformers\]" | tail -8 \
            | tee "$OUT/cudagraphs.txt"
          [ -n "$NEWTF" ] && PYTHONPATH=$NEWTF timeout 120 python3 benchmarks/check_cudagraphs.py 2>&1 \
            | grep -v "^\[transformers\]" | tail -8 | tee "$OUT/cudagraphs_newtf.txt" ;;
  form) [ -n "$NEWTF" ] && PYTHONPATH=$NEWTF timeout 150 python3 benchmarks/diag_mamba_ssm_form.py \
          > "$OUT/diag_form_newtf.txt" 2>&1; grep -v "^      " "$OUT/diag_form_newtf.txt" | cut -c1-400 | tail -25 ;;
  delta) timeout 150 python3 -m pytest -q tests/test_delta_triton_gpu.py tests/test_delta_triton.py -p no:cacheprovider 2>&1 | tail -4 \
           | tee "$OUT/pytest_delta.txt"
         timeout 300 python3 benchmarks/bench_delta_kernel.py --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/delta_sweep.txt" ;;
esac; done
