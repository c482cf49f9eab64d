#!/usr/bin/env bash
# The CPU rows of bench/RESULTS.md: every runner side by side, interleaved, medians.
# Usage: bash bench/run_cpu.sh [repeats-scale]   (outputs in bench/results/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
run() {
  local name=$1; shift
  echo "+ python bench/bench_clipping.py $*" | tee "$out/$name.md"
  python bench/bench_clipping.py "$@" --json "$out/$name.json" 2>/dev/null | tee -a "$out/$name.md"
}
run tiny-bert-cpu --model tiny-bert --batch 32 --seq-len 128 --threads 2 --repeats 15 --memory
run minilm-cpu --model minilm --batch 32 --seq-len 128 --threads 2 --repeats 7 --memory
run vit-tiny-cpu --model vit-tiny --batch 32 --threads 2 --repeats 5 --memory
run deit-tiny-cpu --model deit-tiny --batch 32 --threads 2 --repeats 5 --memory
