#!/usr/bin/env bash
# Write a recipe of your own, compile with it (plus a --set override on the command line), and
# check with `qcompile inspect --json` that the artifact was built the way the recipe says.
#
#   bash examples/custom_recipe.sh [WORKDIR]      # default /tmp/qcompile-custom-recipe
#
# A recipe only needs the keys it changes: the others keep ptpc-fp8's values (recipes/ptpc-fp8.yaml
# has them all; examples/custom_recipe.yaml is a complete one). CPU only, a few seconds.
set -euo pipefail
work=${1:-/tmp/qcompile-custom-recipe}
mkdir -p "$work"

cat > "$work/lean.yaml" <<'EOF'
# ptpc-fp8, but lm_head quantized too (only the MoE router stays bf16) and an FP8 KV cache
# in the head-major layout: a smaller artifact and half the KV-cache memory.
name: lean-fp8
description: ptpc-fp8 + FP8 lm_head + FP8 hnd KV cache
quantization:
  scheme: ptpc-fp8
  ignore: ["re:.*mlp.gate$"]
kv_cache: {dtype: fp8_e4m3, layout: hnd}
EOF

qcompile synth tiny-moe -o "$work/ckpt" --force
# --set overrides one key of the file without editing it (repeatable)
qcompile compile "$work/ckpt" -o "$work/lean" --recipe "$work/lean.yaml" --set kv_cache.block_size=32 --force -q
qcompile inspect "$work/lean" --json > "$work/lean.json"

# What the artifact says about itself: the recipe's name, its ignore list and KV cache, the override.
python3 - "$work/lean.json" <<'EOF'
import json, sys
info = json.load(open(sys.argv[1]))
kv = info["kv_cache"]
print(f"recipe {info['recipe']}: ignore {info['ignore']}, {info['quantized_weights']} fp8 weights")
print(f"kv cache {kv['dtype']} {kv['layout']}, block_size {kv['block_size']} (from --set)")
print(f"bytes by dtype {info['bytes']['by_dtype']}")
EOF
