from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import types

import pytest

from dp_hf import cli
from dp_hf.accounting import calibrate_noise_multiplier, compute_epsilon

CHEAP_RUN = ["--sample-rate", "0.01", "--steps", "200", "--delta", "1e-5"]


def _epsilon_from_line(line: str) -> float:
    return float(re.match(r"epsilon = (\S+) ", line).group(1))


def run_json(capsys, argv):
    assert cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_epsilon_line_matches_compute_epsilon(capsys):
    argv = ["epsilon", "--noise-multiplier", "1.0", "--delta", "1e-5"]
    argv += ["--batch-size", "256", "--dataset-size", "60000", "--steps", "1171"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert _epsilon_from_line(out) == pytest.approx(compute_epsilon(256 / 60000, 1.0, 1171, 1e-5), rel=1e-4)
    assert "q = 0.00426667 (= 256/60000)" in out
    assert "T = 1171" in out and "pld accountant" in out


def test_epsilon_json(capsys):
    result, err = run_json(
        capsys, ["epsilon", "--noise-multiplier", "0.9", *CHEAP_RUN, "--accountant", "rdp"]
    )
    assert err == ""
    assert result["epsilon"] == compute_epsilon(0.01, 0.9, 200, 1e-5, accountant="rdp")
    assert result["sample_rate"] == 0.01 and result["steps"] == 200 and result["delta"] == 1e-5
    assert result["accountant"] == "rdp" and result["accounting_library"].startswith("dp-accounting ")
    assert result["delta_is_default"] is False


@pytest.mark.parametrize(
    ("accountant", "library"), [("pld", "dp-accounting "), ("rdp", "dp-accounting "), ("prv", "opacus ")]
)
def test_epsilon_json_names_the_library_that_computed_it(capsys, accountant, library):
    result, _ = run_json(
        capsys, ["epsilon", "--noise-multiplier", "0.9", *CHEAP_RUN, "--accountant", accountant]
    )
    assert result["accounting_library"].startswith(library)


@pytest.mark.parametrize(
    ("sampling", "epochs", "expected_q", "expected_steps"),
    [
        # round(60000 / 256) = 234 steps per epoch, as DPTrainer counts them (not ceil(5 / q) = 1172)
        (["--batch-size", "256", "--dataset-size", "60000"], "5", 256 / 60000, 1170),
        (["--sample-rate", "0.01"], "5", 0.01, 500),
        (["--sample-rate", "0.1"], "0.3", 0.1, 3),
        # transformers.Trainer's float product: 0.55 * 100 = 55.00000000000001 -> it runs 56 steps
        (["--sample-rate", "0.01"], "0.55", 0.01, 56),
        (["--batch-size", "100", "--dataset-size", "1000"], "2.5", 0.1, 25),
        # the demo's settings: round(1437 / 256) = 6 steps per epoch, 15 epochs -> 90 (ceil(15 / q) = 85)
        (["--batch-size", "256", "--dataset-size", "1437"], "15", 256 / 1437, 90),
    ],
)
def test_epochs_are_counted_as_dptrainer_counts_them(capsys, sampling, epochs, expected_q, expected_steps):
    argv = ["epsilon", "--noise-multiplier", "2", "--delta", "1e-5", *sampling, "--epochs", epochs]
    result, _ = run_json(capsys, argv)
    assert result["sample_rate"] == expected_q
    assert result["steps"] == expected_steps


def test_default_delta_is_announced(capsys):
    argv = [
        "epsilon",
        "--noise-multiplier",
        "1",
        "--batch-size",
        "500",
        "--dataset-size",
        "50000",
        "--steps",
        "100",
    ]
    result, err = run_json(capsys, argv)
    assert result["delta"] == 2e-6 and result["delta_is_default"] is True
    assert "--delta not given: using delta = 2e-06" in err
    assert result["epsilon"] == compute_epsilon(0.01, 1.0, 100, 2e-6)


def test_large_delta_warns_on_stderr(capsys):
    argv = ["epsilon", "--noise-multiplier", "1", "--delta", "0.01", "--batch-size", "10"]
    argv += ["--dataset-size", "1000", "--steps", "10"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("dp-hf: warning: delta = 0.01 is >= 1/n")


def test_noise_is_calibrated(capsys):
    argv = ["noise", "--target-epsilon", "1", *CHEAP_RUN]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    sigma = math.ceil(calibrate_noise_multiplier(1.0, 1e-5, 0.01, 200) * 1e4) / 1e4
    assert out.startswith(f"noise multiplier = {sigma:.4f} gives epsilon = ")
    result, _ = run_json(capsys, argv)
    assert result["noise_multiplier"] == sigma
    assert result["epsilon"] == compute_epsilon(0.01, sigma, 200, 1e-5) <= 1.0


def test_zero_noise_is_infinite(capsys):
    assert cli.main(["epsilon", "--noise-multiplier", "0", *CHEAP_RUN]) == 0
    assert capsys.readouterr().out.startswith("epsilon = inf")
    result, _ = run_json(capsys, ["epsilon", "--noise-multiplier", "0", *CHEAP_RUN])
    assert result["epsilon"] is None  # strict JSON has no infinity


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["epsilon", "--noise-multiplier", "-1", *CHEAP_RUN], "-1.0"),
        (["epsilon", "--noise-multiplier", "nan", *CHEAP_RUN], "nan"),
        (
            ["epsilon", "--noise-multiplier", "1", "--sample-rate", "1.5", "--steps", "9", "--delta", "1e-5"],
            "1.5",
        ),
        (
            [
                "epsilon",
                "--noise-multiplier",
                "1",
                "--sample-rate",
                "0.1",
                "--steps",
                "-3",
                "--delta",
                "1e-5",
            ],
            "-3",
        ),
        (
            ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "9", "--delta", "2"],
            "2.0",
        ),
        (
            [
                "epsilon",
                "--noise-multiplier",
                "1",
                "--sample-rate",
                "0.1",
                "--epochs",
                "-1",
                "--delta",
                "1e-5",
            ],
            "-1.0",
        ),
        (
            ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "9"],
            "--delta is required",
        ),
        (
            ["epsilon", "--noise-multiplier", "1", "--batch-size", "64", "--steps", "9", "--delta", "1e-5"],
            "--dataset-size",
        ),
        (
            [
                "epsilon",
                "--noise-multiplier",
                "1",
                "--batch-size",
                "64",
                "--dataset-size",
                "10",
                "--steps",
                "9",
            ],
            "64",
        ),
        (
            [
                "epsilon",
                "--noise-multiplier",
                "1",
                "--batch-size",
                "0",
                "--dataset-size",
                "10",
                "--steps",
                "9",
            ],
            "0",
        ),
        (["epsilon", "--noise-multiplier", "1", *CHEAP_RUN, "--accountant", "moments"], "'moments'"),
        (["epsilon", "--noise-multiplier", "x", *CHEAP_RUN], "'x'"),
        (
            [
                "epsilon",
                "--noise-multiplier",
                "1",
                "--sample-rate",
                "0.1",
                "--batch-size",
                "2",
                "--steps",
                "9",
            ],
            "not allowed",
        ),
        (["noise", "--target-epsilon", "0", *CHEAP_RUN], "--target-epsilon"),
        (["frobnicate"], "'frobnicate'"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, argv, shown):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert shown in captured.err
    assert "Traceback" not in captured.err


def test_card_without_module_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_hf.card", None)  # makes `import dp_hf.card` fail
    with pytest.raises(SystemExit) as info:
        cli.main(["card", "outputs/run1"])
    assert info.value.code == 2
    assert "dp_hf.card" in capsys.readouterr().err


def test_card_dispatches_to_main_card(monkeypatch):
    calls = []
    fake = types.ModuleType("dp_hf.card")
    fake.main_card = calls.append
    monkeypatch.setitem(sys.modules, "dp_hf.card", fake)
    assert cli.main(["card", "outputs/run1"]) == 0
    assert calls[0].output_dir == "outputs/run1"


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert re.match(r"dp-hf \S+ \(dp-accounting \S+\)", capsys.readouterr().out)


def test_python_dash_m_entry_point():
    argv = ["epsilon", "--noise-multiplier", "1.1", "--batch-size", "512", "--dataset-size", "50000"]
    argv += ["--steps", "488", "--delta", "1e-5"]
    completed = subprocess.run(
        [sys.executable, "-m", "dp_hf.cli", *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert completed.returncode == 0, completed.stderr
    expected = compute_epsilon(512 / 50000, 1.1, 488, 1e-5)
    assert _epsilon_from_line(completed.stdout) == pytest.approx(expected, rel=1e-4)
