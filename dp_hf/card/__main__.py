"""``python -m dp_hf.card OUTPUT_DIR [--write]`` (see :mod:`dp_hf.card.cli`)."""

import sys

from dp_hf.card.cli import main

if __name__ == "__main__":
    sys.exit(main())
