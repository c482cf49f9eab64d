#!/usr/bin/env bash
# The GPU rows of bench/RESULTS.md (peak memory from torch.cuda.max_memory_allocated), in parts that each
# fit one device command (<= 10 minutes; a session has 30 device minutes):
#
#   bash bench/run_gpu.sh clipping   # bench_clipping.py tables (the default)
#   bash bench/run_gpu.sh tests      # pytest -m gpu: fast paths, error bounds, optimizers, DPTrainer bf16;
#                                    # bench_tensor_cores.py: the bound's clip-norm inflation
#   bash bench/run_gpu.sh bert       # issue 16: BERT-base B64 L128 bf16, DPTrainer vs Trainer, 4 optimizers,
#                                    # with the step split into forward/backward/clipping/optimizer/rest
#   bash bench/run_gpu.sh fused      # issue 16: the materialize path (dp-macadam, dp-adamw-stp) on BERT-base bf16
#                                    # with the fused geometry-norm kernel and without (DP_HF_FUSED_NORMS=0)
#   bash bench/run_gpu.sh large      # issue 16: GPT-2-medium B16 L512 and the 1.1B Llama LoRA B16 L512, bf16
#   bash bench/run_gpu.sh optimizer  # bench_optimizer_step.py --bert-like and --bert-base on CUDA (fp32)
#   bash bench/run_gpu.sh recipes    # issue 16: bench_recipes.py, bert_qnli + tinybert_mlm (200 steps) and
#                                    # deit_cifar10/100 (40 steps of ~3.5 s): recipes/README's cost table
#   bash bench/run_gpu.sh recipes-llm  # llm_lora, 24 steps of ~17 s (its own call: ~7-8 minutes)
#   bash bench/run_gpu.sh quick      # a 15-minute device budget (one cold start, one call of <= 8 minutes): every
#                                    # gpu test, then BERT-base bf16 with the fused geometry norms and without
#                                    # (dp-adamw, dp-macadam, dp-adamw-stp); each part stops at its own time limit
#
# Results go to $OUT (the device tool's folder) when set, else bench/results. On the lent machine, carry
# the wheels and start with the environment lines of ../shared/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
part=${1:-clipping}

clipping() {
  local name=$1; shift
  echo "+ python bench/bench_clipping.py $*" | tee "$out/$name.md"
  python bench/bench_clipping.py "$@" --json "$out/$name.json" 2>/dev/null | tee -a "$out/$name.md"
}

trainer() {
  local name=$1; shift
  echo "+ python bench/bench_trainer.py $*" | tee "$out/$name.md"
  python bench/bench_trainer.py "$@" --json "$out/$name.json" 2>"$out/$name.err" | tee -a "$out/$name.md"
}

recipes() {
  local name=$1; shift
  echo "+ python bench/bench_recipes.py --device cuda $*" | tee "$out/$name.md"
  python bench/bench_recipes.py --device cuda "$@" --json "$out/$name.json" 2>"$out/$name.err" | tee -a "$out/$name.md"
}

case "$part" in
  clipping)
    clipping tiny-bert-cuda --model tiny-bert --device cuda --batch 32 --seq-len 128 --repeats 20
    clipping minilm-cuda --model minilm --device cuda --batch 32 --seq-len 128 --repeats 20
    clipping bert-base-cuda --model bert-base --device cuda --batch 32 --seq-len 128 --repeats 20
    clipping vit-tiny-cuda --model vit-tiny --device cuda --batch 32 --repeats 20
    clipping deit-small-cuda --model deit-small --device cuda --batch 32 --repeats 20
    ;;
  tests)
    # every gpu-marked test (tests/test_gpu.py and the CUDA rows of other files, e.g. test_ghost_overhead.py)
    python -m pytest -q -p no:cacheprovider -m gpu tests -rs 2>&1 | tee "$out/gpu-tests.txt"
    python bench/bench_tensor_cores.py 2>"$out/tensor-cores.err" | tee "$out/tensor-cores.md"
    ;;
  bert)
    trainer bert-base-bf16 --model bert-base --device cuda --bf16 --batch 64 --seq-len 128 --steps 40 \
      --repeats 2 --phases --optimizers dp-adamw dp-macadam dp-adamw-stp dp-microadam
    ;;
  fused)
    trainer bert-base-bf16-fused --model bert-base --device cuda --bf16 --batch 64 --seq-len 128 --steps 30 \
      --phases --optimizers dp-adamw dp-macadam dp-adamw-stp
    DP_HF_FUSED_NORMS=0 trainer bert-base-bf16-torch-norms --model bert-base --device cuda --bf16 --batch 64 \
      --seq-len 128 --steps 30 --phases --optimizers dp-adamw dp-macadam dp-adamw-stp
    ;;
  quick)
    timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests -rs 2>&1 | tee "$out/gpu-tests.txt" || true
    timeout 150 bash "$0" fused-short || true
    ;;
  fused-short)
    trainer bert-base-bf16-fused --model bert-base --device cuda --bf16 --batch 64 --seq-len 128 --steps 15 \
      --phases --optimizers dp-adamw dp-macadam dp-adamw-stp
    DP_HF_FUSED_NORMS=0 trainer bert-base-bf16-torch-norms --model bert-base --device cuda --bf16 --batch 64 \
      --seq-len 128 --steps 15 --phases --optimizers dp-macadam dp-adamw-stp
    ;;
  large)
    trainer gpt2-medium-bf16 --model gpt2-medium --device cuda --bf16 --batch 16 --seq-len 512 --steps 30
    trainer llama-1b-lora-bf16 --model llama-1b-lora --device cuda --bf16 --batch 16 --seq-len 512 --steps 30 \
      --optimizers dp-adamw dp-macadam
    # peak memory at the Trainer's activation memory (no Poisson slack: a pass holds at most 16 examples)
    trainer gpt2-medium-bf16-cap16 --model gpt2-medium --device cuda --bf16 --batch 16 --seq-len 512 --steps 15 \
      --max-physical-batch 16
    ;;
  optimizer)
    python bench/bench_optimizer_step.py --bert-like --repeats 20 --device cuda | tee "$out/optimizer-step-cuda.md"
    python bench/bench_optimizer_step.py --bert-base --repeats 20 --device cuda | tee "$out/optimizer-step-bert-base-cuda.md"
    ;;
  recipes)
    recipes recipes-text --recipes bert_qnli tinybert_mlm --steps 200
    recipes recipes-deit --recipes deit_cifar10 deit_cifar100 --steps 40 --warmup 5
    ;;
  recipes-llm)
    recipes recipes-llm --recipes llm_lora --steps 24 --warmup 4
    ;;
  *)
    echo "unknown part '$part': clipping, tests, bert, fused, large, optimizer, recipes, recipes-llm or quick" >&2
    exit 2
    ;;
esac
