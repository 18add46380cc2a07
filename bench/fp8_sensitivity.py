"""Where does PTPC-FP8 lose top-1 agreement? Quantize one part of the model at a time and measure.

The model (the trained fixture by default) runs in transformers in fp32; chosen nn.Linear layers
are replaced by their PTPC-FP8 equivalent, weights quantized exactly as qcompile stores them
(qcompile.quant.fp8, per output channel, in the checkpoint dtype) and/or inputs quantized per token
at run time exactly as the runtime does (qruntime.ops.functional.dynamic_quant), the product in fp32.
Quantizing every linear but lm_head is the `ptpc-fp8` recipe: the "all" row reproduces
`qcompile eval` on a ptpc-fp8 artifact with --dtype fp32.

Every variant is compared with the unquantized fp32 model on the same held-out windows: perplexity
ratio, KL, top-1 agreement. Agreement is also broken down by how confident the reference was (its
top-1 probability), which tells a quantization error from a near-tie: a flip where the reference's
top two tokens are almost equally likely is not a quality loss a user would see.

    python bench/fp8_sensitivity.py --out bench/results/fp8_sensitivity_qwen3-stdlib.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from compile_bench import report_header
from qruntime.ops import functional as fn
from qruntime.tokenizer import Tokenizer
from transformers import AutoModelForCausalLM

from qcompile.evaluate.accuracy import Totals, read_text, window_starts
from qcompile.quant.fp8 import quantize_per_channel

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3-stdlib"
CONFIDENCE_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)  # reference top-1 probability
PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class FakePTPCLinear(torch.nn.Module):
    """y = dequant(quant(x)) @ dequant(quant(W)).T in fp32, either half optional; activations "bf16"
    only rounds x to bf16 (a control: how many positions a noise far below FP8's flips)."""

    def __init__(self, linear: torch.nn.Linear, source_weight: torch.Tensor, weights: bool, activations: bool | str):
        super().__init__()
        w = source_weight
        if weights:
            q, scale = quantize_per_channel(w)
            w = q.float() * scale.float()
        self.weight = w.float()
        self.bias = linear.bias
        self.activations = activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "bf16":  # the control: only the rounding a bf16 activation has
            return torch.nn.functional.linear(x.bfloat16().float(), self.weight, self.bias)
        if self.activations:
            flat = x.reshape(-1, x.shape[-1])
            q, scale = fn.dynamic_quant(flat, 0)
            x = (q.float() * scale).reshape(x.shape)
        return torch.nn.functional.linear(x.float(), self.weight, self.bias)


def linears(model) -> Iterator[tuple[str, int, str]]:
    """(module name, layer index, projection) of every decoder-layer linear."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            yield name, int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1]


@contextmanager
def quantized(
    model, source: dict[str, torch.Tensor], pick: Callable[[int, str], bool], weights: bool, acts: bool | str
):
    """Swap the picked linears for fake-PTPC ones for the duration of the block."""
    swapped = []
    for name, layer, proj in list(linears(model)):
        if not pick(layer, proj):
            continue
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        original = getattr(parent, attr)
        setattr(parent, attr, FakePTPCLinear(original, source[name + ".weight"], weights, acts))
        swapped.append((parent, attr, original))
    try:
        yield len(swapped)
    finally:
        for parent, attr, original in swapped:
            setattr(parent, attr, original)


def variants(num_layers: int) -> list[tuple[str, Callable[[int, str], bool], bool, bool | str]]:
    everything = lambda layer, proj: True  # noqa: E731
    rows = [
        ("all (= ptpc-fp8)", everything, True, True),
        ("weights only", everything, True, False),
        ("activations only", everything, False, True),
        ("control: bf16 inputs", everything, False, "bf16"),
    ]
    for layer in range(num_layers):
        rows.append((f"layer {layer}", lambda i, p, layer=layer: i == layer, True, True))
    for kind, projs in PROJECTIONS.items():
        rows.append((f"{kind} (all layers)", lambda i, p, projs=projs: p in projs, True, True))
    return rows


@torch.inference_mode()
def run(ckpt: Path, data: Path, window: int) -> dict:
    tokenizer = Tokenizer.from_dir(ckpt)
    ids = tokenizer.encode(read_text(data))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, local_files_only=True).eval()
    # the weights as stored in the checkpoint (bf16), which is what qcompile quantizes
    source_model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    source = {k: v.detach().clone() for k, v in source_model.state_dict().items()}
    del source_model
    windows = [ids[s : s + window] for s in window_starts(len(ids), window)]
    reference = [model(torch.tensor([w])).logits[0, :-1].float() for w in windows]
    targets = [torch.tensor(w[1:]) for w in windows]
    ref_prob = torch.cat([torch.softmax(r.double(), -1).amax(-1) for r in reference])
    ref_top1 = torch.cat([r.argmax(-1) for r in reference])
    bins = torch.bucketize(ref_prob, torch.tensor(CONFIDENCE_BINS, dtype=torch.float64), right=True) - 1

    results = []
    for label, pick, w, a in variants(model.config.num_hidden_layers):
        totals = Totals()
        with quantized(model, source, pick, w, a) as count:
            ours = [model(torch.tensor([win])).logits[0, :-1].float() for win in windows]
        for o, r, t in zip(ours, reference, targets, strict=True):
            totals.add(o, r, t)
        agree = torch.cat([o.argmax(-1) for o in ours]) == ref_top1
        by_confidence = []
        for b in range(len(CONFIDENCE_BINS) - 1):
            mask = bins == b
            by_confidence.append(
                {
                    "ref_top1_prob": [CONFIDENCE_BINS[b], min(CONFIDENCE_BINS[b + 1], 1.0)],
                    "positions": int(mask.sum()),
                    "top1_agreement": float(agree[mask].double().mean()) if mask.any() else None,
                }
            )
        results.append(
            {
                "variant": label,
                "linears": count,
                "quantized": {"weights": w, "activations": a},
                "ppl_ratio": float(torch.tensor(totals.nll_artifact - totals.nll_reference).div(totals.tokens).exp()),
                "kl": totals.kl / totals.tokens,
                "top1_agreement": totals.agree / totals.tokens,
                "by_reference_confidence": by_confidence,
            }
        )
        row = results[-1]
        confident = row["by_reference_confidence"][2:]  # reference top-1 probability >= 0.5
        sure = sum(b["positions"] * b["top1_agreement"] for b in confident) / sum(b["positions"] for b in confident)
        print(
            f"{label:22s} linears {count:3d}  ppl ratio {row['ppl_ratio']:.5f}  KL {row['kl']:.2e}  "
            f"top-1 {100 * row['top1_agreement']:.2f}%  (where the reference is >= 50% sure: {100 * sure:.2f}%)"
        )
    positions = int(ref_prob.numel())
    return {
        "model": str(ckpt),
        "data": str(data),
        "window": window,
        "tokens": positions,
        "reference": "transformers fp32, unquantized",
        "reference_confidence": {
            "median_top1_prob": float(ref_prob.median()),
            "share_below_0.5": float((ref_prob < 0.5).double().mean()),
        },
        "variants": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=FIXTURE)
    parser.add_argument("--data", type=Path, default=FIXTURE / "heldout.txt")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = {**report_header("fp8_sensitivity"), **run(args.ckpt, args.data, args.window)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
