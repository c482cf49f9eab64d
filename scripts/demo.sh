#!/usr/bin/env bash
# The README's main job: install dp_hf (CPU torch pinned by constraints-cpu.txt) and run the offline
# demo, a ViT trained with DP-MacAdam on scikit-learn's digits to (epsilon = 8, delta = 1e-5).
# Arguments are passed to the demo, e.g. scripts/demo.sh --num_train_epochs 5 --output_dir /tmp/demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh recipes
python -m recipes.demo "$@"
