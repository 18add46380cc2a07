"""What every `qruntime` verb shares (run, pull, serve): the user-error type, the exit codes, the
artifact argument's help, --speculative's help and check, and the line printed once an artifact has
loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qruntime.engine.speculative.config import SpeculativeConfig

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C

ARTIFACT_HELP = "Artifact directory written by `qcompile compile`, or hf://org/name[@revision] on the Hugging Face Hub."
SPECULATIVE_HELP = (
    "Speculative decoding, off by default. SPEC is METHOD[:key=value,...]: prompt-lookup (drafts the tokens that "
    "followed an earlier occurrence of the last few tokens in the prompt and output: n-grams of prompt_lookup_max=4 "
    "down to prompt_lookup_min=2 tokens), draft-model:draft_model=PATH (a smaller artifact with the same "
    "vocabulary drafts) or layer-skip (the model drafts without the decoder layers its artifact names); e.g. "
    "prompt-lookup:num_tokens=6. One step verifies up to num_tokens drafts (1 to 16; default 12 for prompt-lookup, "
    "4 for the others; adaptive=false keeps that many; on a GPU drafting stops at batch sizes where it is measured "
    "slower than decoding without it, gate=false drafts anyway). Outputs keep the model's distribution (greedy ones are the tokens decoding without it gives); prompt "
    "lookup pays when the output repeats its prompt. tp = 1 only."
)


class RunError(Exception):
    """A user error (bad artifact, options or prompt), reported as one line and exit code 1."""

    @classmethod
    def of(cls, exc: BaseException, prefix: str = "") -> RunError:
        """`exc`'s message on one line (a multi-line message's later lines follow, joined by "; ")."""
        first, *rest = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        return cls(prefix + first + (" " + "; ".join(rest) if rest else ""))


def speculative_config(text: str | None, flag: str = "--speculative") -> SpeculativeConfig | None:
    """--speculative's SPEC as a SpeculativeConfig (None when not given); a bad one is a RunError naming
    the flag and what is wrong (SpeculativeConfig.parse's message)."""
    if text is None:
        return None
    from qruntime.engine.speculative.config import SpeculativeConfig  # here: `--help` imports nothing heavy

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise RunError.of(exc, f"{flag}: ") from None


def load_line(description: dict[str, Any], seconds: float) -> str:
    d = description
    phases = d.get("load_seconds", {})
    split = ", ".join(f"{name.replace('_', ' ')} {s:.2f}" for name, s in phases.items() if name != "total")
    return (
        f"loaded {d['artifact']} in {seconds:.2f} s{f' ({split})' if split else ''}: device {d['device']}, "
        f"dtype {d['dtype']}, "
        f"kv cache {d['kv_cache']}, max_model_len {d['max_model_len']}"
        + (f", speculative {d['speculative']}" if d.get("speculative") else "")
        + (f", kernels prebuilt: {d['kernel_prebuild']}" if d.get("kernel_prebuild") else "")
    )
