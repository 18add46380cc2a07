"""`qcompile serve ART [options]`: `qruntime serve`, for users who installed qcompile.

The options, their checks and the server are the runtime's (qruntime.serve); this verb hands its
arguments to the runtime's parser unchanged, so `qcompile serve --help` lists the same options.
"""

from __future__ import annotations

import click
from qruntime.cli import main as qruntime_main


@click.command(
    "serve",
    add_help_option=False,  # --help goes to the runtime's parser, which knows the options
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (`qcompile serve --help` lists the options)."""
    code = qruntime_main(["serve", *args], prog="qcompile")
    if code:
        raise SystemExit(code)
