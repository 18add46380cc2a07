"""The 4-bit accuracy table of issue 20: our recipes (bf16, ptpc-fp8, w4a16 RTN, w4a16-awq) by
`qcompile eval-recipes`, and llm-compressor's AWQModifier (oneshot, W4A16, the same calibration
tokens) evaluated the same way: its compressed-tensors output compiled by qcompile as a pre-quantized
input (transcoded, its int4 weights and scales copied as they are) and scored by `qcompile eval`
against the same reference on the same text.

    python bench/awq_compare.py --calib calib.txt --out bench/results/awq_compare_qwen3-stdlib.json

CPU, fp32 compute (only the quantization error is left). The calibration text is tokenized as
w4a16-awq tokenizes it (whole sequences of 512 tokens, at most 32), and AWQModifier gets those
sequences as its calibration samples.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from compile_bench import report_header

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/qwen3-stdlib"
RECIPES = ("bf16", "ptpc-fp8", "w4a16", "w4a16-awq")
EVAL = ("--window", "256", "--json", "--no-progress", "--dtype", "fp32", "--device", "cpu")


def qcompile(*args: str) -> str:
    done = subprocess.run(["qcompile", *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"qcompile {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def awq_modifier(ckpt: Path, calib: Path, out: Path) -> None:
    """llm-compressor's AWQModifier (its defaults: duo_scaling, n_grid 20; Qwen3 mappings) with the
    W4A16 preset, on our calibration sequences, saved compressed (pack-quantized)."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM

    from qcompile.compile.awq_search import CalibrationSize
    from qcompile.compile.calibrate import calibration_ids
    from qcompile.source.checkpoint import Checkpoint

    # AWQModifier pins its cached inputs (a transfer speed-up for a GPU), which fails where no
    # accelerator is: on this CPU-only run pinning is skipped, nothing else changes
    IntermediatesCache.pin_memory = lambda self, batch_index: None
    size = CalibrationSize()
    ids = calibration_ids(Checkpoint.open(ckpt), calib, size.seq_len, size.max_sequences)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    modifier = AWQModifier(targets=["Linear"], scheme="W4A16", ignore=["lm_head"])
    oneshot(
        model=model,
        dataset=data,
        recipe=modifier,
        max_seq_length=size.seq_len,
        num_calibration_samples=ids.shape[0],
    )
    model.save_pretrained(out, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (ckpt / name).is_file():
            (out / name).write_bytes((ckpt / name).read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=Path, required=True, help="calibration text (keep it apart from --data)")
    parser.add_argument("--data", type=Path, default=FIXTURE / "heldout.txt")
    parser.add_argument("--checkpoint", type=Path, default=FIXTURE)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args()
    report = report_header("awq_compare")
    import llmcompressor
    import transformers

    report["versions"].update(llmcompressor=llmcompressor.__version__, transformers=transformers.__version__)
    calib, data, ckpt = args.calib.resolve(), args.data.resolve(), args.checkpoint.resolve()
    recipes = [a for r in RECIPES for a in ("-r", r)]
    ours_cmd = ["eval-recipes", str(ckpt), "--data", str(data), *recipes, "--calib", str(calib), *EVAL]
    ours = json.loads(qcompile(*ours_cmd))
    with tempfile.TemporaryDirectory(prefix="awq-compare-") as tmp:
        llmc, art = Path(tmp) / "llmc-awq", Path(tmp) / "llmc-awq-art"
        awq_modifier(ckpt, calib, llmc)
        qcompile("compile", str(llmc), "-o", str(art), "-q")  # pre-quantized: transcoded to w4a16
        theirs = json.loads(qcompile("eval", str(art), "--reference", str(ckpt), "--data", str(data), *EVAL))
    shared = ("artifact", "reference", "reference_kind", "data", "device", "dtype", "window", "windows")
    theirs_row = {"recipe": "llm-compressor AWQModifier (W4A16), transcoded", "recipe_name": theirs["recipe"]}
    theirs_row |= {k: v for k, v in theirs.items() if k not in (*shared, "recipe", "tokens", "ppl_reference")}
    report["model"] = f"{args.checkpoint} (trained, 4.2M parameters)"
    report["calibration"] = {"file": str(args.calib), "sha256": _sha256(calib)}
    report["commands"] = {
        "ours": "qcompile " + " ".join(ours_cmd),
        "awq_modifier": "oneshot(AWQModifier(targets=['Linear'], scheme='W4A16', ignore=['lm_head'])) on the "
        "calibration sequences; qcompile compile OUT -o ART (transcode); qcompile eval ART --reference CKPT "
        "--data DATA " + " ".join(EVAL),
    }
    report["result"] = ours | {"rows": [*ours["rows"], theirs_row]}
    report["reference_check"] = {"awq_modifier_tokens": theirs["tokens"], "ours_tokens": ours["tokens"]}
    text = json.dumps(report, indent=1) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(f"{'recipe':<48} {'ppl ratio':>9} {'KL':>10} {'top-1':>7}")
    for row in report["result"]["rows"]:
        print(f"{row['recipe']:<48} {row['ppl_ratio']:>9.5f} {row['kl']:>10.3e} {100 * row['top1_agreement']:>6.2f}%")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
