"""What every `qruntime` verb shares (run, pull, serve): the user-error type, the exit codes, the
artifact argument's help and the line printed once an artifact has loaded."""

from __future__ import annotations

from typing import Any

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C

ARTIFACT_HELP = "Artifact directory written by `qcompile compile`, or hf://org/name[@revision] on the Hugging Face Hub."


class RunError(Exception):
    """A user error (bad artifact, options or prompt), reported as one line and exit code 1."""

    @classmethod
    def of(cls, exc: BaseException, prefix: str = "") -> RunError:
        """`exc`'s message on one line (a multi-line message's later lines follow, joined by "; ")."""
        first, *rest = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        return cls(prefix + first + (" " + "; ".join(rest) if rest else ""))


def load_line(description: dict[str, Any], seconds: float) -> str:
    d = description
    return (
        f"loaded {d['artifact']} in {seconds:.2f} s: device {d['device']}, dtype {d['dtype']}, "
        f"kv cache {d['kv_cache']}, max_model_len {d['max_model_len']}"
    )
