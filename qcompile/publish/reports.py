"""Evaluation and benchmark results, as the `--json` of `qcompile eval`, `eval-recipes` and `bench`
print them, read back for the model card: each file is recognised by its shape, checked, and
rendered as a Markdown table."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from qruntime import bounded_json
from qruntime.artifact import LINK_REFUSED, ArtifactFormatError, artifact_path

from qcompile.errors import PublishError

EVAL, EVAL_RECIPES, BENCH = "eval", "eval-recipes", "bench"
REPORTS = "reports"  # ART/reports/*.json: picked up by publish (qcompile/publish/publication.py)
MAX_REPORT_BYTES = 64 << 20  # a results file is a few KB
_EVAL_METRICS = ("ppl_artifact", "ppl_ratio", "kl", "top1_agreement")
_BENCH_METRICS = (
    "batch",
    "input_len",
    "output_len",
    "ttft_ms",
    "tpot_ms",
    "decode_tokens_per_s",
    "output_tokens_per_s",
)


@dataclass(frozen=True)
class Report:
    """One results file: its name (as published under reports/), kind, parsed data and exact bytes."""

    name: str
    kind: str  # EVAL | EVAL_RECIPES | BENCH
    data: dict[str, Any]
    raw: bytes


def report_kind(data: Any) -> str | None:
    """EVAL, EVAL_RECIPES or BENCH for JSON of that command's shape, else None."""
    if not isinstance(data, dict):
        return None
    if all(key in data for key in (*_EVAL_METRICS, "ppl_reference", "tokens")):
        return EVAL
    rows = data.get("rows")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        if all("recipe" in r and "ppl_artifact" in r for r in rows):
            return EVAL_RECIPES
        if all("batch" in r and "tpot_ms" in r for r in rows):
            return BENCH
    return None


def read_report(path: Path, kinds: Iterable[str]) -> Report:
    """Read a results file that must be one of `kinds`; errors name the file and what is wrong."""
    kinds = tuple(kinds)
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise PublishError(
                f"{path}: {path.stat().st_size} bytes, more than a results file holds ({MAX_REPORT_BYTES})"
            )
        raw = path.read_bytes()
        data = bounded_json.loads(raw, what=str(path))
    except OSError as exc:
        raise PublishError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    except ValueError as exc:  # malformed, too deep, or a lone surrogate
        raise PublishError(f"{path}: not JSON ({exc})") from exc
    kind = report_kind(data)
    wanted = " or ".join(f"`qcompile {k} --json`" for k in kinds)
    if kind not in kinds:
        found = f" (it looks like `qcompile {kind} --json` output)" if kind else ""
        raise PublishError(f"{path}: not the output of {wanted}{found}")
    _check_numbers(path, kind, data)
    return Report(path.name, kind, data, raw)


def collect_reports(root: Path, evals: Iterable[str | Path], benches: Iterable[str | Path]) -> tuple[Report, ...]:
    """ART/reports/*.json (each confined to the artifact: a link there is an error), then the --eval and
    --bench files; two files of one name must be the same bytes."""
    reports = [read_report(p, (EVAL, EVAL_RECIPES, BENCH)) for p in artifact_reports(root)]
    reports += [read_report(Path(p), (EVAL, EVAL_RECIPES)) for p in evals]
    reports += [read_report(Path(p), (BENCH,)) for p in benches]
    by_name: dict[str, Report] = {}
    for report in reports:
        seen = by_name.setdefault(report.name, report)
        if seen.raw != report.raw:
            raise PublishError(
                f"two different reports are named {report.name} (both would be {REPORTS}/{report.name}); rename one"
            )
    return tuple(by_name.values())


def artifact_reports(root: Path) -> list[Path]:
    """The artifact's reports/*.json, listed by the manifest or not (docs/ARTIFACT.md), each a regular
    file of the artifact reached through no link (qruntime.artifact.artifact_path)."""
    folder = root / REPORTS
    if folder.is_symlink():
        raise PublishError(f"{folder}: {LINK_REFUSED}")
    if not folder.is_dir():
        return []
    try:
        return [
            artifact_path(root, f"{REPORTS}/{name}") for name in sorted(os.listdir(folder)) if name.endswith(".json")
        ]
    except ArtifactFormatError as exc:
        raise PublishError(str(exc)) from exc


def _check_numbers(path: Path, kind: str, data: dict[str, Any]) -> None:
    rows = [data] if kind == EVAL else data["rows"]
    keys = _EVAL_METRICS if kind != BENCH else _BENCH_METRICS
    for index, row in enumerate(rows):
        for key in keys:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                where = "" if kind == EVAL else f"rows[{index}]."
                raise PublishError(f"{path}: {where}{key} must be a number (got {value!r})")


def render_reports(reports: Iterable[Report]) -> str:
    """The card's results sections (Markdown); empty when there are none."""
    reports = list(reports)
    evals = [r for r in reports if r.kind == EVAL]
    recipes = [r for r in reports if r.kind == EVAL_RECIPES]
    benches = [r for r in reports if r.kind == BENCH]
    parts = []
    if evals or recipes:
        parts.append(
            "## Evaluation\n\nPerplexity of this artifact and of its reference on the same text, their ratio, the mean "
            "KL(reference || artifact) of the next-token distributions (nats per token) and how often both pick the "
            "same most likely next token (`qcompile eval`).\n"
        )
    if evals:
        lines = [
            "| data | tokens | reference | dtype | ppl | reference ppl | ppl ratio | KL nats/tok | top-1 | file |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in evals:
            d = r.data
            lines.append(
                f"| {_name(d.get('data'))} | {d['tokens']} | {_name(d.get('reference'))} ({d.get('reference_kind', '?')}) "
                f"| {d.get('dtype', '?')} | {_num(d['ppl_artifact'], '.4f')} | {_num(d['ppl_reference'], '.4f')} "
                f"| {_num(d['ppl_ratio'], '.5f')} | {_num(d['kl'], '.3e')} | {_pct(d['top1_agreement'])} "
                f"| `reports/{r.name}` |"
            )
        parts.append("\n".join(lines) + "\n")
    for r in recipes:
        d = r.data
        head = (
            f"Recipes compared on {_name(d.get('checkpoint'))} (`qcompile eval-recipes`, `reports/{r.name}`): "
            f"{d.get('tokens', '?')} tokens of {_name(d.get('data'))}, reference {_name(d.get('reference'))} "
            f"({d.get('reference_kind', '?')}, {d.get('dtype', '?')}, ppl {_num(d.get('ppl_reference'), '.4f')})."
        )
        lines = ["| recipe | ppl | ppl ratio | KL nats/tok | top-1 |", "|---|---:|---:|---:|---:|"]
        for row in d["rows"]:
            lines.append(
                f"| {row['recipe']} | {_num(row['ppl_artifact'], '.4f')} | {_num(row['ppl_ratio'], '.5f')} "
                f"| {_num(row['kl'], '.3e')} | {_pct(row['top1_agreement'])} |"
            )
        parts.append(head + "\n\n" + "\n".join(lines) + "\n")
    if benches:
        parts.append(
            "## Speed\n\nFor each batch size, that many random prompts of `input` tokens generate `output` tokens "
            "(`qcompile bench`): TTFT of the slowest request, mean TPOT, decode tokens/s (batch / TPOT) and "
            "output tokens/s over the run.\n"
        )
    for r in benches:
        parts.append(_bench_table(r))
    return "\n".join(parts)


def _bench_table(report: Report) -> str:
    d = report.data
    engine = d.get("engine") if isinstance(d.get("engine"), dict) else {}
    where = d.get("gpu") or engine.get("device", "?")
    head = f"On {where}, backend {engine.get('backend', '?')}, {engine.get('dtype', '?')} (`reports/{report.name}`)"
    if isinstance(d.get("copy_bandwidth_gb_s"), int | float):
        head += f"; the floor is the bytes a decode step reads / {d['copy_bandwidth_gb_s']:.0f} GB/s copy bandwidth"
    floor = all("floor_ms" in row for row in d["rows"])
    lines = [
        "| batch | input | output | TTFT ms | TPOT ms | decode tok/s | output tok/s |"
        + (" floor ms | TPOT / floor |" if floor else ""),
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if floor else ""),
    ]
    for row in d["rows"]:
        line = (
            f"| {row['batch']} | {row['input_len']} | {row['output_len']} | {_num(row['ttft_ms'], '.2f')} "
            f"| {_num(row['tpot_ms'], '.2f')} | {_num(row['decode_tokens_per_s'], ',.1f')} "
            f"| {_num(row['output_tokens_per_s'], ',.1f')} |"
        )
        if floor:
            line += f" {_num(row['floor_ms'], '.3f')} | {_num(row.get('tpot_over_floor'), '.2f')}× |"
        lines.append(line)
    return head + ".\n\n" + "\n".join(lines) + "\n"


def _num(value: Any, fmt: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return "n/a"
    return format(value, fmt)


def _pct(value: Any) -> str:
    return "n/a" if not isinstance(value, int | float) or math.isnan(value) else f"{100 * value:.2f}%"


def _name(path: Any) -> str:
    """A path's last component (the card does not show the publisher's directories)."""
    if not isinstance(path, str) or not path:
        return "?"
    return PurePath(path).name or path
