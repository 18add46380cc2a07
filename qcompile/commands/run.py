"""`qcompile run ART PROMPT`: generate text from an artifact with the runtime (prints timings).

The options and the work are qruntime.commands.run's (the same as `python -m qruntime run`); this verb only
declares them to click and reports the runtime's user errors as the other verbs do.
"""

from __future__ import annotations

from typing import Any

import click
from qruntime.commands.common import RunError
from qruntime.commands.run import OPTIONS, options_from, run

from qcompile.errors import QCompileError


def _with_options(function):
    for o in reversed(OPTIONS):
        if o.type is None:
            decorate = click.option(o.flag, o.dest, is_flag=True, help=o.help)
        else:
            decorate = click.option(o.flag, o.dest, type=o.type, multiple=o.repeat, metavar=o.metavar, help=o.help)
        function = decorate(function)
    return function


@click.command("run")
@click.argument("artifact")  # a str: a Path would fold the "//" of hf://org/name
@click.argument("prompt")
@_with_options
def command(artifact: str, prompt: str, **values: Any) -> None:
    """Generate text for PROMPT from ARTIFACT (a compiled artifact directory, or
    hf://org/name[@revision] on the Hugging Face Hub) with the runtime.

    The text streams to stdout; the load line (device, dtype, KV cache) and a summary (token
    counts, TTFT, TPOT, tokens/s, finish reason) go to stderr. With --chat, PROMPT is the user's
    message, rendered with the artifact's chat template.
    """
    try:
        run(options_from({"artifact": artifact, "prompt": prompt, **values}))
    except RunError as exc:
        raise QCompileError(str(exc)) from exc
