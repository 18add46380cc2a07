#!/usr/bin/env bash
# Synthesize a small Qwen3-MoE checkpoint (random weights, local tokenizer), compile it with the
# default PTPC-FP8 recipe and with a customised one, inspect and verify the artifacts, and generate
# from one with the runtime (random weights: the text is gibberish, the timings are real).
# Run from an environment where qcompile is installed (see README.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${1:-/tmp/qcompile-example}
mkdir -p "$work"

qcompile synth tiny-moe -o "$work/ckpt" --force
qcompile compile "$work/ckpt" -o "$work/ptpc-fp8" --force
qcompile compile "$work/ckpt" -o "$work/custom" --force --recipe "$here/custom_recipe.yaml" \
  --set kv_cache.block_size=32
qcompile inspect "$work/custom"
qcompile inspect "$work/ptpc-fp8" --json > "$work/ptpc-fp8.json"
qcompile verify "$work/ptpc-fp8"
qcompile run "$work/ptpc-fp8" "Once upon a time" --max-tokens 16 --json > "$work/run.json"
