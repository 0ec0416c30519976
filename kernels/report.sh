#!/usr/bin/env bash
# Prints each kernel's registers, stack and spills for sm_80 and sm_90, and, when cuobjdump is
# found (beside nvcc, on PATH or as $CUOBJDUMP), counts 128-bit global loads and stores in each
# kernel's sm_90 SASS. A kernel with no LDG.E.128 or STG.E.128 has lost its vector path.
#
#   NVCC="$(../shared/tools/nvcc-path)" kernels/report.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nvcc="${NVCC:-nvcc}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for arch in 80 90; do
  echo "== sm_$arch: registers, stack, spills"
  for cu in "$here"/*.cu; do
    "$nvcc" -cubin -gencode "arch=compute_$arch,code=sm_$arch" -O3 -std=c++17 -Xptxas -v \
      -o "$work/$(basename "$cu" .cu).sm_$arch.cubin" "$cu" 2>&1 |
      awk '/Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
           /bytes stack frame/ { stack = $1; spill = $5 + $9 }
           /Used [0-9]+ registers/ { printf "  %-28s %3d registers  %3d B stack  %3d B spilled\n", name, $5, stack, spill }'
  done
done

cuobjdump="${CUOBJDUMP:-$(dirname "$(command -v "$nvcc")")/cuobjdump}"
if [[ ! -x "$cuobjdump" ]]; then cuobjdump="$(command -v cuobjdump || true)"; fi
if [[ -z "$cuobjdump" ]]; then
  echo "== no cuobjdump: SASS not checked"
  exit 0
fi
echo "== sm_90 SASS: 128-bit global loads / stores per kernel"
for cubin in "$work"/*.sm_90.cubin; do
  "$cuobjdump" -sass "$cubin" |
    awk '/Function : / { if (name) printf "  %-28s LDG.E.128 %2d  STG.E.128 %2d\n", name, ld, st; name = $3; ld = 0; st = 0 }
         /LDG\.E\.128/ { ld++ }
         /STG\.E\.128/ { st++ }
         END { if (name) printf "  %-28s LDG.E.128 %2d  STG.E.128 %2d\n", name, ld, st }'
done
