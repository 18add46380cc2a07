"""Check qcompile's amd-gfx942 target (issue 26) on this machine; on an AMD Instinct MI300X / MI308X /
MI325X also on its GPU. Prints one table; exits 1 if a check that ran failed.

    python examples/amd_check.py WORKDIR

It makes a small random Qwen3 checkpoint, compiles it twice (ptpc-fp8, --target nvidia-sm90 and
--target amd-gfx942) and checks:
- the amd artifact's FP8 weights are the nvidia one's codes as e4m3fnuz with doubled scales, so
  every weight dequantizes to the same value;
- on the reference ops (CPU, fp32) both artifacts give the same logits and greedy tokens;
- on a gfx942 GPU (ROCm torch): the per-token FP8 quantization kernel in e4m3fnuz equals the
  e4m3fn result transcoded, the artifact loads there (its target checked against the GPU), and its
  greedy tokens on the GPU's reference ops equal the CPU's.
What is not built yet for AMD (the Triton GEMM, MoE, norm and attention kernels in e4m3fnuz, the
custom all-reduce) is listed as such: docs/compiling.md, "Compile targets".
"""

from __future__ import annotations

import sys
from pathlib import Path

import qruntime
import torch
from qruntime.kernels.dynamic_quant import dynamic_quant
from qruntime.ops import functional as fn
from qruntime.target import device_target, to_e4m3fnuz
from safetensors import safe_open

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import write_checkpoint

PROMPT = [11, 42, 7, 99, 5, 123, 8]


def _tensors(art: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(art.glob("weights/*.safetensors")):
        with safe_open(path, "pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (no iterator)
    return out


def same_weights(nvidia: Path, amd: Path) -> tuple[bool, str]:
    ours, theirs = _tensors(nvidia), _tensors(amd)
    fp8 = [name for name, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    for name in fp8:
        scale = name.removesuffix(".weight") + ".weight_scale"
        codes, scales = to_e4m3fnuz(ours[name], ours[scale])
        if not (
            torch.equal(theirs[name].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(theirs[scale], scales)
        ):
            return False, f"{name} differs"
    return True, f"{len(fp8)} FP8 weights"


def greedy(art: Path, device: str) -> tuple[list[int], torch.Tensor]:
    with qruntime.load(art, device=device, backend="reference", dtype=torch.float32) as engine:
        logits = engine.score(PROMPT).cpu()
        params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
        return list(engine.generate([PROMPT], params)[0].token_ids), logits


def quant_kernel_on_gpu() -> tuple[bool, str]:
    """The Triton kernel on the GPU in e4m3fnuz against the torch reference's e4m3fn, transcoded."""
    x = (torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    x[:, 0] = -1e-9  # rounds to e4m3fn's -0, e4m3fnuz's NaN
    want_codes, want_scales = to_e4m3fnuz(*fn.dynamic_quant(x, 0))
    codes, scales = dynamic_quant(x.cuda(), fp8=torch.float8_e4m3fnuz)
    equal = torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
    return equal and torch.equal(scales.cpu(), want_scales), "8 x 4096 bf16 rows"


def main(work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "tiny"
    if not (ckpt / "config.json").exists():
        write_checkpoint("tiny", ckpt, seed=0)
    arts = {}
    for target in ("nvidia-sm90", "amd-gfx942"):
        arts[target] = work / target
        if not (arts[target] / "manifest.json").exists():
            recipe = load_recipe("ptpc-fp8", [f"target={target}"])
            compile_checkpoint(prepare(ckpt, recipe), arts[target], workers=2, progress=False, force=True)
    rows: list[tuple[str, str, str]] = []
    ok, note = same_weights(arts["nvidia-sm90"], arts["amd-gfx942"])
    rows.append(("weights: e4m3fnuz codes, doubled scales", "ok" if ok else "FAILED", note))
    (cpu_tokens, cpu_logits), (amd_tokens, amd_logits) = (
        greedy(arts["nvidia-sm90"], "cpu"),
        greedy(arts["amd-gfx942"], "cpu"),
    )
    equal = cpu_tokens == amd_tokens and torch.equal(cpu_logits, amd_logits)
    rows.append(("reference ops, CPU: logits and greedy", "ok" if equal else "FAILED", f"tokens {amd_tokens}"))
    found = device_target(torch.device("cuda")) if torch.cuda.is_available() else None
    if found == ("amd", "gfx942"):
        ok, note = quant_kernel_on_gpu()
        rows.append(("gfx942: FP8 quantization kernel", "ok" if ok else "FAILED", note))
        gpu_tokens, _ = greedy(arts["amd-gfx942"], "cuda")
        rows.append(
            ("gfx942: load + greedy, reference ops", "ok" if gpu_tokens == cpu_tokens else "FAILED", str(gpu_tokens))
        )
    else:
        seen = "no GPU" if found is None else f"this GPU is {found[0]} {found[1]}"
        for check in ("gfx942: FP8 quantization kernel", "gfx942: load + greedy, reference ops"):
            rows.append((check, "not run", seen))
    rows.append(("gfx942: Triton GEMM / MoE / attention", "not built", "the triton backend refuses e4m3fnuz weights"))
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  {'result':<9}  note")
    for check, result, note in rows:
        print(f"{check:<{width}}  {result:<9}  {note}")
    return 1 if any(r[1] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
