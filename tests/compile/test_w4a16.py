"""The `w4a16` recipe against llm-compressor's W4A16 preset, byte for byte (issue 20).

Fresh random checkpoints each run (the seed printed), every linear's input width a whole number of
128-column groups: dense, tied embeddings and MoE (experts stacked into w13 / w2, packed). Our
artifact's weights split back to source names (`split_to_sources`) must be every `weight_packed`
int32 and bf16 `weight_scale` that `model_free_ptq` and `oneshot` write, the tensors they leave
unquantized too; the artifact's fused tensors are the concatenation along N of the packed rows and
of the scales. At tp=2 each rank's tensor is a slice of the tp=1 tensor, in packed words and groups
for a column (row-parallel) split. Groups that do not divide K, or a tp that cuts a group, are
PlanErrors naming the tensor, before anything is written.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from int4_shapes import INT4_SHAPES
from llmc_reference import (
    BF16,
    IGNORE,
    MODEL_FREE_IGNORE,
    OBSERVER,
    assert_identical,
    cached_runs,
    group_dicts,
    quantization_config,
    read_tensors,
    run_model_free,
    run_oneshot,
)
from qruntime.artifact import read_manifest
from safetensors.torch import load_file

from qcompile.compile.jobs import WeightJob
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.compile.sharding import Sharding
from qcompile.errors import PlanError
from qcompile.publish.unfuse import split_to_sources
from qcompile.quant.int4 import quantize_int4
from qcompile.recipe.schema import load_recipe
from qcompile.source.checkpoint import Checkpoint
from qcompile.source.model import expected_tensors

MOE_SHAPES = {**INT4_SHAPES, "moe_intermediate_size": 256}
PRESETS = {"dense": ("tiny", INT4_SHAPES), "tied": ("tiny-tied", INT4_SHAPES), "moe": ("tiny-moe", MOE_SHAPES)}


@pytest.fixture(scope="module")
def seed() -> int:
    seed = random.randrange(1 << 30)
    print(f"checkpoint seed {seed}")
    return seed


@pytest.fixture(scope="module")
def ckpts(make_ckpt: Callable[..., Path], seed: int) -> dict[str, Path]:
    return {kind: make_ckpt(preset, seed=seed, **shapes) for kind, (preset, shapes) in PRESETS.items()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("w4a16")


def _compile(ckpt: Path, out: Path, recipe: str, overrides: tuple[str, ...]) -> None:
    compile_checkpoint(prepare(ckpt, load_recipe(recipe, list(overrides))), out, workers=2, progress=False)


@pytest.fixture(scope="module")
def compiled(workdir: Path) -> Callable[..., Path]:
    get = cached_runs(workdir, "qcompile", _compile)
    return lambda ckpt, *overrides: get(ckpt, "w4a16", tuple(overrides))


def split(artifact: Path) -> dict[str, torch.Tensor]:
    """Our weights as compressed-tensors names them: `X.weight_packed` + `X.weight_scale` (+ the
    `X.weight_shape` llm-compressor records, from the source's shape) or `X.weight` when unquantized."""
    out: dict[str, torch.Tensor] = {}
    for name, weight, scale in split_to_sources(artifact):
        if scale is None:
            out[name] = weight
            continue
        module = name.removesuffix(".weight")
        assert weight.dtype == torch.int32 and scale.dtype == BF16, name
        out[module + ".weight_packed"], out[module + ".weight_scale"] = weight, scale
        out[module + ".weight_shape"] = torch.tensor([weight.shape[0], weight.shape[1] * 8])
    return out


@pytest.mark.parametrize("kind", list(PRESETS))
def test_w4a16_equals_model_free_ptq(ckpts, kind, compiled, workdir):
    ckpt = ckpts[kind]
    reference = workdir / f"model-free-{kind}"
    run_model_free(ckpt, reference, "W4A16", MODEL_FREE_IGNORE)
    theirs = read_tensors(reference)
    assert_identical(split(compiled(ckpt)), theirs)
    packed = {k for k, t in theirs.items() if k.endswith(".weight_packed")}
    assert packed and all(theirs[k].dtype == torch.int32 for k in packed)
    assert theirs["model.embed_tokens.weight"].dtype == BF16
    assert ("lm_head.weight" in theirs) == (kind != "tied")
    if kind == "moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight_packed" in theirs
        assert theirs["model.layers.0.mlp.gate.weight"].dtype == BF16  # the router is ignored
    config, _ = quantization_config(compiled(ckpt))
    reference_config, _ = quantization_config(reference)
    assert group_dicts(config, OBSERVER) == group_dicts(reference_config, OBSERVER)
    assert config.format == reference_config.format == "pack-quantized"


@pytest.mark.parametrize("kind", ["dense", "tied"])
def test_w4a16_equals_oneshot(ckpts, kind, compiled, workdir):
    ckpt = ckpts[kind]
    reference = workdir / f"oneshot-{kind}"
    run_oneshot(ckpt, reference, "W4A16", IGNORE)
    assert_identical(split(compiled(ckpt)), read_tensors(reference))


def test_fused_tensors_concatenate_packed_rows_and_scales(ckpts, compiled):
    """qkv_proj, gate_up_proj and the stacked experts: rows of each part in order, packed and scaled
    exactly as the part alone (groups run along K, so fusing along N touches no group)."""
    source = {}
    for file in sorted(ckpts["moe"].glob("*.safetensors")):
        source.update(load_file(file))
    art = compiled(ckpts["moe"])
    ours = {}
    for file in sorted((art / "weights").glob("*.safetensors")):
        ours.update(load_file(file))
    tensors = read_manifest(art)["tensors"]

    def packed(names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_int4(source[n]) for n in names]
        return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])

    attn = "model.layers.0.self_attn."
    want = packed([f"{attn}{p}_proj.weight" for p in "qkv"])
    assert tensors[attn + "qkv_proj.weight_packed"]["shape"] == [512, 16]  # q 256 + k 128 + v 128 rows, 128 / 8
    assert tensors[attn + "qkv_proj.weight_scale"]["shape"] == [512, 1]
    assert torch.equal(ours[attn + "qkv_proj.weight_packed"], want[0])
    assert torch.equal(ours[attn + "qkv_proj.weight_scale"], want[1])
    mlp = "model.layers.1.mlp."  # the dense layer of tiny-moe
    want = packed([mlp + "gate_proj.weight", mlp + "up_proj.weight"])
    assert torch.equal(ours[mlp + "gate_up_proj.weight_packed"], want[0])
    assert torch.equal(ours[mlp + "gate_up_proj.weight_scale"], want[1])
    experts = "model.layers.0.mlp.experts."
    w13 = [packed([f"{experts}{e}.gate_proj.weight", f"{experts}{e}.up_proj.weight"]) for e in range(8)]
    w2 = [packed([f"{experts}{e}.down_proj.weight"]) for e in range(8)]
    assert list(ours[experts + "w13.weight_packed"].shape) == [8, 512, 16]  # [E, 2I, H / 8]
    assert list(ours[experts + "w2.weight_scale"].shape) == [8, 128, 2]  # [E, H, I / 128]
    for name, parts in ((experts + "w13", w13), (experts + "w2", w2)):
        assert torch.equal(ours[name + ".weight_packed"], torch.stack([p for p, _ in parts]))
        assert torch.equal(ours[name + ".weight_scale"], torch.stack([s for _, s in parts]))


def test_the_graph_reads_activations_unquantized(ckpts, compiled):
    """W4A16Linear on the model-dtype activations: no DynamicQuant, and the norm and SiLU-mul
    fusions take their unquantized forms."""
    ops = [
        n.op_type for n in onnx.load(str(compiled(ckpts["moe"]) / "graph.onnx"), load_external_data=False).graph.node
    ]
    assert "W4A16Linear" in ops and "MoE" in ops
    assert not {"DynamicQuant", "AddRMSNormQuant", "SiluMulQuant", "PTPCLinear"} & set(ops)
    assert ops.count("AddRMSNorm") == 2 * 3 + 1 and ops.count("SiluMul") == 1  # one dense layer


def _rank_tensors(art: Path, rank: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted((art / "weights" / f"rank{rank}").glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_ranks_hold_slices_of_the_tp1_tensors(ckpts, kind, compiled):
    """Column-parallel (qkv, gate_up, w13): rows, packed words and scales together; row-parallel
    (o_proj, down_proj, w2): whole groups of K per rank, the packed words and the group scales cut
    at the same column."""
    ckpt = ckpts[kind]
    whole = {}
    for file in sorted((compiled(ckpt) / "weights").glob("*.safetensors")):
        whole.update(load_file(file))
    art = compiled(ckpt, "tp=2")
    manifest = read_manifest(art)
    ranks = [_rank_tensors(art, r) for r in range(2)]
    for name, info in manifest["tensors"].items():
        assert list(info["shape"]) == list(whole[name].shape), name
        for r, entry in enumerate(info["ranks"]):
            want = whole[name]
            if info["axis"] is not None:
                want = torch.cat([want.narrow(info["axis"], b, e - b) for b, e in entry["spans"]], info["axis"])
            assert ranks[r][name].dtype == want.dtype and torch.equal(ranks[r][name], want), f"{name} rank {r}"
    o_proj = manifest["tensors"]["model.layers.0.self_attn.o_proj.weight_packed"]
    assert o_proj["axis"] == 1 and [e["spans"] for e in o_proj["ranks"]] == [[[0, 16]], [[16, 32]]]  # 256 / 8
    scale = manifest["tensors"]["model.layers.0.self_attn.o_proj.weight_scale"]
    assert scale["axis"] == 1 and [e["spans"] for e in scale["ranks"]] == [[[0, 1]], [[1, 2]]]  # 2 groups
    if kind == "dense":
        gate_up = manifest["tensors"]["model.layers.0.mlp.gate_up_proj.weight_scale"]
        assert gate_up["axis"] == 0 and gate_up["ranks"][1]["spans"] == [[128, 256], [384, 512]]


def test_groups_that_do_not_divide_k_are_refused_naming_the_tensor(make_ckpt, tmp_path):
    ckpt = make_ckpt("tiny")  # hidden 64: every projection's 64 input columns are half a group
    with pytest.raises(
        PlanError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight \[64, 64\].*not a multiple of the group size 128"
    ):
        prepare(ckpt, load_recipe("w4a16"))
    odd = make_ckpt("tiny", **{**INT4_SHAPES, "intermediate_size": 320})
    with pytest.raises(
        PlanError, match=r"model\.layers\.0\.mlp\.down_proj\.weight \[128, 320\]: its 320 input columns"
    ):
        prepare(odd, load_recipe("w4a16"))
    # ignored, the module stays bf16 and the rest compiles
    prepare(odd, load_recipe("w4a16", ["quantization.ignore=[lm_head, 're:.*down_proj$']"]))


def test_a_tp_that_cuts_a_group_is_refused_naming_the_tensor(make_ckpt):
    ckpt = make_ckpt("tiny", **{**INT4_SHAPES, "intermediate_size": 384})  # down_proj: 192 columns a rank
    with pytest.raises(
        PlanError,
        match=r"tp=2 gives each rank 192 of the 384 input columns of model\.layers\.0\.mlp\.down_proj\.weight, "
        r"not a whole number of 128-column int4 groups",
    ):
        prepare(ckpt, load_recipe("w4a16", ["tp=2"]))
    prepare(ckpt, load_recipe("w4a16"))  # whole at tp=1


def test_manifest_records_packed_shapes_and_source_rows(ckpts, compiled):
    tensors = read_manifest(compiled(ckpts["dense"]))["tensors"]
    down = tensors["model.layers.0.mlp.down_proj.weight_packed"]
    assert (down["dtype"], down["shape"], down["scheme"], down["role"]) == ("I32", [128, 32], "w4a16", "linear")
    assert down["parts"] == [[["model.layers.0.mlp.down_proj.weight", 0, 128]]]
    assert tensors["lm_head.weight"]["scheme"] == "none"
    config = json.loads((compiled(ckpts["dense"]) / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["num_bits"] == 4


def test_sharding_refuses_a_cut_inside_a_group_naming_the_weight(make_ckpt):
    """The sharding's own check (the graph builder refuses first, but every tensor's split goes through it)."""
    spec = Checkpoint.open(make_ckpt("tiny", **{**INT4_SHAPES, "intermediate_size": 384})).spec
    down = "model.layers.0.mlp.down_proj"
    job = WeightJob(down, ((f"{down}.weight",),), stacked=False, scheme="w4a16", role="linear")
    with pytest.raises(PlanError, match=rf"tp=2: {down}\.weight_packed would be split between columns 191 and 192"):
        Sharding(spec, 2).splits(job, expected_tensors(spec))
    gate_up = WeightJob(
        "model.layers.0.mlp.gate_up_proj",
        (("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"),),
        stacked=False,
        scheme="w4a16",
        role="linear",
    )
    splits = Sharding(spec, 2).splits(gate_up, expected_tensors(spec))  # rows: no group is cut
    assert splits[gate_up.weight_name] == splits[gate_up.scale_name] and splits[gate_up.weight_name].axis == 0
