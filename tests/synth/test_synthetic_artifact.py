"""`qcompile synth PRESET --artifact`: the real graph and manifest with sparse weight files, random
weights made at load, refused wherever real weights matter."""

from __future__ import annotations

import json

import onnx
import pytest
import qruntime
import torch
from click.testing import CliRunner
from qruntime.synthetic import FP8_SPREAD, WEIGHT_STD, random_tensor

from qcompile.cli import main
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.io.safetensors_stream import read_header
from qcompile.recipe.schema import load_recipe


def _synthetic(tmp_path, *args: str):
    out = tmp_path / "synthetic"
    result = CliRunner().invoke(main, ["synth", "tiny-moe", "-o", str(out), "--artifact", *args])
    assert result.exit_code == 0, result.output
    assert "SYNTHETIC" in result.output
    return out


def _nodes(path):
    graph = onnx.load(str(path), load_external_data=False).graph
    nodes = [(n.op_type, tuple(n.input), tuple(n.output), str(n.attribute)) for n in graph.node]
    inits = sorted((i.name, tuple(i.dims), i.data_type) for i in graph.initializer)
    return nodes, inits


def test_synthetic_artifact_has_the_real_graph_and_sparse_weights(tmp_path, tiny_moe_ckpt):
    art = _synthetic(tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["synthetic"]["preset"] == "tiny-moe"
    assert manifest["source"]["path"] == "synthetic tiny-moe"
    real = tmp_path / "real"
    compile_checkpoint(prepare(tiny_moe_ckpt, load_recipe("ptpc-fp8")), real, progress=False)
    assert _nodes(art / "graph.onnx") == _nodes(real / "graph.onnx")
    real_manifest = json.loads((real / "manifest.json").read_text())
    assert manifest["tensors"] == real_manifest["tensors"]
    weight_files = [rel for rel in manifest["files"] if rel.startswith("weights/")]
    assert weight_files
    for rel in weight_files:
        entries, _ = read_header(art / rel)
        data_start = min(e.begin for e in entries.values())
        data = (art / rel).read_bytes()[data_start:]
        assert len(data) == sum(e.nbytes for e in entries.values()) and not any(data)  # all holes


def test_verify_refuses_a_synthetic_artifact(tmp_path):
    art = _synthetic(tmp_path)
    result = CliRunner().invoke(main, ["verify", str(art)])
    assert result.exit_code == 1
    assert "SYNTHETIC" in result.output


def test_load_makes_random_weights_and_generates(tmp_path):
    art = _synthetic(tmp_path)
    engine = qruntime.load(art, device="cpu", dtype="float32")
    weights = engine.runner.plan.weights
    w13 = weights["model.layers.0.mlp.experts.w13.weight"]
    assert w13.dtype == torch.float8_e4m3fn and torch.isfinite(w13.float()).all()
    assert w13.float().std().item() == pytest.approx(FP8_SPREAD, rel=0.1)
    scale = weights["model.layers.0.mlp.experts.w13.weight_scale"]
    assert (scale > 0).all() and scale.max() < 1.5 * WEIGHT_STD / FP8_SPREAD + 1e-9
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() < 0.2 and norm.std() > 0
    assert "synthetic" in engine.description["weights"].lower()
    params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.generate([[5, 6, 7, 8]], params)[0].token_ids
    again = qruntime.load(art, device="cpu", dtype="float32")  # values are a function of the name alone
    assert torch.equal(again.runner.plan.weights["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert again.generate([[5, 6, 7, 8]], params)[0].token_ids == first
    assert len(first) == 8


def test_random_tensor_depends_on_the_name_only():
    a = random_tensor("model.layers.3.self_attn.qkv_proj.weight", [64, 32], torch.float8_e4m3fn, torch.device("cpu"))
    b = random_tensor("model.layers.3.self_attn.qkv_proj.weight", [64, 32], torch.float8_e4m3fn, torch.device("cpu"))
    c = random_tensor("model.layers.4.self_attn.qkv_proj.weight", [64, 32], torch.float8_e4m3fn, torch.device("cpu"))
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch.equal(a.view(torch.uint8), c.view(torch.uint8))


def test_tp2_synthetic_artifact_loads_over_two_processes(tmp_path):
    art = _synthetic(tmp_path, "--tp", "2", "--recipe", "bf16")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["tp"] == 2 and manifest["graph"]["files"] == ["graph.rank0.onnx", "graph.rank1.onnx"]
    with qruntime.load(art, device="cpu", dtype="float32") as engine:
        out = engine.generate([[3, 4, 5]], qruntime.SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_bad_requests_are_refused(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["synth", "tiny", "-o", str(tmp_path / "a"), "--tp", "2"])
    assert result.exit_code == 2 and "--artifact" in result.output
    result = runner.invoke(main, ["synth", "tiny", "-o", str(tmp_path / "b"), "--artifact", "-r", "ptpc-fp8-kv8"])
    assert result.exit_code == 1 and "calibrates its KV cache" in result.output
    assert not (tmp_path / "b").exists()
