"""`python -m qcompile` runs the CLI."""

from qcompile.cli import main

if __name__ == "__main__":  # `qcompile serve`'s engine process, spawned, imports this module as __mp_main__
    main()
