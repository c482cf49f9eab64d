"""The ``card`` command: ``dp-hf card OUTPUT_DIR [--write]`` and ``python -m dp_hf.card OUTPUT_DIR [--write]``.

Owns the command's one argument declaration, :func:`add_card_arguments` (``dp_hf.cli`` adds it to
its ``card`` subcommand; :func:`main` to its own parser), and :func:`main_card`, which both run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dp_hf.card.files import render_card_for_output_dir, write_readme

__all__ = ["add_card_arguments", "main", "main_card"]


def add_card_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``card`` command (``output_dir``, ``--write``)."""
    parser.add_argument("output_dir", help="training output or checkpoint directory (with privacy.json)")
    parser.add_argument("--write", action="store_true", help="write OUTPUT_DIR/README.md instead of printing")


def main_card(args: argparse.Namespace) -> int:
    """``dp-hf card OUTPUT_DIR [--write]``: print the card, or write it to ``OUTPUT_DIR/README.md``.

    Bad input raises ``ValueError`` (the ``dp-hf`` command turns it into a usage error, status 2).
    """
    card = render_card_for_output_dir(args.output_dir)
    if getattr(args, "write", False):
        path = write_readme(args.output_dir, card)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(card)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dp_hf.card OUTPUT_DIR [--write]``."""
    parser = argparse.ArgumentParser(
        prog="python -m dp_hf.card", description="Render a dp_hf privacy model card."
    )
    add_card_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main_card(args)
    except ValueError as err:
        parser.error(str(err))
    return 2  # unreachable: parser.error exits
