#!/usr/bin/env bash
# Runs the multi-GPU checks on a machine with several GPUs, from a bundle built by
# ../shared/tools/gpu-bundle (.gpu/), writing logs to $1 (default ./multi-gpu-logs):
#   1. engine parity on real NCCL at 2, 4 and 8 ranks (one process driving every GPU), f32 and bf16,
#      against the unsharded reference after every step;
#   2. the pipeline benchmark on 2, 4 and 8 GPUs (NCCL), with a trace of one step.
# Keep NVLink multicast off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out="${1:-multi-gpu-logs}"
mkdir -p "$out"
gpus="$(nvidia-smi --list-gpus | wc -l)"
echo "GPUs: $gpus"
for n in 2 4 8; do
  (( n <= gpus )) || continue
  for dtype in f32 bf16; do
    .gpu/bin/train --backend cuda --comm nccl --ranks "$n" --dtype "$dtype" --steps 20 \
      >"$out/parity-nccl$n-$dtype.log" 2>&1
    echo "nccl $n $dtype: rc=$? $(grep 'largest relative' "$out/parity-nccl$n-$dtype.log")"
  done
done
comms="$(for n in 2 4 8; do (( n <= gpus )) && printf 'nccl%s,' "$n"; done)"
if [[ -n "$comms" ]]; then
  .gpu/bin/bench-pipeline --comms "${comms%,}" --trace "$out/step.json" | tee "$out/pipeline.txt"
fi
