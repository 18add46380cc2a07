"""W4A16 on the runtime's reference path (issue 20): the `W4A16Linear` op and the `MoE` op with
linear W4A16Linear against their math written out independently, then whole `w4a16` artifacts
against transformers running the artifact's own int4 weights dequantized to fp32 (no activation is
quantized, so only fp32 summation order differs: within 1e-5 like the bf16 artifacts), and a tp=2
engine against tp=1. Random inputs fresh each run, the seed printed."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import onnx
import pytest
import qruntime
import torch
from hf_reference import hf_logits, hf_model
from int4_shapes import INT4_SHAPES
from qruntime import SamplingParams
from qruntime.artifact import ArtifactFormatError
from qruntime.kv_cache import KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops import functional as fn
from qruntime.ops.base import OpEnv
from qruntime.ops.moe import MoE
from qruntime.ops.quant import W4A16Linear
from safetensors.torch import save_file

from qcompile.publish.unfuse import split_to_sources
from qcompile.quant.int4 import dequantize, quantize_int4

PRESETS = {
    "dense": ("tiny", INT4_SHAPES),
    "tied": ("tiny-tied", INT4_SHAPES),
    "moe": ("tiny-moe", {**INT4_SHAPES, "moe_intermediate_size": 256}),
}
FP32 = {"device": "cpu", "dtype": torch.float32, "num_kv_blocks": 48, "max_model_len": 256}
ENV = OpEnv(torch.float32, torch.device("cpu"), KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", 16, 1, 1, 16))


def _independent_dequant(w: torch.Tensor, ws: torch.Tensor, group: int) -> torch.Tensor:
    """Column j of row n: nibble j mod 8 of word j // 8 read as an unsigned 32-bit number, minus 8,
    times its group's scale, in float64 (exact) — written without the op's shifts of signed ints."""
    words = w.to(torch.int64) % (1 << 32)  # the int32 bits as an unsigned value
    cols = torch.arange(w.shape[1] * 8)
    nibbles = (words[:, cols // 8] // (16 ** (cols % 8))) % 16  # [N, K]
    return (nibbles - 8).double() * ws.double().repeat_interleave(group, 1)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_w4a16_linear_is_x_times_the_dequantized_weight(rng, rows):
    group = rng.choice([32, 128])
    n, k = rng.choice([(48, 256), (40, 384), (256, 128)])
    w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), dtype=torch.int64).to(torch.int32)  # every bit pattern
    ws = (torch.rand(n, k // group) * 0.1 + 1e-3).to(torch.bfloat16)
    x = torch.randn(rows, k) * (torch.rand(rows, 1) * 4)
    consts = (None, w, ws.float())
    got = W4A16Linear({"group_size": group}, ENV, consts)(None, x, w, ws.float())
    want = (x.double() @ _independent_dequant(w, ws, group).T).float()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # in bf16 the weight is q * scale rounded to bf16 (compressed-tensors' dequantization), then a Gemm
    xb = x.to(torch.bfloat16)
    got16 = W4A16Linear({"group_size": group}, ENV, consts)(None, xb, w, ws)
    weight16 = (fn.unpack_int4(w).to(torch.bfloat16).reshape(n, -1, group) * ws[..., None]).reshape(n, k)
    assert torch.equal(got16, torch.nn.functional.linear(xb, weight16))


def test_runtime_unpacking_is_the_compilers_packing(rng):
    """The compiler packs (qcompile.quant.int4), the runtime unpacks on its own (it never imports
    qcompile): their dequantized weights are equal."""
    w = (torch.randn(24, 256) * rng.uniform(0.01, 3)).to(torch.bfloat16)
    packed, scale = quantize_int4(w)
    assert torch.equal(fn.dequantize_int4(packed, scale, 128), dequantize(packed, scale, 128))
    assert torch.equal(fn.dequantize_int4(packed, scale.float(), 128), dequantize(packed, scale.float(), 128))


def test_w4a16_linear_refuses_what_does_not_fit_at_bind():
    w, ws = torch.zeros(8, 16, dtype=torch.int32), torch.ones(8, 1)
    with pytest.raises(ValueError, match="group_size 12 is not a positive multiple of 8"):
        W4A16Linear({"group_size": 12}, ENV)
    with pytest.raises(ValueError, match=r"K = 128\) and ws \[8, 2\] do not fit group_size 128"):
        W4A16Linear({"group_size": 128}, ENV, (None, w, torch.ones(8, 2)))
    with pytest.raises(ValueError, match="w must be int32"):
        W4A16Linear({"group_size": 128}, ENV, (None, w.float(), ws))
    W4A16Linear({"group_size": 128}, ENV, (None, w, ws))


@pytest.mark.parametrize("rows", [1, 7])
def test_w4a16_linear_with_zero_points_is_x_times_code_minus_zero_times_scale(rng, rows):
    """Asymmetric int4 (w4a16-zp): (code - z) * scale, against the same independent unpacking with
    its -8 replaced by -z; z = 8 everywhere is the symmetric op; the compiler's dequantize agrees."""
    torch.manual_seed(rng.randrange(1 << 30))
    group, (n, k) = rng.choice([32, 128]), rng.choice([(48, 256), (40, 384)])
    w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), dtype=torch.int64).to(torch.int32)
    ws = (torch.rand(n, k // group) * 0.1 + 1e-3).to(torch.bfloat16)
    wz = torch.randint(0, 16, (n, k // group), dtype=torch.uint8)
    x = (torch.randn(rows, k) * (torch.rand(rows, 1) * 4 + 0.1)).to(torch.bfloat16)
    op = W4A16Linear({"group_size": group}, ENV, (None, w, ws, wz))
    shift = (wz.double() - 8).repeat_interleave(group, 1) * ws.double().repeat_interleave(group, 1)
    weight = (_independent_dequant(w, ws, group) - shift).to(torch.bfloat16)  # exact, then one rounding
    assert torch.equal(op(None, x, w, ws, wz), torch.nn.functional.linear(x, weight))
    assert torch.equal(fn.dequantize_int4(w, ws, group, wz), dequantize(w, ws, group, wz))
    eight = torch.full_like(wz, 8)
    assert torch.equal(op(None, x, w, ws, eight), op(None, x, w, ws))


def test_zero_points_that_do_not_fit_are_refused_at_bind():
    w, ws = torch.zeros(8, 32, dtype=torch.int32), torch.ones(8, 2)
    for wz in (torch.zeros(8, 2, dtype=torch.int32), torch.zeros(8, 1, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=r"wz \(zero points\) must be uint8 shaped like the scales \[8, 2\]"):
            W4A16Linear({"group_size": 128}, ENV, (None, w, ws, wz))
    attrs = {"num_experts": 2, "top_k": 1, "norm_topk_prob": 1, "linear": "W4A16Linear", "group_size": 128}
    w13, s13 = torch.zeros(2, 8, 32, dtype=torch.int32), torch.ones(2, 8, 2)
    with pytest.raises(ValueError, match=r"w2_zero_point \(zero points\) must be uint8"):
        MoE(attrs, ENV, (None, None, w13, s13, w13, s13, torch.zeros(2, 8, 2, dtype=torch.uint8), s13))
    with pytest.raises(ValueError, match="zero points are read by linear W4A16Linear only"):
        MoE({**attrs, "linear": "Gemm"}, ENV, (None, None, None, None, None, None, torch.zeros(1, dtype=torch.uint8)))


def test_moe_with_w4a16_experts_is_the_unfused_sum(rng):
    t, h, inter, experts, top_k = 11, 128, 128, 5, 2
    x = torch.randn(t, h) * (torch.rand(t, 1) * 3)
    router = torch.randn(experts, h)
    parts = [quantize_int4(torch.randn(2 * inter, h) * rng.uniform(0.02, 0.2)) for _ in range(experts)]
    downs = [quantize_int4(torch.randn(h, inter) * rng.uniform(0.02, 0.2)) for _ in range(experts)]
    w13, s13 = torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])
    w2, s2 = torch.stack([p for p, _ in downs]), torch.stack([s for _, s in downs])
    attrs = {"num_experts": experts, "top_k": top_k, "norm_topk_prob": 1, "linear": "W4A16Linear", "group_size": 128}
    got = MoE(attrs, ENV)(None, x, router, w13, s13, w2, s2)
    weights, ids = fn.moe_routing(x @ router.T, top_k, True)
    total = torch.zeros(t, h, dtype=torch.float64)
    for e in range(experts):
        up = x.double() @ _independent_dequant(w13[e], s13[e], 128).T
        act = fn.silu_mul(up.float()).double()
        coef = (weights * (ids == e)).sum(-1, keepdim=True).double()
        total += (act @ _independent_dequant(w2[e], s2[e], 128).T) * coef
    torch.testing.assert_close(got.double(), total, rtol=1e-5, atol=1e-5 * float(total.abs().max()))


# ------------------------------------------------------------------------------------ whole models


@pytest.fixture(scope="module")
def artifacts(make_ckpt, compiled) -> dict[str, tuple[Path, Path]]:
    """kind -> (checkpoint, its w4a16 artifact), fresh random weights each run."""
    seed = random.randrange(1 << 30)
    print(f"checkpoint seed {seed}")
    out = {}
    for kind, (preset, shapes) in PRESETS.items():
        ckpt = make_ckpt(preset, seed=seed, **shapes)
        out[kind] = ckpt, compiled(ckpt, "w4a16")
    return out


def dequantized_checkpoint(ckpt: Path, artifact: Path, out: Path) -> Path:
    """A copy of `ckpt` whose weights are the artifact's, the int4 ones dequantized to fp32 (q * scale)."""
    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for name, weight, scale in split_to_sources(artifact):
        if scale is None:
            tensors[name] = weight.float()
        else:
            assert weight.dtype == torch.int32
            tensors[name] = _independent_dequant(weight, scale, 128).float()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randrange(33, 80))]


@pytest.mark.parametrize("kind", list(PRESETS))
def test_w4a16_artifact_logits_equal_transformers_on_its_dequantized_weights(artifacts, kind, rng, tmp_path):
    ckpt, art = artifacts[kind]
    engine = qruntime.load(art, **FP32)
    ids = _prompt(rng, engine.vocab_size)
    model = hf_model(dequantized_checkpoint(ckpt, art, tmp_path / "dequantized"), torch.float32)
    ref = hf_logits(model, ids)
    got = engine.score(ids)
    assert float((got - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max()))
    # the int4 rounding is really there: the source's own bf16 weights give other logits
    source = hf_logits(hf_model(ckpt, torch.float32), ids)
    assert float((source - ref).abs().max()) > 1e-3 * float(ref.abs().max())
    out = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_w4a16_tp2_engine_equals_tp1(make_ckpt, compiled, rng):
    """Weight-only quantization has no per-rank activation scale: the tp=2 ranks' partial sums give
    the tp=1 logits to fp32 summation order."""
    _, shapes = PRESETS["dense"]
    ckpt = make_ckpt("tiny", **shapes)
    tp1 = qruntime.load(compiled(ckpt, "w4a16"), **FP32)
    ids = _prompt(rng, tp1.vocab_size)
    want = tp1.score(ids)
    with qruntime.load(compiled(ckpt, "w4a16", "tp=2"), **FP32) as tp2:
        got = tp2.score(ids)
        greedy = SamplingParams(max_tokens=8, ignore_eos=True)
        assert tp2.generate([ids], greedy)[0].finish_reason == "length"
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_an_artifact_with_a_bad_group_size_is_refused_at_load(artifacts, tmp_path):
    """A graph whose W4A16Linear says another group size than its scales have is a load error naming the node."""
    _, art = artifacts["dense"]
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    model = onnx.load(str(copy / "graph.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "W4A16Linear")
    next(a for a in node.attribute if a.name == "group_size").i = 64
    (copy / "graph.onnx").write_bytes(model.SerializeToString())
    data = json.loads((copy / "manifest.json").read_text())
    data["files"]["graph.onnx"] = {
        "sha256": hashlib.sha256((copy / "graph.onnx").read_bytes()).hexdigest(),
        "bytes": (copy / "graph.onnx").stat().st_size,
    }
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactFormatError, match=rf"node '{node.name}'.*do not fit group_size 64"):
        qruntime.load(copy, **FP32)
