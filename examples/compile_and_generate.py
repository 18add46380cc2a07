"""Synthesize a tiny Qwen3 checkpoint, compile it with the CLI, then generate with the runtime's
Python API: a batch (`generate`), token by token (`stream`) and a chat turn (`chat`), with timings.

    python examples/compile_and_generate.py [WORKDIR]      # default: a fresh temporary directory

Random weights, so the text is gibberish; everything runs on CPU in seconds.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import qruntime

from qcompile.synth import write_checkpoint

work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="qcompile-example-"))
ckpt, art = work / "ckpt", work / "tiny-fp8"

# 1. A Hugging Face checkpoint of the `tiny` preset (random bf16 weights, locally trained tokenizer).
synth = write_checkpoint("tiny", ckpt, seed=0, force=True)
print(f"checkpoint: {synth.parameters:,} parameters at {synth.path}")

# 2. Compile it with the default recipe (ptpc-fp8), exactly as on the command line.
subprocess.run([sys.executable, "-m", "qcompile", "compile", ckpt, "-o", art, "--force", "-q"], check=True)

# 3. Load the artifact (cpu here: no GPU needed) with a small KV cache, and generate.
engine = qruntime.load(art, device="cpu", num_kv_blocks=64)
params = qruntime.SamplingParams(max_tokens=12, temperature=0.8, seed=1234)

for out in engine.generate(["Once upon a time", "def main():"], params):
    t = out.timings
    print(f"generate: {out.text!r} ({out.finish_reason}, {t.num_output_tokens} tokens, ttft {t.ttft * 1e3:.0f} ms)")

print("stream:   ", end="")
for delta in engine.stream("import os", qruntime.SamplingParams(max_tokens=12)):
    print(delta.text, end="|", flush=True)  # one piece per step; `|` marks where each delta ends
    if delta.finished:
        t = delta.output.timings
        print(f"\n          ({delta.output.finish_reason}, {t.num_output_tokens} tokens in {t.e2e * 1e3:.0f} ms)")

[reply] = engine.chat([{"role": "user", "content": "Say hello."}], qruntime.SamplingParams(max_tokens=12))
print(f"chat:     {reply.text!r} ({reply.finish_reason}, e2e {reply.timings.e2e * 1e3:.0f} ms)")
