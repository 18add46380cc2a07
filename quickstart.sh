#!/usr/bin/env bash
# The README's quick start, one command: `bash quickstart.sh` from the repository's root.
# Makes a virtualenv in .venv (unless one is active) and installs qcompile and its runtime there
# (unless they are installed already), then synthesizes a small Qwen3-MoE checkpoint (random weights,
# a locally trained tokenizer), compiles it, inspects and verifies the artifact and generates from it.
# Each step says its name before it runs, and a failure names the step that failed.
# PRESET (default tiny-moe): any of `qcompile synth --help`; WORK (default /tmp): where it writes.
set -uo pipefail
preset=${1:-tiny-moe}
work=${2:-/tmp}
ckpt="$work/qwen3-$preset" art="$work/qwen3-$preset-fp8"

step() {
  local name=$1
  shift
  printf '\n== %s: %s\n' "$name" "$*" >&2
  "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    printf '\nquick start failed at step "%s" (exit %d): %s\n' "$name" "$rc" "$*" >&2
    exit 1
  fi
}

cd "$(dirname "$0")" || exit 1
if [ -z "${VIRTUAL_ENV:-}" ]; then
  step venv python3 -m venv .venv
  . .venv/bin/activate
fi
if ! python -c "import qcompile, qruntime" 2>/dev/null; then
  # the CPU build of torch first: a plain `torch` requirement pulls several GB of CUDA packages
  step "install torch" pip install torch==2.13.0
  step install pip install -e ./runtime -e .
fi
step synth qcompile synth "$preset" -o "$ckpt" --force
step compile qcompile compile "$ckpt" -o "$art" --force
step inspect qcompile inspect "$art"
step verify qcompile verify "$art"
step run qcompile run "$art" "The capital of France is" --max-tokens 24
printf '\nquick start done: the artifact is %s (activate the environment with `. .venv/bin/activate`)\n' "$art" >&2
