"""SIGINT's disposition for a child process a test signals. An ignored SIGINT is inherited across
exec (only handlers are reset; Popen's restore_signals does not touch SIGINT), and pytest started
as a shell script's `cmd &` runs with SIGINT ignored: so a test that sends SIGINT, or one
that needs it ignored, sets the child's disposition itself. (A helper module at tests/, importable
from every test folder as the rootdir conftest puts tests/ on sys.path.)"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable


def sigint_as(disposition: signal.Handlers) -> Callable[[], object]:
    """A Popen `preexec_fn` that starts the child with SIGINT set to `disposition` (SIG_DFL: Python
    turns it into KeyboardInterrupt; SIG_IGN: ignored, as in a background job of a script)."""
    return functools.partial(signal.signal, signal.SIGINT, disposition)
