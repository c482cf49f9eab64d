"""``python -m dp_hf.audit``: see :mod:`dp_hf.audit.cli`."""

import sys

from dp_hf.audit.cli import main

sys.exit(main())
