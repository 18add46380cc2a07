"""The w4a16 graph (issue 20), run with the runtime's reference ops (graph_reference.py): the unfused
graph against transformers holding the int4 weights dequantized, every fused graph against the
unfused one; the ops it emits (W4A16Linear on unquantized activations: the norm and SiLU-mul fusions
take their unquantized forms) and its ONNX export, checked with the `qcompile` op schemas."""

from __future__ import annotations

import dataclasses

import onnx
import pytest
import torch
from graph_helpers import PASS_NAMES, aligned_spec, kv, random_sources, recipe, with_prerequisites, write_weights
from test_graph_semantics import _hf_model, _prompts, _run

from qcompile.errors import PlanError
from qcompile.graph import compile_graph, to_onnx
from qcompile.quant.int4 import dequantize, quantize_int4

BLOCK = 4
SPECS = {"aligned": aligned_spec(), "aligned-moe": aligned_spec(moe=True)}


def _dequantized(sources: dict[str, torch.Tensor], graph) -> dict[str, torch.Tensor]:
    """`sources` with every tensor the graph quantizes replaced by q * scale (what W4A16Linear multiplies by)."""
    quantized = {s for job in graph.weights.values() if job.quant.int4 for s in job.source_names()}
    return {n: dequantize(*quantize_int4(t), 128) if n in quantized else t for n, t in sources.items()}


@pytest.mark.parametrize("name", list(SPECS))
def test_unfused_w4a16_graph_matches_transformers_on_the_dequantized_weights(name: str) -> None:
    spec = dataclasses.replace(SPECS[name], dtype="float32")
    sources = random_sources(spec)
    rec = dataclasses.replace(recipe("w4a16"), passes=(), kv_cache=kv(BLOCK))
    prompts, decode = _prompts(spec.vocab_size)
    prefill, step = _run(spec, rec, sources, prompts, decode)
    model = _hf_model(spec, _dequantized(sources, compile_graph(spec, rec)))
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            logits = model(torch.tensor([[*prompt, decode[b]]])).logits[0]
            torch.testing.assert_close(prefill[b], logits[-2], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(step[b], logits[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("passes", ["all", *PASS_NAMES])
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_w4a16_graph_computes_what_the_unfused_graph_computes(name: str, passes: str) -> None:
    spec = SPECS[name]
    sources = random_sources(spec)
    prompts, decode = _prompts(spec.vocab_size)
    base = dataclasses.replace(recipe("w4a16"), kv_cache=kv(BLOCK))
    names = PASS_NAMES if passes == "all" else with_prerequisites(passes)
    want = _run(spec, dataclasses.replace(base, passes=()), sources, prompts, decode)
    got = _run(spec, dataclasses.replace(base, passes=names), sources, prompts, decode)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(w.float()).all()
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)  # bf16, another summation order
        assert (g.float() - w.float()).abs().mean() < 2e-3 * w.float().abs().mean() + 1e-3


def test_w4a16_graph_ops_and_onnx(tmp_path, monkeypatch, op_schemas) -> None:
    spec = SPECS["aligned-moe"]
    graph = compile_graph(spec, dataclasses.replace(recipe("w4a16"), passes=PASS_NAMES))
    ops = [node.op_type for node in graph.nodes]
    assert not {"DynamicQuant", "AddRMSNormQuant", "SiluMulQuant"} & set(ops)
    linears = [node for node in graph.nodes if node.op_type == "W4A16Linear"]
    assert linears and all(node.attrs == {"group_size": 128} and len(node.inputs) == 3 for node in linears)
    (moe,) = [node for node in graph.nodes if node.op_type == "MoE"]
    assert (moe.attrs["linear"], moe.attrs["group_size"]) == ("W4A16Linear", 128)
    assert graph.weight_tensors["model.layers.1.mlp.experts.w13.weight_packed"].dtype == torch.int32
    assert graph.weight_tensors["model.layers.1.mlp.experts.w13.weight_packed"].shape == (3, 256, 32)
    assert graph.weight_tensors["model.layers.1.mlp.experts.w2.weight_scale"].shape == (3, 256, 1)
    locations, tensors = write_weights(graph, tmp_path)
    model = to_onnx(graph, locations)
    monkeypatch.chdir(tmp_path)  # an in-memory model's external data resolves from the working directory
    onnx.checker.check_model(model, full_check=True, check_custom_domain=True)
    path = tmp_path / "graph.onnx"
    path.write_bytes(model.SerializeToString())
    onnx.checker.check_model(str(path), full_check=True, check_custom_domain=True)
    name = "model.layers.1.mlp.experts.w2.weight_packed"
    (init,) = [i for i in onnx.load(str(path)).graph.initializer if i.name == name]
    assert init.data_type == onnx.TensorProto.INT32
    assert onnx.numpy_helper.to_array(init).tobytes() == tensors[name].numpy().tobytes()


def test_groups_that_do_not_divide_k_are_a_plan_error_naming_the_tensor() -> None:
    spec = dataclasses.replace(SPECS["aligned"], intermediate_size=200)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.down_proj\.weight \[256, 200\]"):
        compile_graph(spec, recipe("w4a16"))
    compile_graph(spec, recipe("w4a16", ignore=("lm_head", "re:.*down_proj$")))  # kept bf16 instead
