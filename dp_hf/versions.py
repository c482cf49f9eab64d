"""The library versions dp_hf is tested with, and a check that warns outside them.

``DPTrainer`` overrides private ``transformers.Trainer`` methods and relies on its resume and
batch-skipping semantics; the per-example hooks rely on Opacus internals; ``DPSFTTrainer`` on trl's
``SFTTrainer``. Those are version-sensitive, so ``pyproject.toml`` bounds them to the minor versions
the test suite runs against (``constraints-cpu.txt``), and :func:`check_tested_versions` warns when
an installed version is outside (for installs that bypassed the bounds).
"""

from __future__ import annotations

import importlib.metadata
import warnings

__all__ = ["TESTED_VERSIONS", "check_tested_versions"]

#: Distribution name -> the ``major.minor`` release the suite is run against.
TESTED_VERSIONS: dict[str, str] = {
    "transformers": "5.23",
    "accelerate": "1.15",
    "opacus": "1.6",
    "peft": "0.21",
    "trl": "1.16",
}


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_tested_versions(
    names: tuple[str, ...] = ("transformers", "accelerate", "opacus", "peft"),
) -> list[str]:
    """Warn (once per call) for each installed library of ``names`` outside :data:`TESTED_VERSIONS`.

    Returns the messages. A library that is not installed is skipped (trl is optional).
    """
    messages = []
    for name in names:
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if _minor(installed) != TESTED_VERSIONS[name]:
            messages.append(
                f"dp_hf is tested with {name} {TESTED_VERSIONS[name]}.x but {installed} is installed; it overrides "
                f"version-sensitive internals of {name}, so check results (privacy included) before relying on them "
                f"or install {name}=={TESTED_VERSIONS[name]}.*."
            )
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=3)
    return messages
