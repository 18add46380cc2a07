"""The runtime's reference path against Hugging Face transformers on the same weights.

bf16 artifacts: logits match transformers (fp32 compute: within 1e-5; bf16 compute: within 2% of the
largest logit, a few bf16 roundings, 8% for MoE where a bf16 near-tie may route a token to another
expert) and 32 greedy tokens are identical in fp32 (bf16: each chosen token is transformers' argmax
up to the bf16 tolerance). FP8 artifacts (ptpc-fp8, tensor-fp8):
compared with transformers running the artifact's own weights dequantized to fp32, so the only
difference left is the FP8 quantization of activations (per token, or per tensor). One e4m3 rounding
(3 mantissa bits) has an SQNR of about 32 dB; through the layers we require >= 26 dB and equal argmax
on most tokens (tensor-fp8, whose one activation scale per step rounds small tokens coarser: >= 24 dB).
That bar cannot tell a subtly wrong activation scale from FP8's own error, so the FP8 artifacts are
also compared with transformers rounding its activations through FP8 the same way (fp8_activations):
then the runtime must agree to fp32 rounding order, which any 10% scale error misses by far (ALIKE_DB).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import qruntime
import torch
from hf_reference import dequantized_checkpoint, hf_greedy, hf_logits, hf_model, sqnr_db
from qruntime import SamplingParams

CHECKPOINTS = ["tiny_ckpt", "tiny_tied_ckpt", "tiny_odd_ckpt", "tiny_moe_ckpt"]


def _prompt(rng: random.Random, vocab: int, block_size: int = 16) -> list[int]:
    length = rng.randrange(2 * block_size + 1, 5 * block_size)
    length += length % block_size == 0  # never a multiple of the block size
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(1 << 30)
    print(f"prompt seed {seed}")
    return random.Random(seed)


@pytest.mark.parametrize("fixture", CHECKPOINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_artifact_logits_match_transformers(request, fixture, dtype, compiled, rng):
    ckpt = request.getfixturevalue(fixture)
    engine = qruntime.load(compiled(ckpt, "bf16"), device="cpu", dtype=dtype, num_kv_blocks=32)
    ids = _prompt(rng, engine.vocab_size)
    ref = hf_logits(hf_model(ckpt, dtype), ids)
    got = engine.score(ids)
    if dtype == torch.float32:
        tolerance = 1e-5
    else:  # bf16 rounding; in MoE layers also routing near-ties that pick the other expert (seen up to 4.7%)
        tolerance = (0.08 if fixture == "tiny_moe_ckpt" else 0.02) * float(ref.abs().max())
    assert float((got - ref).abs().max()) <= tolerance
    assert torch.equal(got.argmax(-1), ref.argmax(-1)) or dtype == torch.bfloat16


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_bf16_artifact_greedy_32_tokens_equal_transformers(request, fixture, compiled, rng):
    ckpt = request.getfixturevalue(fixture)
    engine = qruntime.load(compiled(ckpt, "bf16"), device="cpu", dtype=torch.float32, num_kv_blocks=32)
    ids = _prompt(rng, engine.vocab_size)
    out = engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_greedy(hf_model(ckpt, torch.float32), ids, 32)
    assert out.finish_reason == "length"


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_bf16_compute_greedy_picks_transformers_argmax(request, fixture, compiled, rng):
    """In bf16 the logits of random weights tie often at bf16 resolution, so a different rounding
    order may pick the other of two tied tokens and the sequences part. The check that holds: with
    transformers teacher-forced on our 32 tokens, each token we chose is its argmax up to the bf16
    logit tolerance."""
    ckpt = request.getfixturevalue(fixture)
    engine = qruntime.load(compiled(ckpt, "bf16"), device="cpu", dtype=torch.bfloat16, num_kv_blocks=32)
    ids = _prompt(rng, engine.vocab_size)
    chosen = list(engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids)
    ref = hf_logits(hf_model(ckpt, torch.bfloat16), ids + chosen)[len(ids) - 1 : -1]  # [32, V]
    tolerance = (0.08 if fixture == "tiny_moe_ckpt" else 0.02) * float(ref.abs().max())
    margin = ref.max(-1).values - ref[torch.arange(32), chosen]
    assert float(margin.max()) <= tolerance


FP8_MAX = 448.0  # e4m3's largest finite value


def _fake_fp8(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """x rounded through e4m3 as the operator contract says (docs/OPS.md DynamicQuant), written here
    independently of qruntime: scale = max(amax(|x|) / 448, 1e-12) per token (per_token) or over every
    token of the step, x / scale clamped to +-448, cast to e4m3, times the scale."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True) if per_token else x32.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return ((x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, per_token: bool):
    """transformers' Qwen3MoeExperts.forward with the activations of both expert linears rounded
    through FP8 as the runtime's MoE op rounds them: the input once over all tokens, the SiLU-mul
    outputs of every routed (token, expert) pair together, in expert order."""
    xq = _fake_fp8(hidden_states, per_token)
    routes, acts = [], []
    for expert in top_k_index.unique().tolist():
        tokens, slot = torch.where(top_k_index == expert)
        gate, up = torch.nn.functional.linear(xq[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
        routes.append((expert, tokens, slot))
        acts.append(self.act_fn(gate) * up)
    out = torch.zeros_like(hidden_states)
    if not routes:
        return out
    aq = _fake_fp8(torch.cat(acts), per_token).split([a.shape[0] for a in acts])
    for (expert, tokens, slot), act in zip(routes, aq, strict=True):
        down = torch.nn.functional.linear(act, self.down_proj[expert])
        out.index_add_(0, tokens, down * top_k_weights[tokens, slot, None])
    return out


@contextmanager
def fp8_activations(model: torch.nn.Module, per_token: bool) -> Iterator[torch.nn.Module]:
    """`model` (transformers, on the artifact's dequantized weights) with the input of every linear the
    recipe quantizes (all but lm_head and the MoE router) rounded through FP8 by _fake_fp8."""
    hooks = [
        module.register_forward_pre_hook(lambda _, args: (_fake_fp8(args[0], per_token), *args[1:]))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    ]
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    for module in experts:
        module.forward = functools.partial(_experts_forward, module, per_token=per_token)
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        for module in experts:
            del module.forward


def position_sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """sqnr_db of each position's logits [T]."""
    noise = (reference - other).float().pow(2).mean(-1)
    return 10 * torch.log10(reference.float().pow(2).mean(-1) / noise)


# The best position's SQNR against transformers rounding activations alike, in dB (CPU, fp32), measured
# over 300 random prompts per checkpoint: 132-138 (ptpc-fp8) and 35-139 (tensor-fp8) when right. The
# tensor-fp8 tail is its one activation scale per step: when fp32 summation order moves one element of
# the token that holds the step's largest |x| across an e4m3 rounding boundary (seen in the dense
# down_proj of tiny_moe_ckpt, prompt seed 467008227), the next site's scale moves by ~3e-4 and ~0.5% of
# every token's activations round the other way: 35-45 dB at every position, in 2 of 300 prompts on
# tiny_moe_ckpt and 0 of 300 on the dense checkpoints. Such a prompt cannot be told from a scale error,
# so the test below scores up to ALIKE_PROMPTS fresh prompts and needs one to reach ALIKE_DB. With every
# 10% activation-scale error tried it is at most 37 at every position: the scale x1.1 / x0.9 in
# qruntime.ops.functional.dynamic_quant (so quantize and dequantize both use it) 26-30 / 22-27 dB at
# the median position; the returned scale alone 10% off 15-19; 10% off at one site only, o_proj's
# DynamicQuant 20-25, AddRMSNormQuant 20-24, SiluMulQuant 29-35, the MoE op 28-30. A rounding that
# flips the other way (fp32 order at a rounding boundary, an MoE routing near-tie) starts at one
# position and spreads to later ones through attention; a wrong scale changes every position.
ALIKE_DB = 45
ALIKE_PROMPTS = 3


@pytest.mark.parametrize("recipe", ["ptpc-fp8", "tensor-fp8"])
@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_fp8_artifact_matches_transformers_quantizing_activations_alike(
    request, fixture, recipe, compiled, rng, tmp_path
):
    """Against transformers on the artifact's dequantized weights *and* its activations rounded through
    FP8 by the contract (fp8_activations), the runtime agrees up to fp32 rounding order: some position
    of some prompt (of at most ALIKE_PROMPTS) to better than ALIKE_DB, which no 10% error of an
    activation scale reaches at any position of any prompt."""
    ckpt = request.getfixturevalue(fixture)
    artifact = compiled(ckpt, recipe)
    reference = hf_model(dequantized_checkpoint(ckpt, artifact, tmp_path / "deq"), torch.float32)
    engine = qruntime.load(artifact, device="cpu", dtype=torch.float32, num_kv_blocks=32)
    best = []
    while len(best) < ALIKE_PROMPTS and (not best or best[-1] < ALIKE_DB):
        ids = _prompt(rng, engine.vocab_size)
        with fp8_activations(reference, per_token=recipe == "ptpc-fp8"):
            ref = hf_logits(reference, ids)
        got = engine.score(ids)  # one prefill step: a per-tensor scale spans the whole prompt, as above
        best.append(float(position_sqnr_db(ref, got).max()))
    assert best[-1] >= ALIKE_DB, f"best position's SQNR per prompt {best} dB"


@pytest.mark.parametrize("recipe", ["ptpc-fp8", "tensor-fp8"])
@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_fp8_artifact_matches_transformers_on_dequantized_weights(request, fixture, recipe, compiled, rng, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    artifact = compiled(ckpt, recipe)
    reference = hf_model(dequantized_checkpoint(ckpt, artifact, tmp_path / "deq"), torch.float32)
    engine = qruntime.load(artifact, device="cpu", dtype=torch.float32, num_kv_blocks=32)
    ids = _prompt(rng, engine.vocab_size)
    ref, got = hf_logits(reference, ids), engine.score(ids)
    # measured over 60 prompts per checkpoint: 27.6-32.7 dB (ptpc-fp8), 25.6-32.2 (tensor-fp8); argmax
    # agreement 0.80-1.00. A 10% scale error in dynamic_quant's dequantization gives 15-19 dB; subtler
    # ones are the test above's.
    assert sqnr_db(ref, got) >= (26 if recipe == "ptpc-fp8" else 24)
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.75
    # and the fp8 error is really there: the same engine is not bit-equal to the dequantized reference
    assert not torch.allclose(got, ref, atol=1e-5)
