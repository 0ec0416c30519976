#!/usr/bin/env bash
# Runs the multi-GPU checks on a machine with several GPUs, from a bundle built by
# ../shared/tools/gpu-bundle (.gpu/), writing logs to $1 (default ./multi-gpu-logs):
#   1. engine parity on real NCCL at 2, 4 and 8 ranks (one process driving every GPU), f32 and bf16,
#      against the unsharded reference after every step;
#   2. hybrid sharding on NCCL (one process): 2 replicas of n/2 ranks and n/2 replicas of 2, and
#      plain data parallelism (n replicas of 1), against the reference of n ranks;
#   3. expert groups on NCCL (one process): the odd layers sharded over groups of 2 and of n/2
#      ranks, a copy per group, against the reference;
#   4. a launch like torchrun: one process per GPU, each rank's place from RANK, WORLD_SIZE,
#      LOCAL_RANK, MASTER_ADDR and MASTER_PORT, the NCCL unique id served by rank 0 over TCP,
#      plain and with 2 replicas (rank 0 checks the gathered model against the reference);
#   5. the pipeline benchmark on 2, 4 and 8 GPUs (NCCL), with a trace of one step.
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
  for replicas in 2 $((n / 2)) "$n"; do
    log="$out/hsdp-nccl$n-r$replicas.log"
    .gpu/bin/train --backend cuda --comm nccl --ranks "$n" --replicas "$replicas" --steps 20 \
      >"$log" 2>&1
    echo "nccl $n, $replicas replicas: rc=$? $(grep 'largest relative' "$log")"
  done
  for size in 2 $((n / 2)); do
    log="$out/experts-nccl$n-g$size.log"
    .gpu/bin/train --backend cuda --comm nccl --ranks "$n" --experts "$size" --steps 20 \
      >"$log" 2>&1
    echo "nccl $n, expert groups of $size: rc=$? $(grep 'largest relative' "$log")"
  done
  for replicas in 1 2; do
    log="$out/launch-$n-r$replicas"
    port=$((29500 + n * 10 + replicas))
    for ((rank = 0; rank < n; rank++)); do
      RANK=$rank WORLD_SIZE=$n LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        .gpu/bin/launch --replicas "$replicas" >"$log-rank$rank.log" 2>&1 &
    done
    rc=0
    for job in $(jobs -p); do wait "$job" || rc=$?; done
    echo "launch $n, $replicas replica(s): rc=$rc $(tail -n 1 "$log-rank0.log")"
  done
done
comms="$(for n in 2 4 8; do (( n <= gpus )) && printf 'nccl%s,' "$n"; done)"
if [[ -n "$comms" ]]; then
  .gpu/bin/bench-pipeline --comms "${comms%,}" --trace "$out/step.json" | tee "$out/pipeline.txt"
fi
