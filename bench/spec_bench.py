"""Speculative decoding against plain decoding of the same artifact, in one process (issue 19).

For each method (METHODS: prompt-lookup; draft-model with --draft ART; layer-skip when the target records
its self-speculative draft's layers, qcompile --draft-layers) and batch size, on two tasks
built from held-out text (bench/spec_prompts.py: the standard library modules that
examples/train_small_qwen3.py never trains on, read from this Python's stdlib):
  free  free generation: each prompt is the start of a held-out module, the model continues;
  edit  a code-editing task whose output repeats its prompt: a held-out function, then
        "# the same function again, with the variable renamed:" and the function's first line, so
        that a base LM's continuation copies the function.
Every (task, batch) cell runs the same --num-prompts prompts, `batch` at a time, --max-tokens
tokens each (EOS ignored, so both engines emit the same count), each engine warmed up on the cell's
first group before --repeats timed passes (tokens/s of the median pass: two engines both decoding
plainly differed by up to 17% at batch 1 in single passes of 8 x 128 tokens, db0a761 on an H200).
The plain engine stays loaded, and each method's cell times its passes in turn with plain passes
(run_cells): the ratio compares passes run side by side. Plain decoding measured alone, before the
methods, has moved 10,000-15,000 tok/s at batch 8 from call to call, and once ran 40% below a
speculating engine whose gate had turned drafting off (3615a62, H200). Reported per (method, task,
batch): acceptance rate, tokens per verification (target step), output tokens/s of the speculating
engine and of plain decoding beside it, their ratio, and how many outputs equal plain decoding's
(all of them, when greedy). A method's text form may leave draft_model= out: --draft fills it.

    python bench/spec_bench.py ART [--draft DRAFT_ART] [--batches 1,8] [--out FILE]
    python bench/spec_bench.py --train [--train-plan bench] [--recipe ptpc-fp8] --out FILE

--train (for a GPU, in one call) first trains a Qwen3 of 104M parameters and a 28M draft sharing its
tokenizer (bench/spec_train.py) on the stdlib's training files plus --site-chars characters of
installed packages' Python sources (bench/spec_corpus.py; none from tests or copying a held-out
module): the stdlib alone is ~2M tokens, which the target memorized at 568c92f on an H200 (train loss
0.089, held-out perplexity 100) instead of learning to continue or copy unseen code. It then compiles
both (the target with --draft-layers auto on training text, for layer-skip) and measures them. On a
CPU the tokens/s are not a target (the reference torch ops); acceptance and identity are real.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

import qruntime  # noqa: E402
from compile_bench import gpu_report_header, report_header  # noqa: E402
from qruntime import SamplingParams, SpeculativeConfig  # noqa: E402
from qruntime.engine.speculative.config import MAX_DRAFT_TOKENS  # noqa: E402
from qruntime.tokenizer import Tokenizer  # noqa: E402
from spec_prompts import TASKS, build_tasks, trainer  # noqa: E402

CPU_NOTE = "CPU run: tokens/s and their ratio are not a target (reference torch ops); acceptance and identity are"


def _draft_model(args: argparse.Namespace) -> SpeculativeConfig:
    if args.draft is None:
        raise SystemExit("method draft-model needs --draft ART (a smaller artifact with the target's tokenizer)")
    return SpeculativeConfig("draft-model", num_tokens=args.num_draft_tokens, draft_model=str(args.draft))


# A method is one entry: its name -> the engine's SpeculativeConfig from the command line. A name not
# here is read as SpeculativeConfig's text form ("METHOD:key=value,...").
METHODS: Mapping[str, Callable[[argparse.Namespace], SpeculativeConfig]] = {
    "prompt-lookup": lambda args: SpeculativeConfig("prompt-lookup", num_tokens=args.num_draft_tokens),
    "draft-model": _draft_model,
    "layer-skip": lambda args: SpeculativeConfig("layer-skip", num_tokens=args.num_draft_tokens),
}


def split_methods(text: str) -> list[str]:
    """--methods' entries: split at commas, where a piece holding '=' but no ':' is one more option of
    the entry before ('draft-model:gate=false,chain=false,layer-skip' is two entries)."""
    methods: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if methods and "=" in piece and ":" not in piece and ":" in methods[-1]:
            methods[-1] += "," + piece
        else:
            methods.append(piece)
    return methods


def method_config(name: str, args: argparse.Namespace) -> SpeculativeConfig:
    """METHODS[name], or the text form, where a draft-model without draft_model= takes --draft."""
    if name in METHODS:
        return METHODS[name](args)
    method, _, options = name.partition(":")
    if method.strip() == "draft-model" and "draft_model=" not in options.replace("-", "_"):
        if args.draft is None:
            raise SystemExit(f"method {name!r} needs --draft ART or draft_model=PATH")
        name = f"{method}:{options + ',' if options.strip() else ''}draft_model={args.draft}"
    return SpeculativeConfig.parse(name)


# ---------------------------------------------------------------- measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cells(
    engines: Sequence[Any], prompts: list[list[int]], params: list[SamplingParams], batch: int, repeats: int = 1
) -> list[dict[str, Any]]:
    """A cell per engine: each warms up on the first group, then `repeats` rounds each time one pass
    of every engine in turn over every group of `batch` prompts (one generate call each), so that
    what drifts over a call (clocks, the host) drifts for all of them; tokens/s of the median pass.
    The outputs are the first pass's; the speculative counts cover every pass."""
    device = engines[0].runner.device
    groups = [range(i, min(i + batch, len(prompts))) for i in range(0, len(prompts), batch)]
    for engine in engines:
        engine.generate([prompts[i] for i in groups[0]], [params[i] for i in groups[0]])
    before = [engine.speculative_stats for engine in engines]
    outputs: list[list[Any]] = [[] for _ in engines]
    walls: list[list[float]] = [[] for _ in engines]
    for _ in range(repeats):
        for e, engine in enumerate(engines):
            done = []
            _sync(device)
            start = time.perf_counter()
            for group in groups:
                done += engine.generate([prompts[i] for i in group], [params[i] for i in group])
            _sync(device)
            walls[e].append(time.perf_counter() - start)
            outputs[e] = outputs[e] or done
    return [_cell(engine, o, w, b) for engine, o, w, b in zip(engines, outputs, walls, before, strict=True)]


def run_cell(
    engine, prompts: list[list[int]], params: list[SamplingParams], batch: int, repeats: int = 1
) -> dict[str, Any]:
    """run_cells of one engine."""
    return run_cells([engine], prompts, params, batch, repeats)[0]


def _cell(engine, outputs: list[Any], walls: list[float], before: Any) -> dict[str, Any]:
    wall = statistics.median(walls)
    after = engine.speculative_stats
    tokens = [tuple(o.token_ids) for o in outputs]
    cell = {"wall_s": wall, "output_tokens": sum(map(len, tokens)), "tokens": tokens}
    cell["preemptions"] = sum(o.num_preemptions for o in outputs)
    cell["tokens_per_s"] = cell["output_tokens"] / wall
    cell["pass_tokens_per_s"] = [round(cell["output_tokens"] / w, 2) for w in walls]
    if after is not None:
        counts = {
            k: getattr(after, k) - getattr(before, k) for k in ("drafted", "accepted", "verifications", "emitted")
        }
        cell.update(counts)
        cell["acceptance_rate"] = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
        cell["tokens_per_verification"] = (
            counts["emitted"] / counts["verifications"] if counts["verifications"] else 0.0
        )
    return cell


def load(art: Path, args: argparse.Namespace, max_model_len: int, speculative: SpeculativeConfig | None = None):
    """An engine whose KV cache holds the largest batch at max_model_len (no preemption, little memory)."""
    block_size = json.loads((art / "manifest.json").read_text())["kv_cache"]["block_size"]
    return qruntime.load(
        art,
        graph_capture="load",
        device=args.device,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=max(args.batches),
        num_kv_blocks=max(args.batches) * -(-max_model_len // block_size) + 4,
        prefix_cache=False,  # every pass computes its prompts: warm-up and timed runs alike
        speculative=speculative,
    )


def _release(engine) -> None:
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Plain decoding of every (task, batch) cell, then each method's; rows as in the module docstring."""
    context = json.loads((args.artifact / "manifest.json").read_text())["spec"]["max_position_embeddings"]
    tokenizer = Tokenizer.from_dir(args.artifact)
    tasks, edits = build_tasks(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        tokenizer.decode,
        args.source,
        args.tasks,
        args.num_prompts,
        args.prompt_tokens,
        args.max_tokens,
    )
    needed = max(len(p) for prompts in tasks.values() for p in prompts) + args.max_tokens
    if needed > context:
        raise SystemExit(f"prompts and --max-tokens need {needed} positions; the model has {context}")
    max_model_len = min(context, needed + MAX_DRAFT_TOKENS + 1)
    greedy = args.temperature <= 0
    params = [
        SamplingParams(
            max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature, seed=None if greedy else i
        )
        for i in range(args.num_prompts)
    ]
    plain = load(args.artifact, args, max_model_len)
    report["engine"] = plain.description
    report["tasks"] = {name: {"prompts": len(p), "prompt_tokens": [len(x) for x in p]} for name, p in tasks.items()}
    baseline = {}
    for task, prompts in tasks.items():
        for batch in args.batches:
            baseline[task, batch] = run_cell(plain, prompts, params, batch, args.repeats)
            print(f"plain {task} batch {batch}: {baseline[task, batch]['tokens_per_s']:.1f} tok/s", flush=True)
    if "edit" in tasks:  # does the model copy? the first tokens of its output that a faithful copy has
        outputs = baseline["edit", args.batches[0]]["tokens"]
        copied = [_common_prefix(out, e.copy) for out, e in zip(outputs, edits, strict=True)]
        report["tasks"]["edit"]["plain_copied_tokens"] = copied
        print(f"plain edit: the first {sum(copied) / len(copied):.1f} tokens of an output copy the function")
    rows = []
    for name in args.methods:
        config = method_config(name, args)
        engine = load(args.artifact, args, max_model_len, config)
        report.setdefault("speculative_engines", {})[name] = engine.description
        for task, prompts in tasks.items():
            for batch in args.batches:
                # timed beside the plain engine, pass for pass: its own plain figure for the ratio
                cell, base = run_cells([engine, plain], prompts, params, batch, args.repeats)
                same = sum(a == b for a, b in zip(cell["tokens"], base["tokens"], strict=True))
                row = {
                    "method": name,
                    "speculative": asdict(config),
                    "task": task,
                    "batch": batch,
                    "prompts": len(prompts),
                    "output_tokens": cell["output_tokens"],
                    **{k: cell[k] for k in ("acceptance_rate", "tokens_per_verification", "drafted", "accepted")},
                    "verifications": cell["verifications"],
                    "spec_tokens_per_s": round(cell["tokens_per_s"], 2),
                    "plain_tokens_per_s": round(base["tokens_per_s"], 2),
                    "speedup": round(cell["tokens_per_s"] / base["tokens_per_s"], 3),
                    "spec_pass_tokens_per_s": cell["pass_tokens_per_s"],
                    "plain_pass_tokens_per_s": base["pass_tokens_per_s"],
                    "spec_wall_s": round(cell["wall_s"], 3),
                    "plain_wall_s": round(base["wall_s"], 3),
                    "greedy": greedy,
                    "identical_to_plain": same,
                    "preemptions": cell["preemptions"] + base["preemptions"],
                }
                gate = engine.speculator.gate if engine.speculator is not None else None
                if gate is not None:  # where the engine measured drafting against plain decoding (draft_gate.py)
                    row["gate_tokens_per_s"] = dict(zip(("plain", "drafting"), gate.rates(batch), strict=True))
                rows.append(row)
                print(_line(row), flush=True)
        _release(engine)
    _release(plain)
    return rows


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


HEADER = f"{'method':26} {'task':5} {'batch':>5} {'accept':>7} {'tok/verif':>9} {'spec tok/s':>10} {'plain tok/s':>11} {'ratio':>6} {'identical':>9}"


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['method'][:26]:26} {r['task']:5} {r['batch']:>5} {r['acceptance_rate']:>7.3f} "
        f"{r['tokens_per_verification']:>9.2f} {r['spec_tokens_per_s']:>10.1f} {r['plain_tokens_per_s']:>11.1f} "
        f"{r['speedup']:>6.2f} {r['identical_to_plain']:>5}/{r['prompts']:<3}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path, nargs="?", help="the target artifact (not with --train)")
    p.add_argument("--draft", type=Path, default=None, help="draft artifact of method draft-model")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated ({', '.join(METHODS)}, or SPEC text, whose own commas stay with it: "
        "'draft-model:gate=false,chain=false,layer-skip' is two)",
    )
    p.add_argument("--tasks", default="free,edit")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per cell (default: the largest batch)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each free-generation prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument(
        "--num-draft-tokens", type=int, default=None, help="k: the most drafts a step verifies (default: the method's)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs must equal plain ones)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed passes a cell (tokens/s of the median; counts over all)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the artifact's on a GPU, float32 on CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--source", type=Path, default=None, help="stdlib directory of the held-out modules")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default: bench/results/spec_bench_….json)")
    train = p.add_argument_group("--train: train, compile and measure a target and a draft")
    train.add_argument("--train", action="store_true")
    train.add_argument(
        "--train-plan", default="bench", choices=("bench", "tiny"), help="bench: 104M + 28M; tiny: a CPU smoke test"
    )
    train.add_argument("--target-seconds", type=float, default=210, help="training time of the target")
    train.add_argument("--draft-seconds", type=float, default=75, help="training time of the draft")
    train.add_argument(
        "--target-steps", type=int, default=None, help="train the target exactly this many steps (not --target-seconds)"
    )
    train.add_argument(
        "--draft-steps", type=int, default=None, help="train the draft exactly this many steps (not --draft-seconds)"
    )
    train.add_argument(
        "--site-chars",
        type=int,
        default=None,
        help="characters of site-packages Python sources added to the stdlib corpus (default: the plan's; 0: stdlib only)",
    )
    train.add_argument("--recipe", default="ptpc-fp8", help="qcompile recipe of both artifacts (bf16, ...)")
    train.add_argument("--workdir", type=Path, default=Path("/tmp/spec_bench"))
    args = p.parse_args(argv)
    if (args.artifact is None) != args.train:
        p.error("give the target artifact, or --train (not both)")
    for name in ("target_steps", "draft_steps"):
        value = getattr(args, name)
        if value is not None and (value < 1 or not args.train):
            p.error(f"--{name.replace('_', '-')} {value}: a positive step count, with --train")
    if args.site_chars is not None and (args.site_chars < 0 or not args.train):
        p.error(f"--site-chars {args.site_chars}: a character count of 0 or more, with --train")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least one timed pass")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.tasks = [t for t in args.tasks.split(",") if t]
    if unknown := set(args.tasks) - set(TASKS):
        p.error(f"unknown tasks {sorted(unknown)} (choose from {', '.join(TASKS)})")
    args.num_prompts = args.num_prompts or max(args.batches)
    if args.methods is None:
        args.methods = "prompt-lookup" + (",draft-model" if args.draft is not None or args.train else "")
        if args.train or _draft_layers(args.artifact) is not None:  # --train compiles the target with them
            args.methods += ",layer-skip"
    args.methods = split_methods(args.methods)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else None)
    args.source = args.source or trainer.stdlib_root()
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = args.device.startswith("cuda")
    report = gpu_report_header("spec_bench") if on_gpu else report_header("spec_bench")
    report["device"] = torch.cuda.get_device_name() if on_gpu else "cpu"
    if not on_gpu:
        report["note"] = CPU_NOTE
    if args.train:
        from spec_train import TRAIN_PLANS, compile_pair, train_pair

        began = time.perf_counter()
        log = lambda m: print(f"[{time.perf_counter() - began:6.1f}s] {m}", flush=True)  # noqa: E731
        seconds = {"target": args.target_seconds, "draft": args.draft_seconds}
        steps = {name: n for name, n in (("target", args.target_steps), ("draft", args.draft_steps)) if n}
        plan = TRAIN_PLANS[args.train_plan]
        if args.site_chars is not None:
            plan = replace(plan, site_chars=args.site_chars)
        report["training"] = train_pair(plan, args.workdir, torch.device(args.device), seconds, log, steps=steps)
        artifacts = compile_pair(args.workdir, args.recipe, log)
        args.artifact, args.draft = artifacts["target"], artifacts["draft"]
    report["artifacts"] = {
        role: {"path": str(art), **_artifact_info(art)}
        for role, art in (("target", args.artifact), ("draft", args.draft))
        if art
    }
    report["settings"] = {
        k: getattr(args, k)
        for k in (
            "methods",
            "tasks",
            "batches",
            "num_prompts",
            "prompt_tokens",
            "max_tokens",
            "num_draft_tokens",
            "temperature",
            "dtype",
            "repeats",
        )
    }
    rows = measure(args, report)
    report["results"] = rows
    print(HEADER)
    for row in rows:
        print(_line(row))
    name = f"trained-{args.train_plan}-{args.recipe}" if args.train else args.artifact.name
    out = args.out or ROOT / "bench" / "results" / f"spec_bench_{name}_{_device_tag(report['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return report


def _artifact_info(art: Path) -> dict[str, Any]:
    manifest = json.loads((art / "manifest.json").read_text())
    spec = manifest["spec"]
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    info = {"recipe": manifest["recipe"].get("name"), **{k: spec[k] for k in keys}}
    if "speculative" in manifest:
        info["speculative"] = manifest["speculative"]
    return info


def _draft_layers(art: Path) -> list[int] | None:
    """The self-speculative draft's skipped layers the artifact records (qcompile --draft-layers), if any."""
    manifest = json.loads((art / "manifest.json").read_text())
    return manifest.get("speculative", {}).get("draft_layers")


def _device_tag(device: str) -> str:
    words = [w.lower() for w in device.replace("-", " ").split() if any(c.isdigit() for c in w)]
    return words[0] if words and device != "cpu" else device.lower().replace(" ", "_")


if __name__ == "__main__":
    main()
