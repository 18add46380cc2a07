"""`qcompile eval ART --reference CKPT --data FILE`: perplexity, KL and top-1 agreement of an artifact
against its source checkpoint on the same text."""

from __future__ import annotations

import json
from pathlib import Path

import click

from qcompile.evaluate.accuracy import DEFAULT_WINDOW, EvalResult


def eval_options(function):
    """The options `eval` and `eval-recipes` share."""
    options = [
        click.option(
            "--data",
            required=True,
            type=click.Path(path_type=Path),
            help="UTF-8 text file to evaluate on (tokenized with the artifact's tokenizer).",
        ),
        click.option(
            "--window",
            type=click.IntRange(2),
            default=DEFAULT_WINDOW,
            show_default=True,
            help="Tokens per window (capped by the model's context); windows overlap by one token.",
        ),
        click.option(
            "--max-tokens", type=click.IntRange(2), default=None, help="Use only the first N tokens of the text."
        ),
        click.option("--device", default=None, help="cpu, cuda, cuda:1 … [default: cuda when available, else cpu]."),
        click.option(
            "--dtype",
            type=click.Choice(["bf16", "fp32"]),
            default="bf16",
            show_default=True,
            help="Compute dtype of both models (bf16: as served; fp32: only the quantization error is left).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table."),
        click.option("--no-progress", is_flag=True, help="No progress bar."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def data_line(result: EvalResult) -> str:
    return f"{result.data}: {result.tokens} tokens scored in {result.windows} window(s) of up to {result.window}"


@click.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--reference",
    required=True,
    type=click.Path(path_type=Path),
    help="The source checkpoint (run by transformers) or a bf16 artifact of it (run by qruntime's reference backend).",
)
@eval_options
def command(artifact, reference, data, window, max_tokens, device, dtype, as_json, no_progress) -> None:
    """Evaluate ARTIFACT against a reference model on the text of --data.

    Both models predict every next token of the text; the table gives the perplexity of each, their
    ratio (artifact / reference), the mean KL(reference || artifact) of the next-token distributions
    in nats per token, and how often both pick the same most likely token. The reference is normally
    the checkpoint ARTIFACT was compiled from, run by Hugging Face transformers.

        qcompile eval ./qwen3-8b-fp8 --reference ./Qwen3-8B --data heldout.txt
    """
    from qcompile.evaluate.accuracy import evaluate

    result = evaluate(
        artifact,
        reference,
        data,
        window=window,
        max_tokens=max_tokens,
        device=device,
        dtype=dtype,
        progress=not no_progress,
    )
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    rows = [
        ("artifact", f"{result.artifact} ({result.recipe}; {result.device}, {result.dtype}, {result.backend} backend)"),
        ("reference", f"{result.reference} ({result.reference_kind}, {result.dtype})"),
        ("data", data_line(result)),
        ("ppl", f"{result.ppl_artifact:.4f} artifact, {result.ppl_reference:.4f} reference"),
        ("ppl ratio", f"{result.ppl_ratio:.5f} (artifact / reference)"),
        ("KL", f"{result.kl:.3e} nats/token, KL(reference || artifact)"),
        ("top-1", f"{100 * result.top1_agreement:.2f}% same most likely next token"),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
