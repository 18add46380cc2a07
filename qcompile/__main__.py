"""`python -m qcompile` runs the CLI."""

from qcompile.cli import main

main()
