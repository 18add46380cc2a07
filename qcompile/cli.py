"""The `qcompile` command line: one click group, one module per verb under qcompile/commands/."""

from __future__ import annotations

import importlib
import logging
import signal
import threading
from types import MappingProxyType

import click
import qruntime  # cheap: the package's names load lazily

from qcompile.errors import QCompileError

# verb -> help line; qcompile.commands.<verb, "-" as "_"> defines a click command named `command`
_VERBS = MappingProxyType(
    {
        "compile": "Stream a Hugging Face Qwen3 checkpoint into a compiled artifact.",
        "inspect": "Summarise an artifact: model, scheme, sizes, passes, KV layout, tuned devices.",
        "verify": "Check every file of an artifact against the sha256 in its manifest.",
        "run": "Generate text from an artifact with the runtime (prints timings).",
        "serve": "Serve an artifact over an OpenAI-compatible HTTP API (as `qruntime serve`).",
        "tune": "Time the GPU kernels for an artifact on this GPU; store the winners in it.",
        "bench": "Measure TTFT, TPOT and tokens/s of an artifact on this machine.",
        "eval": "Perplexity, KL and top-1 agreement of an artifact against its source checkpoint.",
        "eval-recipes": "Compile a checkpoint with several recipes and evaluate each, in one table.",
        "export": "Write an artifact as a compressed-tensors checkpoint (transformers, vLLM, SGLang).",
        "publish": "Ship an artifact with its model card and runtime wheel to a folder or the hub.",
        "pull": "Download an artifact from the Hugging Face Hub (hf://org/name) and verify every file.",
        "synth": "Write a random-weight Qwen3 checkpoint of a named preset, with a local tokenizer.",
    }
)


INTERRUPTED = "interrupted; no partial output was left behind"


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup runs as for Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


class UserError(click.ClickException):
    """A QCompileError or an interruption, shown as one line on stderr."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _LazyGroup(click.Group):
    """Imports a verb's module only when that verb runs (or its --help is shown); turns user
    errors into a clean message and exit code 1, and Ctrl-C into exit code 130. SIGINT's handler is
    Python's own, left as it is: a process started with SIGINT ignored (a shell script's `cmd &`)
    keeps ignoring it, and SIGTERM is the way to stop it."""

    def invoke(self, ctx: click.Context):
        main_thread = threading.current_thread() is threading.main_thread()
        # unwind on SIGTERM like on Ctrl-C, so temporary directories are removed
        previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
        try:
            return super().invoke(ctx)
        except QCompileError as exc:
            raise UserError(str(exc)) from exc
        except KeyboardInterrupt as exc:
            raise UserError(INTERRUPTED, exit_code=130) from exc
        except _Terminated as exc:
            raise UserError(INTERRUPTED, exit_code=143) from exc
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _VERBS:
            return None
        return importlib.import_module(f"qcompile.commands.{name.replace('-', '_')}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, text in _VERBS.items()])


@click.group(cls=_LazyGroup)
@click.version_option(package_name="qcompile", message=f"qcompile %(version)s (qruntime {qruntime.__version__})")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details.")
def main(verbose: bool) -> None:
    """qcompile: compile Qwen3 checkpoints into PTPC-FP8 artifacts for the qruntime engine."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(message)s")
