"""The package's architecture rules, checked on its source: modules talk through public names only,
and no file or class grows past what a reader can hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dp_hf"
SOURCES = sorted(PACKAGE.rglob("*.py"))
# Deprecated re-export shims may alias the old private names (they define nothing themselves).
SHIMS = {PACKAGE / "ghost.py", PACKAGE / "grad_sample.py"}


def _private_names_defined(path: Path) -> set[str]:
    """``_name``s a module defines: its functions, classes, methods and ``self._x`` attributes."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_names():
    defined = {path: _private_names_defined(path) for path in SOURCES}
    violations = []
    for path in SOURCES:
        if path in SHIMS:
            continue
        tree = ast.parse(path.read_text())
        own = defined[path]
        elsewhere = set().union(*(names for other, names in defined.items() if other != path)) - own
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dp_hf"):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and not node.module.endswith("._params"):
                        violations.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
            if isinstance(node, ast.Attribute) and node.attr in elsewhere:
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue  # the object's own attributes (mixins of one class share them)
                violations.append(f"{path.relative_to(PACKAGE)}:{node.lineno} reads .{node.attr}")
    assert not violations, "\n".join(violations)


def test_files_and_classes_stay_small():
    big_files, big_classes = [], []
    for path in SOURCES:
        lines = path.read_text().splitlines()
        if len(lines) > 520:
            big_files.append(f"{path.relative_to(PACKAGE)}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 260:
                big_classes.append(
                    f"{path.relative_to(PACKAGE)}:{node.name}: {node.end_lineno - node.lineno + 1}"
                )
    assert not big_files and not big_classes, "\n".join(big_files + big_classes)


def test_every_module_says_what_it_owns():
    missing = [
        str(p.relative_to(PACKAGE)) for p in SOURCES if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not missing, missing


def test_no_private_trainer_attribute_is_set_on_other_objects():
    # e.g. the old `optimizer._dp_hf_trainer_hooked = True`: state belongs to its owner. (Opacus's own
    # per-parameter counter is reset where Opacus expects it: its protocol, not ours.)
    allowed = {"parameter._forward_counter ="}
    pattern = re.compile(r"^\s*(?!self\.|cls\.)[A-Za-z_][\w.]*\._\w+\s*=[^=]", re.M)
    hits = [
        f"{p.relative_to(PACKAGE)}: {m.group(0).strip()}"
        for p in SOURCES
        if p not in SHIMS
        for m in pattern.finditer(p.read_text())
        if m.group(0).strip() not in allowed
    ]
    assert not hits, "\n".join(hits)
