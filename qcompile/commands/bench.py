"""`qcompile bench ART`: TTFT, TPOT and tokens/s of an artifact at several batch sizes."""

from __future__ import annotations

import json
from pathlib import Path

import click
from qruntime.commands.common import SPECULATIVE_HELP


def _speculative(ctx: click.Context, param: click.Parameter, value: str | None):
    """--speculative's SPEC as a SpeculativeConfig; a bad one is click's usage error, with the parser's reason."""
    if value is None:
        return None
    from qruntime.engine.speculative.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("bench")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--input-len", type=click.IntRange(1), default=128, show_default=True, help="Prompt tokens (random ids).")
@click.option(
    "--output-len", type=click.IntRange(2), default=128, show_default=True, help="Generated tokens (EOS ignored)."
)
@click.option("--batch", "batches", default="1,4,16,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--device", default=None, help="Torch device [default: cuda when available, else cpu].")
@click.option("--backend", type=click.Choice(["auto", "triton", "reference"]), default="auto", show_default=True)
@click.option(
    "--speculative",
    metavar="SPEC",
    callback=_speculative,
    help=SPECULATIVE_HELP + " The table then adds each run's acceptance rate and tokens per verification.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def command(artifact, input_len, output_len, batches, device, backend, speculative, as_json) -> None:
    """Measure ARTIFACT: for each batch size, that many random prompts of --input-len tokens are
    submitted at once and generate --output-len tokens. Prints TTFT (slowest request), TPOT (mean),
    decode tokens/s (batch / TPOT) and output tokens/s over the run; on a GPU also the bandwidth floor
    of a decode step (the bytes it reads / measured copy bandwidth) and TPOT's ratio to it. With
    --speculative, the drafts' acceptance rate and the tokens each verification gave (random prompts:
    prompt lookup matches little but what the output repeats)."""
    import torch
    from qruntime import load
    from qruntime.artifact import read_manifest
    from qruntime.benchmark import copy_bandwidth, decode_step_bytes, measure

    sizes = [int(b) for b in batches.split(",")]
    engine = load(
        artifact,
        device,
        backend=backend,
        max_model_len=input_len + output_len + 1,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=max(2048, input_len),
        speculative=speculative,
    )
    cuda = engine.runner.device.type == "cuda"
    bandwidth = copy_bandwidth(engine.runner.device) if cuda else None
    manifest = read_manifest(artifact)
    measure(engine, min(input_len, 32), 4, 1)  # warm-up (kernel compilation)
    rows = []
    for batch in sizes:
        row = measure(engine, input_len, output_len, batch)
        if bandwidth:
            row["floor_ms"] = decode_step_bytes(manifest, batch, input_len + output_len // 2) / bandwidth * 1e3
            row["tpot_over_floor"] = row["tpot_ms"] / row["floor_ms"]
        rows.append(row)
    result = {"artifact": str(artifact), "engine": engine.description, "rows": rows}
    if bandwidth:
        result["copy_bandwidth_gb_s"] = bandwidth / 1e9
        result["gpu"] = torch.cuda.get_device_name(engine.runner.device)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"{artifact}: {engine.description['device']}, backend {engine.description['backend']}")
    header = f"{'batch':>5} {'TTFT ms':>9} {'TPOT ms':>9} {'decode tok/s':>12} {'output tok/s':>12}"
    header += f" {'floor ms':>9} {'TPOT/floor':>10}" if bandwidth else ""
    click.echo(header + (f" {'accepted':>8} {'tok/verify':>10}" if speculative else ""))
    for r in rows:
        line = f"{r['batch']:>5} {r['ttft_ms']:>9.2f} {r['tpot_ms']:>9.2f} {r['decode_tokens_per_s']:>12.1f} {r['output_tokens_per_s']:>12.1f}"
        line += f" {r['floor_ms']:>9.3f} {r['tpot_over_floor']:>10.2f}" if bandwidth else ""
        click.echo(
            line + (f" {r['acceptance_rate']:>8.1%} {r['tokens_per_verification']:>10.2f}" if speculative else "")
        )
