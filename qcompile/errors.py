"""The error types users see. Each message names the file, key or tensor at fault."""

import reprlib


class QCompileError(Exception):
    """Base of every error the CLI reports as a clean message (exit code 1)."""


class CheckpointError(QCompileError):
    """The source checkpoint is malformed, incomplete or unsupported."""


class RecipeError(QCompileError):
    """A recipe file or override is invalid."""


class PlanError(QCompileError):
    """The recipe cannot be applied to this model (for example a fusion that does not fit)."""


class TensorValueError(QCompileError):
    """A source tensor holds values that cannot be compiled (NaN or Inf)."""


class ArtifactError(QCompileError):
    """The output artifact cannot be written or does not verify."""


class EvalError(QCompileError):
    """An artifact, its reference and the evaluation text cannot be evaluated together."""


class PublishError(QCompileError):
    """An artifact cannot be published: it does not verify, its reports or runtime wheel are missing or
    malformed, or the target holds something else."""


class HubError(QCompileError):
    """A hub target is malformed, no token is found, the hub refuses a request, or the repo holds
    another artifact."""


class ExportError(QCompileError):
    """An artifact cannot be exported: it does not verify, its layout is not supported by the format
    (tp > 1), or the target exists."""


SHOWN_CHARS = 60  # the most characters of a user's value an error message echoes


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` as an error message echoes it: its repr cut to `limit` characters, at a bounded cost
    whatever it is (a 10 MB string, a list nested 10,000 deep, an integer of 10,000 digits)."""
    text = _BoundedRepr(limit).repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _BoundedRepr(reprlib.Repr):
    """reprlib's bounded repr (a few items of each container, a few levels deep), with integers
    too long for `repr` (Python refuses over 4,300 digits) shown by their size."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = limit
        self.maxlevel = 3

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.maxlong:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_instance(self, x: object, level: int) -> str:
        try:
            return super().repr_instance(x, level)
        except (ValueError, RecursionError):
            return f"<{type(x).__name__}>"
