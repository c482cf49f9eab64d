#!/usr/bin/env bash
# The GPU rows of bench/RESULTS.md (peak memory from torch.cuda.max_memory_allocated).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
run() {
  local name=$1; shift
  echo "+ python bench/bench_clipping.py $*" | tee "$out/$name.md"
  python bench/bench_clipping.py "$@" --json "$out/$name.json" 2>/dev/null | tee -a "$out/$name.md"
}
run tiny-bert-cuda --model tiny-bert --device cuda --batch 32 --seq-len 128 --repeats 20
run minilm-cuda --model minilm --device cuda --batch 32 --seq-len 128 --repeats 20
run bert-base-cuda --model bert-base --device cuda --batch 32 --seq-len 128 --repeats 20
run vit-tiny-cuda --model vit-tiny --device cuda --batch 32 --repeats 20
run deit-small-cuda --model deit-small --device cuda --batch 32 --repeats 20
