"""Check qcompile's amd-gfx942 target (issue 26) on this machine; on an AMD Instinct MI300X / MI308X /
MI325X also on its GPU. Prints one table; exits 1 if a check that ran failed.

    python examples/amd_check.py WORKDIR

It makes a small random Qwen3 checkpoint, compiles it twice (ptpc-fp8, --target nvidia-sm90 and
--target amd-gfx942) and checks:
- the amd artifact's FP8 weights are the nvidia one's codes as e4m3fnuz with doubled scales, so
  every weight dequantizes to the same value;
- on the reference ops (CPU, fp32) both artifacts give the same logits and greedy tokens;
- on a gfx942 GPU (ROCm torch): the per-token FP8 quantization kernel in e4m3fnuz equals the
  e4m3fn result transcoded, the artifact loads there (its target checked against the GPU), its
  greedy tokens on the GPU's reference ops equal the CPU's, the Triton fast path (every FP8 kernel
  in e4m3fnuz) gives the reference path's logits within FAST_DB (both bf16), and,
  run from a checkout of the repository, the kernel tests of the e4m3fnuz kernels
  (tests/runtime/kernels/test_kernel_fnuz.py) pass on the GPU's hardware branch.
Unproven without such a GPU, and what this script is for: docs/OPS.md, "FP8 formats: the compile
target".
"""

from __future__ import annotations

import subprocess
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
FAST_DB = 30.0  # the Triton fast path's logits against the reference ops', both bf16


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


def greedy(
    art: Path, device: str, backend: str = "reference", dtype: torch.dtype = torch.float32
) -> tuple[list[int], torch.Tensor]:
    with qruntime.load(art, device=device, backend=backend, dtype=dtype) as engine:
        logits = engine.score(PROMPT).cpu()
        params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
        return list(engine.generate([PROMPT], params)[0].token_ids), logits


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (x.double() - ref.double()).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def kernel_tests() -> tuple[str, str]:
    """The e4m3fnuz kernels' tests on this GPU (their hardware branch), from a repository checkout."""
    tests = Path(__file__).resolve().parent.parent / "tests" / "runtime" / "kernels" / "test_kernel_fnuz.py"
    if not tests.is_file():
        return "not run", f"{tests} not found (run from a checkout of the repository)"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tests)], capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return ("ok" if done.returncode == 0 else "FAILED"), last


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
        gpu_tokens, gpu_logits = greedy(arts["amd-gfx942"], "cuda")
        rows.append(
            ("gfx942: load + greedy, reference ops", "ok" if gpu_tokens == cpu_tokens else "FAILED", str(gpu_tokens))
        )
        # the fast path computes in bf16: against the reference ops in bf16, the prompt's logits within
        # FAST_DB (fp8 activation codes that round across a step differ); tokens shown, ties may flip
        fast_tokens, fast_logits = greedy(arts["amd-gfx942"], "cuda", "triton", torch.bfloat16)
        ref_tokens, ref_logits = greedy(arts["amd-gfx942"], "cuda", "reference", torch.bfloat16)
        db = sqnr_db(fast_logits.float(), ref_logits.float())
        note = f"logits {db:.1f} dB from the reference ops' (bf16); tokens {fast_tokens} vs {ref_tokens}"
        rows.append(("gfx942: Triton fast path vs reference", "ok" if db >= FAST_DB else "FAILED", note))
        rows.append(("gfx942: e4m3fnuz kernel tests", *kernel_tests()))
    else:
        seen = "no GPU" if found is None else f"this GPU is {found[0]} {found[1]}"
        for check in (
            "gfx942: FP8 quantization kernel",
            "gfx942: load + greedy, reference ops",
            "gfx942: Triton fast path vs reference",
            "gfx942: e4m3fnuz kernel tests",
        ):
            rows.append((check, "not run", seen))
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  {'result':<9}  note")
    for check, result, note in rows:
        print(f"{check:<{width}}  {result:<9}  {note}")
    return 1 if any(r[1] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
