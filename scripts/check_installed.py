"""Exit 0 when this environment holds dp_hf from CHECKOUT and every requirement of the base and of
EXTRAS at a version pyproject.toml allows; otherwise print what is missing and exit 1.

    python scripts/check_installed.py test,recipes /path/to/checkout

scripts/install.sh runs it from outside the checkout (whose own directory on sys.path would import
dp_hf whether installed or not), after its stamps match: a stamp outlives a reset environment.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def missing(extras: list[str], checkout: str) -> list[str]:
    """What this environment lacks: dp_hf from `checkout`, or a requirement of the base or of `extras`."""
    try:
        from packaging.requirements import Requirement  # (a dependency of transformers)

        import dp_hf
    except ImportError as error:
        return [f"{error.name} (not installed)"]
    checkout = os.path.realpath(checkout)
    if not os.path.realpath(dp_hf.__file__).startswith(checkout + os.sep):
        return [f"dp_hf from {checkout} (this environment's is {dp_hf.__file__})"]
    lacking = []
    for line in importlib.metadata.requires("dp_hf") or []:
        requirement = Requirement(line)
        if requirement.marker and not any(requirement.marker.evaluate({"extra": e}) for e in ["", *extras]):
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            lacking.append(f"{line} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            lacking.append(f"{line} ({version} installed)")
    return lacking


if __name__ == "__main__":
    lacking = missing(sys.argv[1].split(","), sys.argv[2])
    for item in lacking:
        print(f"missing: {item}")
    sys.exit(1 if lacking else 0)
