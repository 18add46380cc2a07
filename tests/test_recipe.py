"""Recipes: shipped files validate, overrides apply, bad keys and values name the key and file,
and llm-compressor recipes translate with their ignore list."""

import pytest

from qcompile.errors import RecipeError
from qcompile.recipe import DEFAULT_PASSES, list_recipes, load_recipe


def test_shipped_recipes_validate():
    names = list_recipes()
    assert {"ptpc-fp8", "ptpc-fp8-lmhead", "block-fp8", "bf16"} <= set(names)
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name == name
    default = load_recipe()
    assert default.quantization.scheme == "ptpc-fp8"
    assert default.ignores("lm_head") and default.ignores("model.layers.3.mlp.gate")
    assert not default.ignores("model.layers.3.mlp.gate_proj")
    assert not load_recipe("ptpc-fp8-lmhead").ignores("lm_head")
    assert default.passes == DEFAULT_PASSES


def test_overrides():
    recipe = load_recipe(
        "ptpc-fp8",
        [
            "kv_cache.layout=hnd",
            "kv_cache.block_size=32",
            "passes=fuse_qkv_proj,fuse_gate_up_proj",
            "tp=2",
            "quantization.ignore=[lm_head]",
        ],
    )
    assert recipe.kv_cache.layout == "hnd" and recipe.kv_cache.block_size == 32
    assert recipe.passes == ("fuse_qkv_proj", "fuse_gate_up_proj") and recipe.tp == 2
    assert recipe.quantization.ignore == ("lm_head",)
    assert load_recipe("ptpc-fp8", ["passes=[]"]).passes == ()


@pytest.mark.parametrize(
    "override, message",
    [
        ("kv_cache.layuot=hnd", "unknown key 'kv_cache.layuot'"),
        ("colour=red", "unknown key 'colour'"),
        ("kv_cache.layout=zigzag", "kv_cache.layout 'zigzag' is unknown"),
        ("kv_cache.dtype=int4", "kv_cache.dtype 'int4' is unknown"),
        ("kv_cache.block_size=24", "block_size must be a power of two"),
        ("kv_cache.block_size=abc", "'kv_cache.block_size' must be an integer"),
        ("quantization.scheme=int4", "quantization.scheme 'int4' is unknown"),
        ("passes=fuse_everything", "unknown pass 'fuse_everything'"),
        ("tp=3", "'tp' must be a power of two"),
        ("tp=true", "'tp' must be an integer"),
        ("quantization.ignore=re:([", "not a valid regex"),
        ("novalue", "expected key=value"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_recipe("ptpc-fp8", [override])


def test_bad_file_names_file_and_key(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nquantization: {scheme: ptpc-fp8, ignroe: [lm_head]}\n")
    with pytest.raises(RecipeError, match=r"mine\.yaml: unknown key 'quantization\.ignroe'"):
        load_recipe(str(path))
    path.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(str(tmp_path / "absent.yaml"))
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    path.write_text("kv_cache: {layout: x-packed, dtype: fp8_e4m3, block_size: 8}\n")
    with pytest.raises(RecipeError, match="divisible by 16"):
        load_recipe(str(path))


LLMC = """
default_stage:
  default_modifiers:
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head, "re:.*mlp.gate$", "re:.*layers.0.self_attn.o_proj$"]
      scheme: FP8_DYNAMIC
"""


def test_llmcompressor_recipe_translates(tmp_path):
    path = tmp_path / "llmc.yaml"
    path.write_text(LLMC)
    recipe = load_recipe(str(path))
    assert recipe.quantization.scheme == "ptpc-fp8"
    assert recipe.ignores("model.layers.0.self_attn.o_proj")
    assert not recipe.ignores("model.layers.1.self_attn.o_proj")
    assert recipe.passes == DEFAULT_PASSES and recipe.name == "llmc"
    path.write_text(LLMC.replace("scheme: FP8_DYNAMIC", "scheme: {FP8_BLOCK: [Linear]}"))
    assert load_recipe(str(path)).quantization.scheme == "block-fp8"


@pytest.mark.parametrize(
    "text, message",
    [
        (LLMC.replace("FP8_DYNAMIC", "W4A16"), "scheme 'W4A16' is not supported"),
        (LLMC.replace("QuantizationModifier", "GPTQModifier"), "GPTQModifier is not supported"),
        (LLMC.replace("targets: [Linear]", "targets: [Embedding]"), "targets must be"),
        (LLMC + "      kv_cache_scheme: {num_bits: 8}\n", "kv_cache_scheme is not supported"),
    ],
)
def test_llmcompressor_recipe_errors(tmp_path, text, message):
    path = tmp_path / "llmc.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=message):
        load_recipe(str(path))
