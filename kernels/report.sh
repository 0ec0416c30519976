#!/usr/bin/env bash
# Prints each kernel's registers, stack and spills for sm_80 and sm_90, with the blocks of 256
# threads an SM then holds (65536 registers, allocated in steps of 8 per thread; at most 8 blocks),
# and, when cuobjdump is found (beside nvcc, on PATH or as $CUOBJDUMP), counts 128-bit and 64-bit
# global loads and stores in each kernel's sm_90 SASS (64-bit loads include addresses read from
# tables). A kernel with no 128-bit load or store has lost its vector path.
#
#   NVCC="$(../shared/tools/nvcc-path)" kernels/report.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nvcc="${NVCC:-nvcc}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for arch in 80 90; do
  echo "== sm_$arch: registers, stack, spills, blocks per SM"
  for cu in "$here"/*.cu; do
    "$nvcc" -cubin -gencode "arch=compute_$arch,code=sm_$arch" -O3 -std=c++17 -Xptxas -v \
      -o "$work/$(basename "$cu" .cu).sm_$arch.cubin" "$cu" 2>&1 |
      awk '/Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
           /bytes stack frame/ { stack = $1; spill = $5 + $9 }
           /Used [0-9]+ registers/ {
             regs = $5; per_thread = int((regs + 7) / 8) * 8; blocks = int(65536 / (per_thread * 256))
             if (blocks > 8) blocks = 8
             printf "  %-28s %3d registers  %3d B stack  %3d B spilled  %d blocks\n", name, regs, stack, spill, blocks }'
  done
done

cuobjdump="${CUOBJDUMP:-$(dirname "$(command -v "$nvcc")")/cuobjdump}"
if [[ ! -x "$cuobjdump" ]]; then cuobjdump="$(command -v cuobjdump || true)"; fi
if [[ -z "$cuobjdump" ]]; then
  echo "== no cuobjdump: SASS not checked"
  exit 0
fi
echo "== sm_90 SASS: 128-bit / 64-bit global loads and stores per kernel"
for cubin in "$work"/*.sm_90.cubin; do
  "$cuobjdump" -sass "$cubin" |
    awk 'function show() { printf "  %-28s LDG 128 %2d  64 %2d   STG 128 %2d  64 %2d\n", name, l16, l8, s16, s8 }
         /Function : / { if (name) show(); name = $3; l16 = 0; l8 = 0; s16 = 0; s8 = 0 }
         /LDG\.E[.A-Z0-9]*\.128/ { l16++ }
         /LDG\.E[.A-Z0-9]*\.64 / { l8++ }
         /STG\.E[.A-Z0-9]*\.128/ { s16++ }
         /STG\.E[.A-Z0-9]*\.64 / { s8++ }
         END { if (name) show() }'
done
