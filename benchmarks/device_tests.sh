#!/usr/bin/env bash
# Run on the GPU machine (torch/triton/transformers come with its image; nothing can be installed from the network):
# the test suite (CUDA paths included: the Triton kernels run compiled there), then the demo on CPU and CUDA.
# Logs go to $OUT (or ./device-logs).
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || echo "install failed (see install.log)"
python3 -m replay_compile.cli env 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q tests -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/pytest.txt" | tail -40
python3 -m replay_compile.cli demo 2>&1 | grep -v "^\[transformers\]" | tee "$OUT/demo_cpu.txt"
python3 -m replay_compile.cli demo --device cuda 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/demo_cuda.txt"
