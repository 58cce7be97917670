#!/usr/bin/env bash
# One call on a 2-GPU machine (kind nvidia-h200-x2): tensor-parallel checks and the TP=2 decode-step benchmark.
#   parity: tiny NemotronH and Qwen3.5, greedy 2L+1 tokens, TP=2 (NCCL, one GPU per rank) vs TP=1 vs eager, fp32
#   bench:  real-size NemotronH-Nano-4B and Qwen3.5-4B dims (first $LAYERS layers), TP=2, plain torch.compile vs
#           backend="replayssm", both reduce-overhead, batches $TP_BATCHES
#   check:  the same models, TP=2, eager vs replayssm-ro in lockstep over $CHECK tokens, fp32
# NVLink multicast stays off (the machine sets NCCL_NVLS_ENABLE=0 etc.; repeated here so torchrun's ranks keep it).
# Usage there: OUT=... bash benchmarks/device_tp.sh [parity bench check]
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
nvidia-smi -L | tee "$OUT/gpus.txt"
LAYERS=${LAYERS:-8}
for s in ${*:-parity bench check}; do case $s in
  parity) for fam in nemotron_h qwen3_5; do
            timeout 220 python3 -m replay_compile.testing.tp_parity $fam --device cuda --out "$OUT/tp_parity_$fam.json" \
              > "$OUT/tp_parity_$fam.log" 2>&1; rc=$?
            grep -v "^\[transformers\]\|warn" "$OUT/tp_parity_$fam.log" | tail -6 | tee -a "$OUT/tp_parity.txt"
            [ $rc = 0 ] || { echo "parity $fam failed (rc $rc): stopping"; exit 1; }; done ;;
  bench) timeout "${BENCH_TIMEOUT:-330}" torchrun --nproc-per-node 2 -m replay_compile.cli bench --tp 2 \
           --models "${TP_MODELS:-nemotron_h_nano4b,qwen35_4b}" --batches "${TP_BATCHES:-1,256}" \
           --modes inductor-ro,replayssm-ro --layers "$LAYERS" --steps 48 --out "$OUT/tp_bench" 2>&1 \
           | grep -v "^\[transformers\]\|point/s\|it/s" | tail -14 | tee "$OUT/tp_bench.txt" ;;
  check) timeout 200 torchrun --nproc-per-node 2 -m replay_compile.cli bench --tp 2 --check "${CHECK:-64}" \
           --dtype float32 --models nemotron_h_nano4b,qwen35_4b --layers "$LAYERS" --out "$OUT/tp_check" 2>&1 \
           | grep -v "^\[transformers\]" | tail -6 | tee "$OUT/tp_check.txt" ;;
esac; done
