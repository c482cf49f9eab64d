"""bench/bench_trainer.py --phases: the step split into its phases, and nothing left patched afterwards."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import warnings
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_trainer", REPO / "bench" / "bench_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_split_the_step_and_are_removed(tmp_path, monkeypatch):
    bench = _load_bench()
    backward = torch.Tensor.backward
    out = tmp_path / "rows.json"
    argv = ["bench_trainer.py", "--model", "tiny-bert", "--device", "cpu", "--batch", "4", "--seq-len", "8"]
    argv += ["--steps", "4", "--warmup", "1", "--phases", "--optimizers", "dp-adamw", "--json", str(out)]
    argv += ["--max-physical-batch", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    # main() quiets warnings and the dp_hf / transformers loggers for its tables: undone here for the
    # tests that run after this one.
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    dp_hf_level = logging.getLogger("dp_hf").level
    try:
        with warnings.catch_warnings():
            bench.main()
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        logging.getLogger("dp_hf").setLevel(dp_hf_level)  # setLevel also clears the loggers' caches
    assert torch.Tensor.backward is backward  # the timing wrapper is gone
    trainer_row, dp_row = json.loads(out.read_text())["rows"]
    for row in (trainer_row, dp_row):
        phases = row["phases_s"]
        assert set(phases) == {"forward", "backward", "clip", "optimizer"}
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
        assert sum(phases.values()) <= row["median_step_s"] * 1.5  # medians of parts of the same steps
    assert trainer_row["largest_pass"] == 4 and 0 < dp_row["largest_pass"] <= 4  # the hard cap on a pass
    assert trainer_row["phases_s"]["clip"] == 0  # the plain Trainer clips nothing per example
    assert dp_row["phases_s"]["clip"] > 0


def test_bench_memory_reports_a_peak_per_step(monkeypatch, capsys):
    """bench/bench_memory.py (the CPU proxy of peak GPU memory): one peak per step, for the Trainer and DP."""
    spec = importlib.util.spec_from_file_location("bench_memory", REPO / "bench" / "bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = [
        "--hidden",
        "16",
        "--layers",
        "1",
        "--vocab",
        "64",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--steps",
        "2",
    ]
    verbosity = transformers.logging.get_verbosity()
    try:
        for extra in ([], ["--dp", "dp-adamw", "--max-physical-batch", "2", "--snapshot"]):
            monkeypatch.setattr(sys, "argv", ["bench_memory.py", *tiny, *extra])
            with warnings.catch_warnings():
                bench.main()
    finally:
        transformers.logging.set_verbosity(verbosity)
    lines = capsys.readouterr().out.splitlines()
    peaks = [json.loads(line.split("(MiB): ")[1]) for line in lines if "peak per step" in line]
    assert [len(p) for p in peaks] == [2, 2] and all(x >= 0 for p in peaks for x in p)
    assert any(" @ " in line for line in lines)  # the snapshot names where the live tensors came from


def test_fresh_processes_run_each_run_in_its_own_process(tmp_path, monkeypatch):
    """--fresh-processes: each run's row comes from a child process (as a user's script runs: its one-time
    costs count), and the table has the rounds of every run."""
    import os
    import subprocess

    bench = _load_bench()
    children = []
    run = subprocess.run

    def spy(command, *args, **kwargs):
        if isinstance(command, list) and "--only" in command:  # (other libraries run commands too)
            children.append(command[command.index("--only") + 1])
            assert "--fresh-processes" not in command and command.count("--json") == 1
        return run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    out = tmp_path / "rows.json"
    argv = ["bench_trainer.py", "--model", "tiny-bert", "--device", "cpu", "--batch", "2", "--seq-len", "4"]
    argv += ["--steps", "2", "--warmup", "0", "--e2e", "--fresh-processes", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    verbosity, dp_hf_level = transformers.logging.get_verbosity(), logging.getLogger("dp_hf").level
    try:
        with warnings.catch_warnings():
            bench.main()
    finally:
        transformers.logging.set_verbosity(verbosity)
        logging.getLogger("dp_hf").setLevel(dp_hf_level)
    assert children == ["trainer", "dp-adamw"]
    trainer_row, dp_row = json.loads(out.read_text())["rows"]
    assert trainer_row["run"].startswith("Trainer") and dp_row["run"] == "dp-adamw"
    assert dp_row["steps"] == trainer_row["steps"] == 2 and dp_row["epsilon"] > 0
    assert dp_row["train_s"] > 0 and len(dp_row["rounds"]) == 1
