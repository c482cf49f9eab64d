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
