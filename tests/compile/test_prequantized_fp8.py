"""Pre-quantized FP8 checkpoints (compressed-tensors float-quantized, as llm-compressor saves them) as
compiler input (issue 20): transcoded, never re-quantized.

llm-compressor quantizes fresh random checkpoints (the seed printed) with FP8_DYNAMIC (channel
weights, per-token activations), per-tensor weights with dynamic per-tensor activations, and FP8_BLOCK;
compiling what it saved must give the artifact that compiling the bf16 original with the matching
recipe gives — every weight file and graph byte for byte — with the recipe picked from config.json.
Dense, tied, MoE and odd shapes; oneshot and model_free_ptq outputs; tp=2. The artifact splits back
into exactly the tensors of the input, and generates. Hostile inputs (tensors missing, of the wrong
dtype or shape, NaN/Inf/zero/negative scales, FP8 NaN, configs that contradict their tensors or ask
for what is not supported) are errors naming the file and tensor or key, and leave no output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import qruntime
import torch
from click.testing import CliRunner
from llmc_reference import BF16, FP8, IGNORE, MODEL_FREE_IGNORE, TENSOR_FP8, assert_identical, read_tensors
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

from qcompile.cli import main
from qcompile.compile.pipeline import prepare
from qcompile.errors import CheckpointError, PlanError, RecipeError, TensorValueError
from qcompile.publish.unfuse import split_to_sources
from qcompile.quant import get_scheme
from qcompile.recipe.prequantized import default_recipe, refuse_ignore_override
from qcompile.recipe.quant_config import quantization_config
from qcompile.recipe.schema import load_recipe
from qcompile.source.checkpoint import Checkpoint
from qcompile.source.quantized import SCHEMES, read_format

SIZE128 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
PRESETS = {
    "dense": ("tiny", {}),
    "tied": ("tiny-tied", {}),
    "moe": ("tiny-moe", {}),
    "odd": ("tiny-odd", {}),
    "dense128": ("tiny", {**SIZE128, "intermediate_size": 256}),
    "moe128": ("tiny-moe", {**SIZE128, "intermediate_size": 256, "moe_intermediate_size": 128}),
    "fp16": ("tiny", {"torch_dtype": "float16", "dtype": "float16"}),  # scales in float16 too
}
LLMC = {"ptpc-fp8": "FP8_DYNAMIC", "tensor-fp8": TENSOR_FP8, "block-fp8": "FP8_BLOCK"}
CASES = [
    ("dense", "ptpc-fp8"),
    ("tied", "ptpc-fp8"),
    ("moe", "ptpc-fp8"),
    ("odd", "ptpc-fp8"),
    ("dense", "tensor-fp8"),
    ("moe", "tensor-fp8"),
    ("odd", "tensor-fp8"),
    ("dense128", "block-fp8"),
    ("moe128", "block-fp8"),
]


@pytest.fixture(scope="module")
def ckpts(make_ckpt: Callable[..., Path]) -> dict[str, Path]:
    return make_checkpoints(make_ckpt, PRESETS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prequantized-fp8")


@pytest.fixture(scope="module")
def quantized(ckpts, workdir) -> Callable[..., Path]:
    """`quantized(kind, recipe, tool="oneshot")`: llm-compressor's checkpoint of the matching scheme (cached)."""
    made: dict[tuple, Path] = {}

    def get(kind: str, recipe: str, tool: str = "oneshot") -> Path:
        key = (kind, recipe, tool)
        if key not in made:
            ignore = IGNORE if tool == "oneshot" else MODEL_FREE_IGNORE
            out = workdir / f"{tool}-{kind}-{recipe}"
            made[key] = quantize_with_llmcompressor(ckpts[kind], out, LLMC[recipe], ignore, tool)
        return made[key]

    return get


@pytest.fixture(scope="module")
def compiled(workdir) -> Callable[..., Path]:
    """`compiled(ckpt, recipe=None, *overrides)`: the artifact (cached)."""
    return cached_compiler(workdir)


# ------------------------------------------------------------------------------ byte for byte


@pytest.mark.parametrize(("kind", "recipe"), CASES)
def test_transcoded_artifact_equals_compiling_the_bf16_original(kind, recipe, ckpts, quantized, compiled):
    ckpt = quantized(kind, recipe)
    assert default_recipe(ckpt) == recipe
    stored = read_tensors(ckpt)
    assert any(t.dtype == FP8 for t in stored.values())
    if recipe == "tensor-fp8":
        assert stored["model.layers.0.self_attn.q_proj.weight_scale"].shape == (1,)
    ours = compiled(ckpt)
    assert_same_artifact(ours, compiled(ckpts[kind], recipe))
    manifest = read_manifest(ours)
    assert manifest["recipe"]["quantization"]["scheme"] == recipe
    assert manifest["source"]["quantization"] == {
        "method": "compressed-tensors",
        "format": "float-quantized",
        "scheme": recipe,
    }
    ignored = set(manifest["recipe"]["quantization"]["ignore"])
    assert ignored == ({"lm_head", "re:.*mlp.gate$"} if kind.startswith("moe") else {"lm_head"})


@pytest.mark.parametrize(
    ("kind", "recipe"),
    [("moe", "ptpc-fp8"), ("odd", "tensor-fp8"), ("dense128", "block-fp8"), ("fp16", "ptpc-fp8")],
)
def test_model_free_ptq_output_transcodes_too(kind, recipe, ckpts, quantized, compiled):
    """model_free_ptq writes its ignore list as patterns (the embedding named) and quantizes by name; it
    keeps a float16 model's dtype (oneshot here loads bf16), so its scales are float16 there."""
    ckpt = quantized(kind, recipe, "model_free")
    scale = read_tensors(ckpt)[f"{Q}.weight_scale"]
    assert scale.dtype == (torch.float16 if kind == "fp16" else BF16)
    assert_same_artifact(compiled(ckpt), compiled(ckpts[kind], recipe))


@pytest.mark.parametrize(
    ("kind", "recipe"), [("dense", "ptpc-fp8"), ("moe", "tensor-fp8"), ("tied", "ptpc-fp8"), ("moe128", "block-fp8")]
)
def test_the_artifact_splits_back_into_the_input_tensors(kind, recipe, quantized, compiled):
    """split_to_sources (what `qcompile export` writes) gives back every tensor of the input, bytes
    and all: the FP8 weights, their scales (per-tensor ones as [1]) and what stayed bf16."""
    ckpt = quantized(kind, recipe)
    out: dict[str, torch.Tensor] = {}
    for name, weight, scale in split_to_sources(compiled(ckpt)):
        out[name] = weight
        if scale is not None:
            out[name + "_scale"] = scale
    assert_identical(out, read_tensors(ckpt))


@pytest.mark.parametrize(
    ("tool", "ignore"),
    [("model_free", ["lm_head", "model.embed_tokens"]), ("oneshot", ["lm_head", "re:.*k_proj$", "re:.*mlp.gate$"])],
    ids=["routers-quantized", "k-proj-kept"],
)
def test_other_ignore_lists_transcode_as_compiled_with_them(tool, ignore, ckpts, workdir, compiled):
    """Routers stored quantized (model_free_ptq told only of lm_head and the embedding), or k_proj
    kept bf16: the fusion that cannot take it is refused naming itself (as for a bf16 checkpoint with
    that ignore list), and unfused the artifact equals compiling bf16 with that ignore list."""
    ckpt = quantize_with_llmcompressor(ckpts["moe"], workdir / f"ignore-{tool}", "FP8_DYNAMIC", ignore, tool)
    stored = read_tensors(ckpt)
    router, k_proj = "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.k_proj.weight"
    assert (stored[router].dtype == FP8) == (tool == "model_free")
    assert (stored[k_proj].dtype == BF16) == (tool == "oneshot")
    fusion = "fuse_moe_experts" if tool == "model_free" else "fuse_qkv_proj"
    with pytest.raises(PlanError, match=rf"pass '{fusion}': layer 0: .*[Rr]emove '{fusion}'.*is pre-quantized"):
        prepare(ckpt, load_recipe("ptpc-fp8"))
    kept = [i for i in ignore if i != "model.embed_tokens"]
    listed = "quantization.ignore=[" + ", ".join(f"'{i}'" for i in kept) + "]"
    ours = compiled(ckpt, None, "passes=[]")
    assert_same_artifact(ours, compiled(ckpts["moe"], "ptpc-fp8", listed, "passes=[]"))


def test_tp2_transcoded_equals_tp2_compiled(ckpts, quantized, compiled):
    assert_same_artifact(
        compiled(quantized("moe", "ptpc-fp8"), None, "tp=2"), compiled(ckpts["moe"], "ptpc-fp8", "tp=2")
    )


@pytest.mark.parametrize(("kind", "recipe"), [("dense", "ptpc-fp8"), ("moe", "tensor-fp8")])
def test_transcoded_artifact_generates(kind, recipe, ckpts, quantized, compiled):
    """qruntime loads it on the CPU and generates the tokens of the artifact compiled from bf16."""
    params = qruntime.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True
    )  # random weights: EOS may come early
    prompt = [3, 17, 42, 5]
    tokens = [
        qruntime.load(art, device="cpu").generate(prompt, params)[0].token_ids
        for art in (compiled(quantized(kind, recipe)), compiled(ckpts[kind], recipe))
    ]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]


def test_every_scheme_round_trips_through_its_config():
    """The quantization_config we write for a scheme is read back as that scheme (one table each way)."""
    for scheme in SCHEMES:
        config = {"quantization_config": quantization_config(get_scheme(scheme), load_recipe(scheme))}
        assert read_format(config).scheme == scheme
    assert read_format({}) is None


# ------------------------------------------------------------------------------- recipes


def test_a_recipe_of_another_scheme_is_refused_naming_both(quantized, tmp_path):
    ckpt = quantized("dense", "ptpc-fp8")
    with pytest.raises(RecipeError, match=r"recipe 'w4a16' quantizes with scheme 'w4a16'.*which is scheme 'ptpc-fp8'"):
        compile_to(ckpt, tmp_path / "out", "w4a16")
    with pytest.raises(RecipeError, match=r"recipe 'ptpc-fp8-kv8' calibrates an fp8 KV cache"):
        compile_to(ckpt, tmp_path / "out", "ptpc-fp8-kv8")
    with pytest.raises(RecipeError, match=r"--set quantization\.ignore: .* is pre-quantized"):
        refuse_ignore_override(["quantization.ignore=[]"], ckpt)
    refuse_ignore_override(["kv_cache.layout=hnd"], ckpt)
    assert not (tmp_path / "out").exists()


def test_an_explicit_recipe_of_the_same_scheme_keeps_the_checkpoints_ignore_list(ckpts, quantized, compiled):
    """`-r ptpc-fp8-lmhead` is of scheme ptpc-fp8: allowed, but lm_head stays as the checkpoint stores it (bf16)."""
    ckpt = quantized("dense", "ptpc-fp8")
    ours = compiled(ckpt, "ptpc-fp8-lmhead")
    assert read_manifest(ours)["recipe"]["quantization"]["ignore"] == ["lm_head"]
    assert_same_artifact(ours, compiled(ckpts["dense"], "ptpc-fp8-lmhead", "quantization.ignore=[lm_head]"))


# ------------------------------------------------------------------------------ hostile inputs


@pytest.fixture
def hostile(quantized, tmp_path) -> Callable[..., Path]:
    """`hostile(kind="dense", recipe="ptpc-fp8")`: a copy of llm-compressor's checkpoint to break."""
    return lambda kind="dense", recipe="ptpc-fp8": copy_checkpoint(quantized(kind, recipe), tmp_path / "ckpt")


Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(f"{Q}.weight_scale"), rf"tensor '{Q}\.weight_scale' is missing from the checkpoint"),
        (lambda t: t.pop(f"{Q}.weight"), rf"tensor '{Q}\.weight' is missing from the checkpoint"),
        (
            lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].float()}),
            rf"model\.safetensors: tensor '{Q}\.weight_scale' is F32; compressed-tensors float-quantized stores it as BF16",
        ),
        (
            lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].reshape(-1)}),
            rf"model\.safetensors: tensor '{Q}\.weight_scale' has shape \[64\]; compressed-tensors float-quantized stores it as \[64, 1\]",
        ),
        (
            lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].to(BF16)}),
            rf"model\.safetensors: tensor '{Q}\.weight' is BF16; compressed-tensors float-quantized stores it as F8_E4M3",
        ),
        (
            lambda t: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"][:, :-1].contiguous()}),
            rf"tensor '{DOWN}\.weight' holds a linear of shape \[64, 127\], config\.json implies \[64, 128\]",
        ),
        (
            lambda t: t.update(
                {f"{DOWN}.weight_scale": torch.rand(64, 1).to(BF16), f"{DOWN}.weight": t[f"{DOWN}.weight"].to(BF16)}
            ),
            rf"tensor '{DOWN}\.weight' is BF16; compressed-tensors float-quantized stores it as F8_E4M3",
        ),
        (
            lambda t: t.update({"model.embed_tokens.weight_scale": torch.ones(544, 1, dtype=BF16)}),
            r"stores 'model\.embed_tokens' quantized, but that is the embedding",
        ),
        (
            lambda t: t.update({"model.layers.0.input_layernorm.weight_scale": torch.ones(1, dtype=BF16)}),
            r"tensor 'model\.layers\.0\.input_layernorm\.weight' is BF16; compressed-tensors float-quantized stores it as F8_E4M3",
        ),
        (
            lambda t: t.update({f"{Q}.input_scale": torch.ones(1, dtype=BF16)}),
            rf"unexpected tensor '{Q}\.input_scale'",
        ),
    ],
    ids=[
        "no-scale",
        "no-weight",
        "scale-dtype",
        "scale-shape",
        "weight-dtype",
        "weight-shape",
        "bf16-weight",
        "embed",
        "norm",
        "input-scale",
    ],
)
def test_broken_tensors_are_refused_before_any_work(edit, message, hostile, tmp_path):
    ckpt = hostile()
    rewrite_tensors(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unquantized_linear_not_in_the_ignore_list_is_refused(hostile, tmp_path, ckpts):
    """A bf16 checkpoint with a quantization_config pasted in claims tensors it does not hold."""
    ckpt = hostile()
    bf16 = read_tensors(ckpts["dense"])
    rewrite_tensors(ckpt, lambda t: (t.clear(), t.update(bf16)))
    with pytest.raises(
        CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' is BF16 with no .*weight_scale"
    ):
        Checkpoint.open(ckpt)


@pytest.mark.parametrize(
    ("value", "recipe"),
    [
        (float("nan"), "ptpc-fp8"),
        (float("inf"), "ptpc-fp8"),
        (0.0, "ptpc-fp8"),
        (-0.5, "tensor-fp8"),
        (float("nan"), "block-fp8"),
    ],
)
def test_bad_scales_are_refused_naming_the_tensor_and_leave_no_output(value, recipe, hostile, tmp_path):
    kind = "dense128" if recipe == "block-fp8" else "dense"
    ckpt = hostile(kind, recipe)
    name = f"{DOWN}.weight_scale"

    def edit(tensors):
        scale = tensors[name].clone()
        scale.view(-1)[-1] = value
        tensors[name] = scale

    rewrite_tensors(ckpt, edit)
    with pytest.raises(TensorValueError, match=rf"model\.safetensors: tensor '{name}' holds {value}.*finite positive"):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_fp8_nan_is_refused(hostile, tmp_path):
    ckpt = hostile()
    name = f"{Q}.weight"

    def edit(tensors):
        weight = tensors[name].clone()
        weight.view(torch.uint8)[5, 7] = 0xFF
        tensors[name] = weight

    rewrite_tensors(ckpt, edit)
    with pytest.raises(TensorValueError, match=rf"tensor '{name}' holds an FP8 NaN at index \[5, 7\]"):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _group(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: _group(c)["input_activations"].update(dynamic=False),
            r"static activation scales, input_scale, are not supported",
        ),
        (lambda c: _group(c)["weights"].update(strategy="group", group_size=32), r"match no qcompile scheme"),
        (lambda c: c["quantization_config"].update(quant_method="gptq"), r"quant_method 'gptq' is not supported"),
        (lambda c: c["quantization_config"].update(quantization_status="frozen"), r"only 'compressed' checkpoints"),
        (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme is set"),
        (lambda c: _group(c).update(targets=["re:.*q_proj"]), r"targets must be \['Linear'\]"),
        (lambda c: _group(c).update(format="pack-quantized"), r"format is 'pack-quantized'.*'float-quantized'"),
        (
            lambda c: c["quantization_config"]["config_groups"].update(group_1=_group(c)),
            r"config_groups must hold exactly one scheme .* got 2",
        ),
        (
            lambda c: c["quantization_config"].update(ignore=["lm_head", "re:.*q_proj$"]),
            r"q_proj is stored quantized .* lists it in 'ignore'",
        ),
    ],
    ids=["static-acts", "group-fp8", "gptq", "frozen", "kv-cache", "targets", "format", "two-groups", "ignore"],
)
def test_configs_we_cannot_honour_are_refused_naming_the_key(edit, message, hostile, tmp_path):
    ckpt = hostile()
    edit_config(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out", "ptpc-fp8")
    assert not (tmp_path / "out").exists()


def test_a_job_of_another_scheme_on_a_stored_weight_is_a_plan_error(quantized):
    """The plan's own check, below the recipe's: a stored weight is copied by a job of its scheme only."""
    from qcompile.compile.jobs import WeightJob
    from qcompile.compile.plan import make_plan

    checkpoint = Checkpoint.open(quantized("dense", "ptpc-fp8"))
    job = WeightJob(Q, ((f"{Q}.weight",),), stacked=False, scheme="none", role="linear")
    with pytest.raises(PlanError, match=rf"weight '{Q}\.weight' is to be 'none', but the checkpoint stores .* copied"):
        make_plan(checkpoint, {Q: job}, 1 << 30)


def test_stored_bytes_are_copied_not_requantized(hostile, tmp_path):
    """A row whose codes are all 1.0 (well inside the FP8 range, as no quantizer would leave them)
    keeps them and its scale: quantizing the dequantized row again would make them 448."""
    ckpt = hostile()
    name = f"{Q}.weight"

    def edit(tensors):
        weight = tensors[name].clone()
        weight[3] = 1.0
        tensors[name] = weight

    rewrite_tensors(ckpt, edit)
    stored = read_tensors(ckpt)
    out = {n: (w, s) for n, w, s in split_to_sources(compile_to(ckpt, tmp_path / "out"))}
    weight, scale = out[name]
    assert bool((weight[3].float() == 1.0).all())
    assert torch.equal(weight.view(torch.uint8), stored[name].view(torch.uint8))
    assert torch.equal(scale, stored[f"{Q}.weight_scale"])


def test_the_cli_says_the_input_is_pre_quantized_and_refuses_another_scheme(quantized, tmp_path):
    ckpt = quantized("moe", "tensor-fp8")
    result = CliRunner().invoke(main, ["compile", str(ckpt), "-o", str(tmp_path / "art"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert (
        "input       pre-quantized, compressed-tensors float-quantized: FP8 weights, one scale per tensor"
        in result.output
    )
    assert "recipe      tensor-fp8\n" in result.output
    assert "(as the checkpoint stores them)" in result.output
    result = CliRunner().invoke(main, ["compile", str(ckpt), "-o", str(tmp_path / "art"), "-r", "block-fp8"])
    assert result.exit_code == 1
    assert "recipe 'block-fp8' quantizes with scheme 'block-fp8'" in result.output
    assert "which is scheme 'tensor-fp8'" in result.output
    result = CliRunner().invoke(main, ["compile", "--help"])
    assert "pre-quantized checkpoint" in result.output
    assert not (tmp_path / "art").exists()


def test_inspect_says_a_checkpoint_or_its_artifact_is_pre_quantized(ckpts, quantized, compiled, hostile):
    ckpt = quantized("moe", "ptpc-fp8")
    result = CliRunner().invoke(main, ["inspect", str(ckpt)])
    assert result.exit_code == 0, result.output
    assert (
        "weights      pre-quantized, compressed-tensors float-quantized: FP8 weights, one scale per output"
        in result.output
    )
    assert "compiles as  recipe ptpc-fp8 (its stored weights copied, not re-quantized)" in result.output
    info = json.loads(CliRunner().invoke(main, ["inspect", str(ckpt), "--json"]).output)
    assert info["quantization"]["scheme"] == "ptpc-fp8" and info["recipe"] == "ptpc-fp8"
    assert info["quantization"]["quantized_linears"] == 3 * 4 + 2 * 8 * 3 + 3  # attention, experts, dense MLP
    assert info["quantization"]["unquantized_linears"] == [
        "lm_head",
        "model.layers.0.mlp.gate",
        "model.layers.2.mlp.gate",
    ]
    plain = CliRunner().invoke(main, ["inspect", str(ckpts["moe"])]).output
    assert "weights      not quantized" in plain and "compiles as  recipe ptpc-fp8\n" in plain
    artifact = CliRunner().invoke(main, ["inspect", str(compiled(ckpt))]).output
    assert "pre-quantized: compressed-tensors float-quantized, transcoded" in artifact
    broken = hostile()
    rewrite_tensors(broken, lambda t: t.pop(f"{Q}.weight_scale"))
    result = CliRunner().invoke(main, ["inspect", str(broken)])
    assert result.exit_code == 1 and f"tensor '{Q}.weight_scale' is missing" in result.output


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        (5, r"quantization_config must be an object, got 5"),
        ({"quant_method": ["x"]}, r"quant_method \['x'\] is not supported"),
        ({"quant_method": "compressed-tensors", "config_groups": []}, r"config_groups must hold exactly one"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": "x"}}},
            r"'weights' must be an object",
        ),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": 7}}, r"config_groups\.'g' must be an object"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": [1]}, r"must be a list"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["x" * 2000]},
            r"characters; a pattern may be at most",
        ),
    ],
    ids=["number", "method-list", "groups-list", "weights-str", "group-int", "keep-int", "keep-huge"],
)
def test_junk_quantization_configs_are_errors_naming_the_key(qc, message, hostile, tmp_path):
    ckpt = hostile()
    edit_config(ckpt, lambda c: c.update(quantization_config=qc))
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_weights_and_scales_in_different_shards(quantized, compiled, tmp_path):
    """Real checkpoints are sharded by size, so a weight and its scale may sit in different files (the
    index says where): the artifact is the one-shard checkpoint's."""
    from safetensors.torch import save_file

    one = quantized("moe", "ptpc-fp8")
    sharded = copy_checkpoint(one, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    tensors = read_tensors(one)
    names = sorted(tensors)
    files = {name: f"model-{i % 3 + 1:05d}-of-00003.safetensors" for i, name in enumerate(names)}
    assert files[f"{Q}.weight"] != files[f"{Q}.weight_scale"]
    for file in sorted(set(files.values())):
        save_file({n: tensors[n] for n in names if files[n] == file}, sharded / file, metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    assert_same_artifact(compile_to(sharded, tmp_path / "art"), compiled(one))


def test_a_quantized_checkpoint_without_its_config_says_what_is_missing(hostile, tmp_path):
    ckpt = hostile()
    edit_config(ckpt, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"it looks quantized, but config\.json has no quantization_config"):
        compile_to(ckpt, tmp_path / "out", "ptpc-fp8")


@pytest.mark.parametrize(("kind", "recipe"), [("dense", "ptpc-fp8"), ("moe", "tensor-fp8"), ("moe128", "block-fp8")])
def test_exporting_and_transcoding_again_gives_the_same_artifact(kind, recipe, quantized, compiled, tmp_path):
    """compile(export(compile(X))) == compile(X): the exported compressed-tensors checkpoint is read back
    as the format it was written in, and nothing is lost or re-quantized on the way."""
    from qcompile.publish.export import export_compressed_tensors

    art = compiled(quantized(kind, recipe))
    export_compressed_tensors(art, tmp_path / "exported", progress=False)
    assert default_recipe(tmp_path / "exported") == recipe
    assert_same_artifact(compile_to(tmp_path / "exported", tmp_path / "again"), art)
