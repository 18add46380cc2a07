"""Issue-17 A/B: batch-1 MoE decode with the one-token paths of the fused MoE turned back, in one
process on one GPU, on a SYNTHETIC tuned artifact (`qcompile synth PRESET --artifact`, bucket 1).

Modes, each loaded twice in turn (the graphs are captured at load, so a mode is a fresh engine):
  align   the router by F.linear, routing + quant, then moe_align's launch (before issue 17's slice)
  layout  the router by F.linear, the routing launch laying out the pairs (no align launch)
  router  the router GEMV in the routing launch too (what the runtime does)

    python bench/moe_one_token_ab.py --out bench/results/moe_router_ab_qwen3-30b-a3b_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from pathlib import Path

import qruntime
import qruntime.kernels.fused_moe as fm
import torch
import torch.nn.functional as F
from qruntime.benchmark import measure
from qruntime.kernels.moe_align import moe_align
from qruntime.kernels.moe_routing import moe_route_quant

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact

REAL_ONE, REAL_ROUTER = fm.moe_route_quant_one, fm.moe_router_one


def align_one(logits, x, top_k, norm, block_m, **kw):
    out = moe_route_quant(logits, x, top_k, norm)
    return out, moe_align(out[1], logits.shape[1], block_m)


def unfused_router(x, router_w, top_k, norm, block_m, counter, **kw):
    return fm.moe_route_quant_one(F.linear(x, router_w), x, top_k, norm, block_m)


MODES = {"align": (align_one, unfused_router), "layout": (REAL_ONE, unfused_router), "router": (REAL_ONE, REAL_ROUTER)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qmoe1"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from qcompile.tune.artifact import tune_artifact

    art = args.workdir / args.preset
    shutil.rmtree(art, ignore_errors=True)
    write_synthetic_artifact(args.preset, art, load_recipe("ptpc-fp8"), progress=False)
    tune_artifact(art, buckets=(1,))
    gc.collect()
    torch.cuda.empty_cache()
    report = gpu_report_header("moe_one_token_ab", synthetic=True)
    report.update(preset=args.preset, rows=[])
    for mode in (*MODES, *MODES):
        fm.moe_route_quant_one, fm.moe_router_one = MODES[mode]
        with qruntime.load(
            art, graph_capture="load", device="cuda", max_model_len=512, max_num_seqs=4, kv_cache_memory=4 << 30
        ) as engine:
            measure(engine, 64, 16, 1, seed=1)  # warm-up
            tpots = [measure(engine, 128, 128, 1, seed=2)["tpot_ms"] for _ in range(3)]
        report["rows"].append({"mode": mode, "tpot_ms": tpots})
        print(mode, [round(t, 3) for t in tpots], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    fm.moe_route_quant_one, fm.moe_router_one = REAL_ONE, REAL_ROUTER
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(art, ignore_errors=True)


if __name__ == "__main__":
    main()
