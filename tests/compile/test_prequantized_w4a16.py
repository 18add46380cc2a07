"""Pre-quantized W4A16 checkpoints (compressed-tensors pack-quantized, as llm-compressor saves its
W4A16 preset) as compiler input (issue 20): transcoded, never re-quantized.

llm-compressor quantizes fresh random checkpoints (the seed printed; every linear's input width a
whole number of 128-column groups); compiling what it saved must give the `w4a16` artifact of the
bf16 original — every weight file and graph byte for byte — with the recipe taken from config.json.
Dense, tied, MoE, three groups a row; oneshot and model_free_ptq outputs; tp=2. The artifact splits
back into the input's packed weights, scales and shapes, and generates. Act-order 'weight' is
stored as without act-order; act-order 'group' adds `weight_g_idx` (written here as older
compressed-tensors wrote it), read when it keeps the groups in order and refused naming the
column when it does not. Broken packed tensors and configs we cannot honour (a config saying zero
points without the tensors, other group sizes) are errors naming the tensor or key, before any work.
Checkpoints with zero points: test_prequantized_w4a16_zp.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import qruntime
import torch
from int4_shapes import INT4_SHAPES
from llmc_reference import IGNORE, MODEL_FREE_IGNORE, assert_identical, read_tensors
from prequantized_inputs import (
    assert_same_artifact,
    cached_compiler,
    compile_to,
    copy_checkpoint,
    edit_config,
    make_checkpoints,
    quantize_with_llmcompressor,
    rewrite_tensors,
)
from qruntime.artifact import read_manifest

from qcompile.errors import CheckpointError, RecipeError, TensorValueError
from qcompile.publish.unfuse import split_to_sources
from qcompile.recipe.prequantized import default_recipe

PRESETS = {
    "dense": ("tiny", INT4_SHAPES),
    "tied": ("tiny-tied", INT4_SHAPES),
    "moe": ("tiny-moe", {**INT4_SHAPES, "moe_intermediate_size": 256}),
    "three-groups": ("tiny", {**INT4_SHAPES, "intermediate_size": 384, "vocab_size": 538}),
}


@pytest.fixture(scope="module")
def ckpts(make_ckpt: Callable[..., Path]) -> dict[str, Path]:
    return make_checkpoints(make_ckpt, PRESETS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prequantized-w4a16")


@pytest.fixture(scope="module")
def quantized(ckpts, workdir) -> Callable[..., Path]:
    """`quantized(kind, tool="oneshot")`: llm-compressor's W4A16 checkpoint (cached)."""
    made: dict[tuple, Path] = {}

    def get(kind: str, tool: str = "oneshot") -> Path:
        if (kind, tool) not in made:
            ignore = IGNORE if tool == "oneshot" else MODEL_FREE_IGNORE
            out = workdir / f"{tool}-{kind}"
            made[(kind, tool)] = quantize_with_llmcompressor(ckpts[kind], out, "W4A16", ignore, tool)
        return made[(kind, tool)]

    return get


@pytest.fixture(scope="module")
def compiled(workdir) -> Callable[..., Path]:
    return cached_compiler(workdir)


@pytest.mark.parametrize(("kind", "tool"), [(k, "oneshot") for k in PRESETS] + [("moe", "model_free")])
def test_transcoded_artifact_equals_compiling_the_bf16_original(kind, tool, ckpts, quantized, compiled):
    ckpt = quantized(kind, tool)
    assert default_recipe(ckpt) == "w4a16"
    assert read_tensors(ckpt)["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    ours = compiled(ckpt)
    assert_same_artifact(ours, compiled(ckpts[kind], "w4a16"))
    source = read_manifest(ours)["source"]["quantization"]
    assert source == {"method": "compressed-tensors", "format": "pack-quantized", "scheme": "w4a16"}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_artifact_splits_back_into_the_input_tensors(kind, quantized, compiled):
    """The packed int32 weights, their bf16 group scales, the logical weight_shape compressed-tensors
    records, and what stayed bf16: every tensor of the input, bytes and all."""
    ckpt = quantized(kind)
    out: dict[str, torch.Tensor] = {}
    for name, weight, scale in split_to_sources(compiled(ckpt)):
        if scale is None:
            out[name] = weight
            continue
        module = name.removesuffix(".weight")
        out[module + ".weight_packed"], out[module + ".weight_scale"] = weight, scale
        out[module + ".weight_shape"] = torch.tensor([weight.shape[0], weight.shape[1] * 8])
    assert_identical(out, read_tensors(ckpt))


def test_tp2_transcoded_equals_tp2_compiled(ckpts, quantized, compiled):
    assert_same_artifact(compiled(quantized("moe"), None, "tp=2"), compiled(ckpts["moe"], "w4a16", "tp=2"))


def test_transcoded_artifact_generates(ckpts, quantized, compiled):
    params = qruntime.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True
    )  # random weights: EOS may come early
    prompt = [3, 17, 42, 5]
    tokens = [
        qruntime.load(art, device="cpu").generate(prompt, params)[0].token_ids
        for art in (compiled(quantized("moe")), compiled(ckpts["moe"], "w4a16"))
    ]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]


def test_an_fp8_recipe_is_refused(quantized, tmp_path):
    with pytest.raises(RecipeError, match=r"recipe 'ptpc-fp8' quantizes with scheme 'ptpc-fp8'.*scheme 'w4a16'"):
        compile_to(quantized("dense"), tmp_path / "out", "ptpc-fp8")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ hostile inputs

O_PROJ = "model.layers.0.self_attn.o_proj"  # [128, 256]: 32 packed words and 2 groups a row


@pytest.fixture
def hostile(quantized, tmp_path) -> Callable[[], Path]:
    return lambda: copy_checkpoint(quantized("dense"), tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(f"{O_PROJ}.weight_shape"), rf"tensor '{O_PROJ}\.weight_shape' is missing from the checkpoint"),
        (lambda t: t.pop(f"{O_PROJ}.weight_scale"), rf"tensor '{O_PROJ}\.weight_scale' is missing from the checkpoint"),
        (
            lambda t: t.pop(f"{O_PROJ}.weight_packed"),
            rf"tensor '{O_PROJ}\.weight_packed' is missing from the checkpoint",
        ),
        (
            lambda t: t.update({f"{O_PROJ}.weight_packed": t[f"{O_PROJ}.weight_packed"].to(torch.int64)}),
            rf"tensor '{O_PROJ}\.weight_packed' is I64; compressed-tensors pack-quantized stores it as I32",
        ),
        (
            lambda t: t.update({f"{O_PROJ}.weight_scale": t[f"{O_PROJ}.weight_scale"][:, :1].contiguous()}),
            rf"tensor '{O_PROJ}\.weight_scale' has shape \[128, 1\]; compressed-tensors pack-quantized stores it as \[128, 2\]",
        ),
        (
            lambda t: t.update({f"{O_PROJ}.weight_shape": torch.tensor([128, 255])}),
            rf"tensor '{O_PROJ}\.weight_shape' holds \[128, 255\], but {O_PROJ}\.weight_packed \[128, 32\] holds a linear of "
            r"\[128, 256\]",
        ),
        (
            lambda t: t.update(
                {
                    f"{O_PROJ}.weight_packed": t[f"{O_PROJ}.weight_packed"][:, :16].contiguous(),
                    f"{O_PROJ}.weight_scale": t[f"{O_PROJ}.weight_scale"][:, :1].contiguous(),
                    f"{O_PROJ}.weight_shape": torch.tensor([128, 128]),
                }
            ),
            rf"tensor '{O_PROJ}\.weight_packed' holds a linear of shape \[128, 128\], config\.json implies \[128, 256\]",
        ),
        (
            lambda t: t.update({f"{O_PROJ}.weight": torch.zeros(128, 256, dtype=torch.bfloat16)}),
            rf"tensor '{O_PROJ}\.weight' is stored beside '{O_PROJ}\.weight_packed'",
        ),
        (
            lambda t: t.update({f"{O_PROJ}.weight_zero_point": torch.zeros(128, 2)}),
            rf"unexpected tensor '{O_PROJ}\.weight_zero_point'",
        ),
    ],
    ids=[
        "no-shape",
        "no-scale",
        "no-weight",
        "weight-dtype",
        "scale-shape",
        "shape-values",
        "packed-shape",
        "both",
        "zp",
    ],
)
def test_broken_packed_tensors_are_refused_before_any_work(edit, message, hostile, tmp_path):
    ckpt = hostile()
    rewrite_tensors(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0])
def test_bad_group_scales_are_refused_naming_the_tensor(value, hostile, tmp_path):
    ckpt = hostile()
    name = f"{O_PROJ}.weight_scale"

    def edit(tensors):
        scale = tensors[name].clone()
        scale[100, 1] = value
        tensors[name] = scale

    rewrite_tensors(ckpt, edit)
    with pytest.raises(TensorValueError, match=rf"tensor '{name}' holds {value} at index \[100, 1\]"):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _weights(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: _weights(c).update(actorder="group"),
            r"tensor '.*\.weight_g_idx' is missing.* \+ .*\.weight_shape \+ .*\.weight_g_idx",
        ),
        (lambda c: _weights(c).update(actorder="sideways"), r"weights\.actorder 'sideways' is not read"),
        (lambda c: _weights(c).update(actorder=["group"]), r"weights\.actorder \['group'\] is not read"),
        (
            lambda c: _weights(c).update(symmetric=False),
            r"tensor '.*\.weight_zero_point' is missing from the checkpoint",
        ),
        (lambda c: _weights(c).update(group_size=64), r"match no qcompile scheme.*w4a16: int4 weights"),
        (lambda c: _weights(c).update(num_bits=8), r"match no qcompile scheme"),
    ],
    ids=["actorder-no-g-idx", "actorder-unknown", "actorder-list", "asymmetric", "group-64", "int8"],
)
def test_configs_we_cannot_honour_are_refused(edit, message, hostile, tmp_path):
    ckpt = hostile()
    edit_config(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out", "w4a16")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ act-order


@pytest.mark.parametrize("actorder", ["weight", "static"])
def test_act_order_weight_is_stored_in_order_and_transcodes(actorder, hostile, ckpts, compiled):
    """GPTQ's act-order 'weight' (alias 'static') changes how it calibrates, not what it stores."""
    ckpt = hostile()
    edit_config(ckpt, lambda c: _weights(c).update(actorder=actorder))
    ours = compiled(ckpt)
    assert_same_artifact(ours, compiled(ckpts["dense"], "w4a16"))
    assert read_manifest(ours)["source"]["quantization"]["actorder"] == "weight"


def _add_g_idx(ckpt: Path, permute: str | None = None) -> None:
    """act-order 'group' as older compressed-tensors saved it: `weight_g_idx` [cols] int32 beside each
    packed weight, the group of each input column; in order except for module `permute`, whose g_idx
    is shuffled (fresh each run) as GPTQ's activation order leaves it."""
    edit_config(ckpt, lambda c: _weights(c).update(actorder="group"))

    def edit(tensors):
        for name in [n for n in tensors if n.endswith(".weight_shape")]:
            module = name.removesuffix(".weight_shape")
            cols = int(tensors[name][1])
            g_idx = (torch.arange(cols) // 128).to(torch.int32)
            if module == permute:
                g_idx = g_idx[torch.randperm(cols)]
            tensors[module + ".weight_g_idx"] = g_idx

    rewrite_tensors(ckpt, edit)


def test_act_order_group_in_order_transcodes(hostile, ckpts, compiled):
    ckpt = hostile()
    _add_g_idx(ckpt)
    ours = compiled(ckpt)
    assert_same_artifact(ours, compiled(ckpts["dense"], "w4a16"))
    assert read_manifest(ours)["source"]["quantization"]["actorder"] == "group"


def test_act_order_group_out_of_order_is_refused_naming_the_column(hostile, tmp_path):
    ckpt = hostile()
    _add_g_idx(ckpt, permute=O_PROJ)
    with pytest.raises(
        CheckpointError,
        match=rf"tensor '{O_PROJ}\.weight_g_idx' puts input column \d+ in group \d, not \d: act-order 'group'.*"
        r"actorder 'weight'",
    ):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_g_idx_without_act_order_is_unexpected(hostile, tmp_path):
    ckpt = hostile()
    _add_g_idx(ckpt)
    edit_config(ckpt, lambda c: _weights(c).update(actorder=None))
    with pytest.raises(CheckpointError, match=r"unexpected tensor '.*\.weight_g_idx'"):
        compile_to(ckpt, tmp_path / "out")


def test_exporting_and_transcoding_again_gives_the_same_artifact(quantized, compiled, tmp_path):
    from qcompile.publish.export import export_compressed_tensors

    art = compiled(quantized("moe"))
    export_compressed_tensors(art, tmp_path / "exported", progress=False)
    assert_same_artifact(compile_to(tmp_path / "exported", tmp_path / "again"), art)
