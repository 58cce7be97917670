#!/usr/bin/env bash
# One device call for speculative decoding: GPU tests of the verify kernels, the snapshot baselines and the compiled
# rounds; the T=4 verify+commit sweep against the per-draft snapshot baseline; end-to-end generation.
# Usage on the GPU machine:  OUT=... bash benchmarks/device_spec.sh [steps...]   (steps: tests step generate readcopy
#   readcopy-e2e)
#   readcopy: the read-copy kernel's tests compiled, then bench_readcopy_kernel.py (mamba_ssm from
#   .baselines/ when carried)
#   readcopy-e2e: the pass with read copies under CUDA graphs (check_cudagraphs.py, Mamba-2 and GDN), then
#   whole decode steps with fp8 / NVFP4 read copies beside plain torch.compile and the exact replay path
#   env: SPEC_BATCHES (step sweep, default 1,8,32,64,128,256,512), SPEC_GEOMS (default super,qwen35_4b),
#        GEN_BATCHES (default 1,32,256), GEN_MODELS (default nemotron_h_nano4b,qwen35_4b), GEN_LAYERS (default 8)
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
steps=${*:-tests step generate}
for s in $steps; do case $s in
  tests) timeout 240 python3 -m pytest -q tests/test_mamba2_spec_triton.py tests/test_delta_spec_triton.py \
           tests/test_spec_baselines.py tests/test_delta_spec_reference.py tests/test_mamba2_spec_reference.py \
           tests/test_speculative_compiled.py tests/test_speculative_generate.py tests/test_speculative_cuda.py \
           -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/pytest_spec.txt" ;;
  step) timeout 300 python3 benchmarks/bench_spec_step.py --out "$OUT" --geoms "${SPEC_GEOMS:-super,qwen35_4b}" \
          --batches "${SPEC_BATCHES:-1,8,32,64,128,256,512}" 2>&1 | grep -v Warn | tee "$OUT/spec_step.txt" ;;
  generate)
    # bf16 at real sizes: decode, lookup, oracle, the snapshot baseline and a draft model, CSV + PNG
    timeout 500 python3 benchmarks/bench_spec_generate.py --out "$OUT" --batches "${GEN_BATCHES:-1,32,256}" \
      --models "${GEN_MODELS:-nemotron_h_nano4b,qwen35_4b}" --layers "${GEN_LAYERS:-8}" 2>&1 \
      | grep -v "^\[transformers\]" | tee "$OUT/spec_generate.txt" ;;
  readcopy) timeout 200 python3 -m pytest -q tests/test_mamba2_readcopy.py tests/test_delta_readcopy_triton.py \
      -p no:cacheprovider 2>&1 | tail -3 \
      | tee "$OUT/pytest_readcopy.txt"
    timeout 300 python3 benchmarks/bench_readcopy_kernel.py --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/readcopy.txt" ;;
  readcopy-e2e)
    for fam in nemotron_h qwen3_5; do
      timeout 200 python3 benchmarks/check_cudagraphs.py $fam bf16,fp8_e4m3,nvfp4 2>&1 | grep -v "^\[transformers\]" \
        | tail -16 | tee "$OUT/cudagraphs_readcopy_$fam.txt"
    done
    timeout 400 replay-compile bench --models nemotron_h_nano4b,qwen35_4b --layers 8 --batches 256,1 --steps 32 \
      --modes inductor-ro,replayssm-ro,replayssm-ro:fp8_e4m3,replayssm-ro:nvfp4 --out "$OUT/e2e_readcopy" 2>&1 \
      | grep -v "^\[transformers\]\|it/s\]" | tail -12 | tee "$OUT/e2e_readcopy.txt" ;;
esac; done
