"""Issue-18 benchmark: what structured output costs per token on the GPU. TPOT of greedy requests
constrained to a typical JSON schema against the same requests unconstrained, at each batch of
--batches, on a SYNTHETIC artifact (`qcompile synth PRESET --artifact`, tuned for those batches).

Both runs decode --output-len tokens after --input-len random prompt tokens (the free ones with EOS
ignored). A constrained request ends when its document is complete, so its random-weight model is
kept inside the document's strings with a bias against the closing quote (the mask still decides
what may come): the constrained requests then run about as long as the free ones, and the tokens
each made are recorded. The grammar engine's masks are made on the host each step, while the
forward runs (engine/structured.py).

    python bench/structured_bench.py --preset qwen3-8b --out bench/results/structured_bench_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import time
from pathlib import Path

import qruntime
import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header
from grammar_engines import SCHEMA
from qruntime import SamplingParams
from qruntime.engine.structured import StructuredOutput

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact

SYNTHETIC = "SYNTHETIC: random weights generated on the GPU at load (qcompile synth --artifact); speed only"


def run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tpots = [o.timings.tpot for o in outputs if o.timings.tpot is not None]
    made = [len(o.token_ids) for o in outputs]
    return {
        "tpot_ms": sum(tpots) / len(tpots) * 1e3,
        "tokens_mean": sum(made) / len(made),
        "tokens_min": min(made),
        "finish_reasons": sorted({o.finish_reason for o in outputs}),
        "wall_s": round(wall, 3),
        "texts": [o.text[:120] for o in outputs[:2]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qstructured"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from qcompile.tune.artifact import tune_artifact

    batches = [int(b) for b in args.batches.split(",")]
    art = args.workdir / args.preset
    shutil.rmtree(art, ignore_errors=True)
    write_synthetic_artifact(args.preset, art, load_recipe("ptpc-fp8"), progress=False)
    tune_artifact(art, buckets=tuple(sorted({1, *batches})))
    gc.collect()
    torch.cuda.empty_cache()
    report = gpu_report_header("structured_bench")
    report.update(weights=SYNTHETIC, preset=args.preset, schema=SCHEMA, rows=[])
    engine = qruntime.load(art, graph_capture="load", device="cuda", max_model_len=args.input_len + args.output_len + 64, max_num_seqs=max(batches),
        kv_cache_memory=8 << 30,
    )  # fmt: skip
    quote = engine.tokenizer.encode('"', False)
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len, structured=constraint, logit_bias=dict.fromkeys(quote, -30.0)
    )
    rng = random.Random(5)
    engine.generate([[1, 2, 3]], [constrained])  # the grammar engine's tokenizer is built once
    for batch in batches:
        prompts = [[rng.randrange(engine.vocab_size) for _ in range(args.input_len)] for _ in range(batch)]
        run(engine, prompts, [free] * batch)  # warm-up
        for kind, params in (
            ("free", free),
            ("json_schema", constrained),
            ("free", free),
            ("json_schema", constrained),
        ):
            row = {"batch": batch, "kind": kind, **run(engine, prompts, [params] * batch)}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    engine.close()
    summary = []
    for batch in batches:
        best = {
            kind: min(r["tpot_ms"] for r in report["rows"] if r["batch"] == batch and r["kind"] == kind)
            for kind in ("free", "json_schema")
        }
        summary.append({"batch": batch, **best, "overhead": best["json_schema"] / best["free"] - 1})
    report["summary"] = summary
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'batch':>5} {'free ms':>8} {'schema ms':>9} {'overhead':>8}")
    for s in summary:
        print(f"{s['batch']:>5} {s['free']:>8.3f} {s['json_schema']:>9.3f} {s['overhead']:>8.1%}")
    shutil.rmtree(art, ignore_errors=True)


if __name__ == "__main__":
    main()
