"""Speculative decoding extrapolated to a large target at batch 1: a MODEL built from measurements, not a
measurement (issue 19 asks for it beside the trained pair's figures).

At batch 1 a step of a large model reads every weight whatever its few rows, so a verification of k
drafts costs about a decode step: the measured batch-1 TPOT of the target (bench/decode_bench.py) plus
what its GEMMs take at M = k + 1 rows instead of 1 (the tuned kernel times that decode_bench records
per shape and M, times the layers). A round is then

    host + k * draft_step + verify(k)   for   E tokens

    host        the host time of a round the GPU does not overlap: step - forward of a prompt-lookup
                row with every step drafting (bench/spec_step_profile.py, the trained pair)
    draft_step  prompt lookup: 0 (an n-gram search on the host, inside `host`); draft model: the
                draft's measured batch-1 TPOT (--draft-ms, or a spec_step_profile JSON's plain row);
                layer skip: the target's TPOT times the share of layers the draft keeps (the pair's
                searched draft_layers over its layers)
    E           tokens per verification measured on the trained pair (bench/spec_bench.py), per
                method and task: the 104M pair's acceptance, not the large model's

and the modelled time a token is s * round / E + (1 - s) * TPOT, where s is the share of the pair's
output tokens that verifications emitted (the rest came from plain steps); speed-up = TPOT over it. What it leaves out: a larger draft's own host
work where its steps are shorter than the host's, attention over long contexts (k + 1 rows read the
context k + 1 times), the lm_head at M = k + 1 (bandwidth-bound: little), and acceptance itself.

    python bench/spec_extrapolate.py --decode bench/results/decode_bench_qwen3-8b_f81ec31_h100.json \\
        --spec bench/results/spec_bench_trained_pl_k_ac7551a_h200.json \\
        --spec bench/results/spec_bench_trained_ac7551a_h200.json \\
        --profile bench/results/spec_step_profile_trained_ac7551a_h200.json \\
        --draft-profile bench/results/spec_step_profile_qwen3-0.6b_b7a3e77_h200.json --preset qwen3-8b
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_bench import report_header  # noqa: E402

NOTE = "a model from measurements (see the module docstring), not a measurement"


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: {exc}") from None


def batch1(rows: Sequence[dict[str, Any]], what: Path) -> dict[str, Any]:
    """decode_bench's batch-1 row."""
    for row in rows:
        if row.get("batch") == 1:
            return row
    raise SystemExit(f"{what}: no batch-1 decode row")


def gemm_extra_ms(tuned: dict[str, dict[str, list]], rows: int, layers: int) -> float:
    """What a step's tuned PTPC GEMMs (one of each shape a layer) take more at `rows` rows than at 1,
    times `layers`: the smallest tuned M at least `rows` (ms)."""
    extra = 0.0
    for shape, by_m in tuned.items():
        if not shape.startswith("PTPCLinear:"):
            continue
        ms = sorted(int(m) for m in by_m)
        fit = next((m for m in ms if m >= rows), ms[-1])
        extra += float(by_m[str(fit)][1]) - float(by_m["1"][1])
    return extra * layers / 1000.0


def host_ms(profile: dict[str, Any], what: Path) -> float:
    """step - forward (ms) of the profile's batch-1 prompt-lookup row that drafts every step."""
    for row in profile.get("rows", ()):
        if (
            row.get("batch") == 1
            and row.get("mode", "").startswith("prompt-lookup:")
            and "adaptive=false" in row["mode"]
        ):
            parts = row["parts"]
            return parts["step"]["ms_per_step"] - parts["gpu_forward"]["ms_per_step"]
    raise SystemExit(f"{what}: no batch-1 'prompt-lookup:adaptive=false' row")


def plain_ms(profile: dict[str, Any], what: Path) -> float:
    """The profile's batch-1 plain ms per token."""
    for row in profile.get("rows", ()):
        if row.get("batch") == 1 and row.get("mode") == "plain":
            return float(row["ms_per_token_per_request"])
    raise SystemExit(f"{what}: no batch-1 plain row")


def layer_share(spec: dict[str, Any]) -> float | None:
    """The share of the pair's target layers its layer-skip draft keeps (None: no draft layers)."""
    target = spec.get("artifacts", {}).get("target", {})
    skipped = (target.get("speculative") or {}).get("draft_layers")
    layers = target.get("num_hidden_layers")
    return None if not skipped or not layers else 1 - len(skipped) / layers


def verified_share(row: dict[str, Any]) -> float:
    """The share of a spec_bench cell's output tokens that verifications emitted (the rest were plain
    steps: prompt lookup found nothing, or the request paused): verifications x tokens each over the
    output tokens of every timed pass (the counts cover them all)."""
    passes = len(row.get("spec_pass_tokens_per_s") or [None])
    emitted = row["verifications"] * row["tokens_per_verification"]
    return min(1.0, emitted / (row["output_tokens"] * passes))


def extrapolate(
    decode: dict[str, Any],
    specs: Sequence[dict[str, Any]],
    host: float,
    draft_ms: float | None,
    layers: int,
    where: Path,
) -> list[dict[str, Any]]:
    """A modelled row per batch-1 (method, task) of the spec results (see the module docstring)."""
    plain = batch1(decode["decode"], where)
    tpot, floor = float(plain["tpot_ms"]), float(plain["floor_ms"])
    out = []
    for spec in specs:
        share = layer_share(spec)
        for row in spec["results"]:
            if row["batch"] != 1 or not row.get("tokens_per_verification"):
                continue
            method, k = row["speculative"]["method"], int(row["speculative"]["num_tokens"])
            if method == "prompt-lookup":
                step = 0.0
            elif method == "draft-model" and draft_ms is not None:
                step = draft_ms
            elif method == "layer-skip" and share is not None:
                step = tpot * share
            else:
                continue
            verify = tpot + gemm_extra_ms(decode.get("tuned", {}), k + 1, layers)
            tokens = float(row["tokens_per_verification"])
            covered = verified_share(row)
            per_token = covered * (host + k * step + verify) / tokens + (1 - covered) * tpot
            out.append(
                {
                    "method": row["method"],
                    "task": row["task"],
                    "k": k,
                    "tokens_per_verification": round(tokens, 3),
                    "verified_share": round(covered, 3),
                    "verify_ms": round(verify, 3),
                    "draft_step_ms": round(step, 3),
                    "round_ms": round(host + k * step + verify, 3),
                    "ms_per_token": round(per_token, 3),
                    "speedup": round(tpot / per_token, 3),
                    "over_floor": round(per_token / floor, 3),
                }
            )
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=Path, required=True, help="decode_bench JSON of the large target")
    p.add_argument("--spec", type=Path, action="append", required=True, help="spec_bench JSON (repeatable)")
    p.add_argument("--profile", type=Path, required=True, help="spec_step_profile JSON of the trained pair")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft-ms", type=float, help="the draft model's batch-1 TPOT (ms)")
    draft.add_argument("--draft-profile", type=Path, help="spec_step_profile JSON whose plain row is the draft's")
    p.add_argument("--preset", default="qwen3-8b", help="the large target's preset (its decoder layers)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from qcompile.synth.presets import get_preset

    layers = get_preset(args.preset).config()["num_hidden_layers"]
    decode = _read(args.decode)
    profile = _read(args.profile)
    host = host_ms(profile, args.profile)
    draft_ms = args.draft_ms
    if args.draft_profile is not None:
        draft_ms = plain_ms(_read(args.draft_profile), args.draft_profile)
    rows = extrapolate(decode, [_read(s) for s in args.spec], host, draft_ms, layers, args.decode)
    plain = batch1(decode["decode"], args.decode)
    report = {
        **report_header("spec_extrapolate"),
        "note": NOTE,
        "device": f"none: a model computed here from figures measured on {decode.get('machine', {}).get('gpu')}"
        " (the large target) and on the GPUs of the other inputs (the pair, the draft)",
        "inputs": {
            "decode": str(args.decode),
            "decode_device": decode.get("machine", {}).get("gpu"),
            "spec": [str(s) for s in args.spec],
            "profile": str(args.profile),
            "draft_profile": None if args.draft_profile is None else str(args.draft_profile),
            "preset": args.preset,
            "layers": layers,
            "tpot_ms": plain["tpot_ms"],
            "floor_ms": plain["floor_ms"],
            "host_ms": round(host, 3),
            "draft_ms": draft_ms,
        },
        "rows": rows,
    }
    print(f"MODEL ({NOTE}): {args.preset}, TPOT {plain['tpot_ms']:.2f} ms, floor {plain['floor_ms']:.2f} ms")
    print(
        f"{'method':32} {'task':5} {'k':>3} {'E':>5} {'share':>5} {'round ms':>8} {'ms/tok':>7} {'speedup':>7} {'/floor':>6}"
    )
    for r in rows:
        print(
            f"{r['method'][:32]:32} {r['task']:5} {r['k']:>3} {r['tokens_per_verification']:>5.2f} {r['verified_share']:>5.2f} "
            f"{r['round_ms']:>8.2f} {r['ms_per_token']:>7.2f} {r['speedup']:>7.2f} {r['over_floor']:>6.2f}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
