#!/usr/bin/env bash
# Install dp_hf with its test extra (CPU torch pinned by constraints-cpu.txt), lint, and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,recipes
python -m ruff check dp_hf tests recipes bench scripts
python -m ruff format --check dp_hf tests recipes bench scripts
python -m pytest -q -p no:cacheprovider
