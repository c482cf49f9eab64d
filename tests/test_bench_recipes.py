"""bench/bench_recipes.py in --smoke mode: every GPU recipe built by its own code (tiny models, CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# The full runs' step counts, as each YAML's comment derives them (real N, the YAML's batch and epochs).
PLANNED_STEPS = {
    "bert_qnli": 32_730,  # round(104,743 / 32) = 3273 per epoch x 10 epochs
    "deit_cifar10": 540,  # max_steps: the most steps within epsilon 8 (50 epochs would be 550)
    "deit_cifar100": 990,  # 11 x 90 epochs
    "tinybert_mlm": 2_000,  # max_steps
    "llm_lora": 150,  # round(51,002 / 1024) = 50 x 3 epochs
}


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_recipes", REPO / "bench" / "bench_recipes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_recipes"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_smoke_runs_every_recipe(tmp_path, capsys):
    bench = _load_bench()
    assert set(bench.RECIPES) == set(PLANNED_STEPS)
    out = tmp_path / "rows.json"
    rows = bench.main(["--smoke", "--steps", "3", "--warmup", "1", "--json", str(out)])
    assert [row["recipe"] for row in rows] == list(bench.RECIPES)
    for row in rows:
        assert "error" not in row, row
        assert row["steps_run"] == 3 and row["steps_timed"] == 2
        assert row["steps_per_s"] > 0 and row["examples_per_s"] > 0
        assert row["planned_steps"] == PLANNED_STEPS[row["recipe"]], row
        assert row["projected_hours"] == pytest.approx(row["planned_steps"] * row["median_step_s"] / 3600)
        assert row["peak_gpu_mem_gib"] is None and row["device"] == "cpu"
        assert 0 < row["trainable_params"] <= row["total_params"]
    by_name = {row["recipe"]: row for row in rows}
    # the recipes' own parameter selection: last block + pooler + classifier; LoRA adapters only
    assert by_name["bert_qnli"]["trainable_params"] < by_name["bert_qnli"]["total_params"]
    assert by_name["llm_lora"]["trainable_params"] < by_name["llm_lora"]["total_params"]
    assert by_name["deit_cifar10"]["dp_optimizer"] == "dp-microadam"
    assert json.loads(out.read_text()) == json.loads(json.dumps(rows, default=str))
    table = capsys.readouterr().out
    for name in PLANNED_STEPS:
        assert f"| {name} |" in table


def test_real_planned_steps_match_the_yaml_comments():
    """Without training: the full runs' plans, from the YAML files at the real N (dp_hf.plan)."""
    bench = _load_bench()
    from recipes import bert_qnli, deit_cifar, llm_lora, tinybert_mlm

    cases = [
        ("bert_qnli", bert_qnli, "bert_qnli.yaml", 104_743),
        ("deit_cifar10", deit_cifar, "deit_cifar10.yaml", 45_000),
        ("deit_cifar100", deit_cifar, "deit_cifar100.yaml", 45_000),
        ("tinybert_mlm", tinybert_mlm, "tinybert_mlm.yaml", 1_700_000),
        ("llm_lora", llm_lora, "llm_lora.yaml", 51_002),
    ]
    overrides = ["--output_dir", "unused", "--use_cpu", "true"]
    for name, module, yaml_name, n in cases:
        assert bench._real_planned_steps(yaml_name, module, n, overrides) == PLANNED_STEPS[name], name
