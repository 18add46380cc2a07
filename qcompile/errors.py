"""The error types users see. Each message names the file, key or tensor at fault (echoing user values
through qruntime.shown, bounded)."""


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
