"""`qruntime run ART PROMPT`: generate text from an artifact, streamed, then its timings.

The options are one table (OPTIONS) and the work one function (`run`), shared by the argparse CLI
(qruntime.cli) and the compiler's `qcompile run` (qcompile imports this module; the runtime never
imports qcompile). Importing this module is cheap: torch and the model load only when a run starts, after
the options and the artifact's path have been checked, so a user's mistake is reported at once.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, TextIO

from qruntime.artifact import ArtifactFormatError, check_artifact_dir
from qruntime.commands.common import SPECULATIVE_HELP, RunError, load_line, speculative_config
from qruntime.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qruntime.hub import is_hub_url
from qruntime.shown import shown
from qruntime.terminal import for_terminal

PROMPT_HELP = "Prompt text (with --chat: the user's message)."


@dataclass(frozen=True)
class RunOptions:
    """One `run`: what to load, how to sample, how to print."""

    artifact: str
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    chat: bool = False
    device: str | None = None
    dtype: str | None = None
    verify: bool = False
    max_model_len: int | None = None
    speculative: str | None = None
    no_stream: bool = False
    as_json: bool = False


@dataclass(frozen=True)
class Option:
    """A command-line option of `run`; `dest` is its RunOptions field. type None = an on/off flag."""

    flag: str
    dest: str
    type: type | None
    help: str
    metavar: str | None = None
    repeat: bool = False


OPTIONS: tuple[Option, ...] = (
    Option("--max-tokens", "max_tokens", int, "Generate at most N new tokens (default 64).", "N"),
    Option("--temperature", "temperature", float, "Sampling temperature; 0 (default) is greedy.", "T"),
    Option("--top-p", "top_p", float, "Nucleus sampling: keep the smallest set of tokens of mass P (default 1.0, off).", "P"),
    Option("--top-k", "top_k", int, "Sample among the K most likely tokens (default 0, off).", "K"),
    Option("--min-p", "min_p", float, "Drop tokens less likely than P times the likeliest (default 0, off).", "P"),
    Option("--min-tokens", "min_tokens", int, "Generate at least N tokens before an end-of-sequence or stop token (default 0).", "N"),
    Option("--seed", "seed", int, "Seed of the sampler, for a reproducible sampled generation.", "SEED"),
    Option("--stop", "stop", str, "Stop when this text is generated (not printed); repeat for several.", "TEXT", True),
    Option("--ignore-eos", "ignore_eos", None, "Keep generating past the model's end-of-sequence tokens."),
    Option("--chat", "chat", None, "Send PROMPT as a user message through the artifact's chat template."),
    Option("--device", "device", str, "Torch device: cpu, cuda, cuda:1 ... (default cuda when available, else cpu).", "DEVICE"),
    Option("--dtype", "dtype", str, "Compute dtype: bfloat16, float16 or float32 (default the model's).", "DTYPE"),
    Option("--verify", "verify", None, "Check every file's sha256 against the manifest before loading (slower)."),
    Option("--max-model-len", "max_model_len", int, "Context length in tokens, prompt + output (default the model's, capped by the KV cache).", "LEN"),
    Option("--speculative", "speculative", str, SPECULATIVE_HELP, "SPEC"),
    Option("--no-stream", "no_stream", None, "Print the text when generation ends instead of token by token."),
    Option(
        "--json", "as_json", None,
        "Print one JSON object instead of text: text, token_ids, finish_reason, stop_reason, error, ttft_s, tpot_s, "
        "tokens_per_s, prompt_tokens, output_tokens, device, dtype (and speculative's counts with --speculative).",
    ),
)  # fmt: skip


def options_from(values: dict[str, Any]) -> RunOptions:
    """RunOptions from parsed values keyed by field name (None = not given: the default)."""
    names = {f.name for f in fields(RunOptions)}
    given = {k: v for k, v in values.items() if k in names and v is not None}
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    return RunOptions(**given)


# --- the checks made before the model loads ------------------------------------------------------
def sampling_params(options: RunOptions) -> SamplingParams:
    """The request's SamplingParams; a value it refuses is a RunError naming the flag as typed (the
    ranges are SamplingParams' own: each field it names is the `dest` of the flag that set it)."""
    try:
        return SamplingParams(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            min_p=options.min_p,
            min_tokens=options.min_tokens,
            seed=options.seed,
            stop=options.stop,
            ignore_eos=options.ignore_eos,
        )
    except InvalidSamplingParams as exc:
        flags = {o.dest: o.flag for o in OPTIONS}
        raise RunError(
            "; ".join(
                f"{flags[p.field]} {p.rule} (got {shown(p.value)})" if p.field in flags else str(p)
                for p in exc.problems
            )
        ) from None


def check_local_artifact(artifact: str) -> None:
    """A local ART must be an artifact directory (qruntime.artifact.check_artifact_dir: not missing, not
    a file, not a Hugging Face checkpoint); an hf:// name is checked when it is pulled."""
    if is_hub_url(artifact):
        return
    try:
        check_artifact_dir(artifact)
    except ArtifactFormatError as exc:
        raise RunError.of(exc) from None


# --- the work -------------------------------------------------------------------------------------
def run(options: RunOptions, out: TextIO | None = None, err: TextIO | None = None) -> dict[str, Any]:
    """Load the artifact, generate for the prompt and print (text streamed to `out`, the load and
    summary lines to `err`; with as_json one JSON object to `out` and nothing to `err`).

    Returns the result record (the JSON fields). Raises RunError for anything the user can fix."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    # the user's mistakes first, while nothing heavy is imported: qruntime.load imports torch (seconds)
    params = sampling_params(options)
    speculative = speculative_config(options.speculative)
    check_local_artifact(options.artifact)
    import qruntime  # here, not at import: `--help` stays fast (no torch)

    started = time.perf_counter()
    try:
        engine = qruntime.load(
            options.artifact,
            options.device,
            options.dtype,
            verify=options.verify,
            max_model_len=options.max_model_len,
            max_num_seqs=1,  # one request: size a CPU cache for one sequence, not a server's batch
            speculative=speculative,
        )
    except (ArtifactFormatError, ValueError) as exc:
        raise RunError.of(exc) from None
    if not options.as_json:
        print(load_line(engine.description, time.perf_counter() - started), file=err, flush=True)

    prompt: str | list[int] = options.prompt
    if options.chat:
        try:
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": options.prompt}])
        except ValueError as exc:
            raise RunError.of(exc, "--chat: ") from None
    printing = not (options.as_json or options.no_stream)
    # on a terminal, what the model wrote is shown, never acted on (escape sequences, bidi overrides)
    visible = for_terminal if _is_terminal(out) else str
    output = None
    try:
        for delta in engine.stream(prompt, params):
            if printing and delta.text:
                out.write(visible(delta.text))
                out.flush()
            output = delta.output
    except qruntime.InvalidRequest as exc:
        raise RunError.of(exc) from None
    record = result_record(output, engine.description, engine.speculative_stats)
    if options.as_json:
        print(json.dumps(record), file=out, flush=True)  # ASCII-only: safe whatever the terminal's encoding
    else:
        print("" if printing else visible(output.text), file=out, flush=True)  # end the text's line
        print(summary_line(record), file=err, flush=True)
    if output.finish_reason == "error":  # the engine's log line above has the cause
        raise RunError(f"generation failed after {len(output.token_ids)} tokens: {output.error}")
    return record


# --- what is printed ------------------------------------------------------------------------------
def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def result_record(output: Any, description: dict[str, Any], speculative: Any = None) -> dict[str, Any]:
    """The JSON fields of a finished request. tokens_per_s: output tokens over the whole request
    (prefill included); tpot_s is None with fewer than two output tokens. speculative (the engine's
    SpeculativeStats, this request's alone: the engine ran nothing else): its counts, when given."""
    t = output.timings
    e2e = t.e2e
    record = {
        "text": output.text,
        "token_ids": list(output.token_ids),
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
        "error": output.error,
        "ttft_s": t.ttft,
        "tpot_s": t.tpot,
        "tokens_per_s": len(output.token_ids) / e2e if e2e else None,
        "prompt_tokens": len(output.prompt_token_ids),
        "output_tokens": len(output.token_ids),
        "device": description["device"],
        "dtype": description["dtype"],
    }
    if speculative is not None:
        record["speculative"] = {
            "drafted": speculative.drafted,
            "accepted": speculative.accepted,
            "verifications": speculative.verifications,
            "acceptance_rate": speculative.acceptance_rate,
            "tokens_per_verification": speculative.tokens_per_verification,
        }
    return record


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def summary_line(record: dict[str, Any]) -> str:
    r = record
    rate = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
    finish = r["finish_reason"] + (f" ({r['stop_reason']!r})" if r["stop_reason"] is not None else "")
    spec = r.get("speculative")
    drafts = (
        ""
        if spec is None
        else f" | drafts accepted {spec['accepted']}/{spec['drafted']}, "
        f"{spec['tokens_per_verification']:.2f} tokens per verification"
    )
    return (
        f"prompt {r['prompt_tokens']} tokens, output {r['output_tokens']} tokens | "
        f"TTFT {_ms(r['ttft_s'])}, TPOT {_ms(r['tpot_s'])}, {rate} tokens/s{drafts} | finish: {finish}"
    )
