"""`python -m qruntime run ART PROMPT [options]` (see qruntime.cli)."""

import sys

from qruntime.cli import main

if __name__ == "__main__":  # a spawned child (the server's engine process) imports this module as __mp_main__
    sys.exit(main())
