"""`python -m qruntime run ART PROMPT [options]` (see qruntime.cli)."""

import sys

from qruntime.cli import main

sys.exit(main())
