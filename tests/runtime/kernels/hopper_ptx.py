"""A Triton kernel compiled for an H100 (sm_90) on a machine without a GPU: what the interpreter
cannot show (the hardware branch compiles; which instructions it holds, in which order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_COMPILE = """
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib

module, kernel, types, constexprs, num_warps, unaligned = json.loads(sys.argv[1])
import triton.language as tl
constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v for k, v in constexprs.items()}
kernel = getattr(importlib.import_module(module), kernel)
names = list(inspect.signature(kernel.fn).parameters)
signature = {n: types.get(n, "constexpr") for n in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in types and n not in unaligned}
source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"])
"""


def hopper_ptx(
    module: str, kernel: str, types: dict, constexprs: dict, num_warps: int, unaligned: tuple[str, ...] = ()
) -> str:
    """The PTX of `module.kernel` for sm_90 as a launch on 16-byte-aligned tensors (and integers
    divisible by 16, except those named in `unaligned`) would compile it, in a process without the
    interpreter (Triton's own ptxas). `types` maps each runtime argument to Triton's type string
    ("*bf16", "i32", ...); every other parameter is a constexpr given in `constexprs` (a Triton dtype
    as its name: "tl.bfloat16")."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    arg = json.dumps([module, kernel, types, constexprs, num_warps, list(unaligned)])
    done = subprocess.run([sys.executable, "-c", _COMPILE, arg], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
