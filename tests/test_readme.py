"""The README's quick start and CI stay in sync."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_quick_start_has_exactly_two_commands():
    assert quick_start_commands() == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = quick_start_commands()[1]
    assert any(line.strip() == test_command for line in ci.splitlines())


def test_scripts_install_before_running():
    installer = (ROOT / "scripts" / "install.sh").read_text()
    assert "pip install" in installer and "constraints-cpu.txt" in installer
    for name, extras in (("demo.sh", "recipes"), ("test.sh", "test,recipes")):
        script = (ROOT / "scripts" / name).read_text()
        assert f"bash scripts/install.sh {extras}" in script, name


def test_tested_versions_are_the_pinned_and_bounded_ones():
    # pyproject's bounds, the CPU constraints and dp_hf.versions name the same minor releases.
    from dp_hf.versions import TESTED_VERSIONS, check_tested_versions

    pyproject = (ROOT / "pyproject.toml").read_text()
    constraints = (ROOT / "constraints-cpu.txt").read_text()
    for name, minor in TESTED_VERSIONS.items():
        major, low = minor.split(".")
        assert f'"{name}>={minor}' in pyproject and f"<{major}.{int(low) + 1}" in pyproject, name
        assert re.search(rf"^{name}=={re.escape(minor)}\.\d+$", constraints, flags=re.M), name
    assert check_tested_versions(tuple(TESTED_VERSIONS)) == []  # this environment is the tested one


def test_torch_floor_covers_the_dependencies_and_the_apis_dp_hf_calls():
    # A floor below what the code calls fails at the first bf16 step on a GPU, not at install.
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    def torch_floor(requirements) -> Version:
        # transformers declares torch under its "torch" extra (the backend it runs on here)
        floors = [
            Version(spec.version)
            for r in map(Requirement, requirements)
            if r.name == "torch" and (r.marker is None or r.marker.evaluate({"extra": "torch"}))
            for spec in r.specifier
            if spec.operator == ">="
        ]
        return max(floors, default=Version("0"))

    pyproject = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, flags=re.S | re.M).group(1)
    ours = torch_floor(re.findall(r'"([^"]+)"', dependencies))
    assert ours >= Version("2.8"), ours  # torch.bmm / torch.mm(..., out_dtype=): dp_hf/per_example/ghost
    # the Dockerfile keeps its base image's CUDA torch only if that torch meets the floor (else pip would
    # replace it by a CUDA build of its own choosing)
    image = re.search(
        r"^FROM pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", (ROOT / "Dockerfile").read_text(), flags=re.M
    )
    assert image and Version(image.group(1)) >= ours, image
    assert torch_floor(importlib.metadata.requires("transformers")) >= Version("2.6")  # the extra is read
    for name in ("transformers", "accelerate", "opacus", "peft"):
        theirs = torch_floor(importlib.metadata.requires(name) or [])
        assert ours >= theirs, (name, theirs)


def test_install_check_sees_the_environment_not_the_stamps(monkeypatch, tmp_path):
    # scripts/install.sh skips pip when its stamps match and scripts/check_installed.py finds dp_hf from this
    # checkout with every requirement of the extras; a stamp alone outlived a reset environment (the check
    # imported dp_hf from the checkout's own directory, which always succeeds there).
    import importlib.metadata
    import importlib.util
    import subprocess
    import sys

    script = ROOT / "scripts" / "check_installed.py"
    run = subprocess.run(
        [sys.executable, script, "test,recipes", ROOT], cwd="/", capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout
    run = subprocess.run([sys.executable, script, "test", tmp_path], cwd="/", capture_output=True, text=True)
    assert run.returncode == 1 and f"dp_hf from {tmp_path}" in run.stdout

    spec = importlib.util.spec_from_file_location("check_installed", script)
    check_installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_installed)
    assert check_installed.missing(["test", "recipes"], str(ROOT)) == []
    real_version = importlib.metadata.version

    def version(name):
        if name in ("ruff", "peft"):
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.0.1" if name == "opacus" else real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    lacking = check_installed.missing(["test"], str(ROOT))
    assert [re.split("[<>]", item)[0] for item in lacking] == ["peft", "opacus", "ruff"], lacking
    assert "(0.0.1 installed)" in lacking[1] and lacking[0].endswith("(not installed)")
    assert [re.split("[<>]", item)[0] for item in check_installed.missing(["recipes"], str(ROOT))] == [
        "peft",
        "opacus",
    ]
