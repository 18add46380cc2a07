"""Issue-22 benchmark: sampling from the vocabulary-parallel head's shards against gathering the
logits, on the GPUs of one host, on a SYNTHETIC artifact (`qcompile synth PRESET --artifact --tp TP`).

For each mode (`sharded`: each rank keeps its V/tp columns and the ranks exchange a few numbers per
row, engine/sharded_sampler.py; `gathered`: the graph's AllGather puts every row together and
rank 0 samples it) the same artifact is loaded (--repeats times, the modes alternated) with tp=TP and decodes --output-len tokens after
--input-len random prompt tokens, at each batch of --batches, greedy and sampled (temperature 1):
TPOT (mean over requests). Greedy tokens are checked equal across the modes.

    python bench/sharded_sampling_bench.py --preset qwen3-8b --tp 2 --out bench/results/sharded_sampling_h200x2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import qruntime
import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header
from qruntime.benchmark import measure

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact

SYNTHETIC = "SYNTHETIC: random weights generated on the GPUs at load (qcompile synth --artifact); speed only"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="loads of each mode, alternated (load-to-load noise)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qsharded"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from qcompile.tune.artifact import tune_artifact

    batches = [int(b) for b in args.batches.split(",")]
    art = args.workdir / f"{args.preset}-tp{args.tp}"
    shutil.rmtree(art, ignore_errors=True)
    write_synthetic_artifact(args.preset, art, load_recipe("ptpc-fp8"), tp=args.tp, progress=False)
    tune_artifact(art, buckets=tuple(sorted({1, *batches})))
    gc.collect()
    torch.cuda.empty_cache()
    report = gpu_report_header("sharded_sampling_bench")
    report["machine"]["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    report.update(weights=SYNTHETIC, preset=args.preset, tp=args.tp, rows=[])
    tokens = {}
    for mode in ("sharded", "gathered") * args.repeats:
        start = time.perf_counter()
        with qruntime.load(art, graph_capture="load", device="cuda", tp=args.tp, max_model_len=args.input_len + args.output_len + 64,
            max_num_seqs=max(batches), kv_cache_memory=8 << 30, sharded_sampling=mode == "sharded",
        ) as engine:  # fmt: skip
            load_s = time.perf_counter() - start
            assert (engine.runner.vocab_shard is not None) == (mode == "sharded"), engine.description
            measure(engine, 64, 8, 1, seed=1)  # warm-up
            for batch in batches:
                for temperature in (0.0, 1.0):
                    # warm-up on the same prompts: the measured run's prefill hits the prefix cache, so its
                    # TPOT is decode steps alone, not decodes waiting behind later requests' prefill chunks
                    measure(engine, args.input_len, 8, batch, seed=3, temperature=temperature)
                    row = measure(engine, args.input_len, args.output_len, batch, seed=3, temperature=temperature)
                    row.update(mode=mode, temperature=temperature, load_s=round(load_s, 2))
                    report["rows"].append(row)
                    print(json.dumps(row), flush=True)
            prompts = [[(7 * i + j) % 1000 for j in range(32)] for i in range(4)]
            greedy = qruntime.SamplingParams(max_tokens=32, ignore_eos=True)
            tokens[mode] = [o.token_ids for o in engine.generate(prompts, greedy)]
        gc.collect()
        torch.cuda.empty_cache()
    report["greedy_tokens_equal"] = tokens["sharded"] == tokens["gathered"]
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'mode':>9} {'batch':>5} {'temp':>4} {'TPOT ms':>8}")
    for r in report["rows"]:
        print(f"{r['mode']:>9} {r['batch']:>5} {r['temperature']:>4} {r['tpot_ms']:>8.3f}")
    print("greedy tokens equal:", report["greedy_tokens_equal"])
    shutil.rmtree(art, ignore_errors=True)


if __name__ == "__main__":
    main()
