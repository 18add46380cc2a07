#!/usr/bin/env bash
# Which recipe loses least? Compile one checkpoint with several recipes and measure each against
# the source model (run by transformers) on held-out text: perplexity ratio, KL and top-1 agreement.
#
#   bash examples/eval_recipes.sh [WORKDIR] [CHECKPOINT] [TEXT]
#
# Defaults: /tmp/qcompile-eval-recipes, and the small Qwen3 trained on Python's standard library in
# tests/fixtures/qwen3-stdlib (4M parameters: real numbers, not those of random weights) with its
# held-out text. A few hundred tokens on CPU take seconds; drop --max-tokens for the whole text.
# Needs transformers (the `reference` extra).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/qcompile-eval-recipes}
ckpt=${2:-$root/tests/fixtures/qwen3-stdlib}
text=${3:-$ckpt/heldout.txt}
mkdir -p "$work"

# bf16 is the control: it changes nothing but the runtime, so its ratio is ~1 and its KL ~0.
# --dtype fp32 computes both sides in fp32 (bf16 = as served): only the quantization error is left,
# and on a CPU without bf16 instructions it is faster too.
qcompile eval-recipes "$ckpt" --data "$text" -r bf16 -r ptpc-fp8 -r ptpc-fp8-lmhead --dtype fp32 \
  --device cpu --max-tokens 256 --window 128 --workdir "$work" --no-progress --json > "$work/eval.json"

# The same JSON is what `qcompile publish --eval eval.json` shows as a table in the model card.
python3 - "$work/eval.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"{report['tokens']} tokens in {report['windows']} windows, reference ppl {report['ppl_reference']:.3f}")
print(f"{'recipe':<18}{'ppl ratio':>10}{'KL nats/tok':>13}{'top-1':>8}")
for row in report["rows"]:
    print(f"{row['recipe']:<18}{row['ppl_ratio']:>10.4f}{row['kl']:>13.2e}{row['top1_agreement']:>8.1%}")
EOF
