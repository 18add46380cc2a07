"""Recipes: shipped files validate, overrides apply, bad keys and values name the key and file,
and llm-compressor recipes translate with their ignore list; `re:` patterns keep `re.match`'s meaning, with
bounded work to compile and match them."""

import random
import re
import time
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from qcompile.errors import RecipeError
from qcompile.recipe.ignore_list import IgnoreList
from qcompile.recipe.schema import DEFAULT_PASSES, list_recipes, load_recipe


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
    path.write_text(LLMC.replace("scheme: FP8_DYNAMIC", "scheme: W4A16"))  # its RTN is ours byte for byte
    assert load_recipe(str(path)).quantization.scheme == "w4a16"


@pytest.mark.parametrize(
    "text, message",
    [
        (LLMC.replace("FP8_DYNAMIC", "W8A8"), "scheme 'W8A8' is not supported"),
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


# ---------------------------------------------------------------- 're:' patterns: re's meaning, bounded work


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(1 << 32)
    print(f"pattern seed: {seed}")
    return random.Random(seed)


LLMC_STYLE = [  # patterns as llm-compressor recipes and model cards write them
    r"re:.*mlp.gate$",
    r"re:.*layers.0.self_attn.o_proj$",
    r"re:.*self_attn.*",
    r"re:.*mlp\.experts\.\d+\.(gate|up)_proj$",
    r"re:model\.layers\.[01]\.",
    r"re:.*\.(q|k|v)_proj",
    r"re:.*down_proj",
    r"re:lm_head",
    r"re:.*layers\.(1|2)\..*",
    r"re:(?i).*MLP.GATE$",
    r"re:.*(?<!shared_expert)\.gate_proj$",
    r"re:^model\.layers\.\d+\.mlp\.gate$",
    r"re:.*proj\b",
    r"re:\w+\.layers\.\d{1,2}\.mlp\.(?:gate|up|down)_proj$",
]


def _names(*ckpts: Path) -> list[str]:
    """Every tensor name of the checkpoints and every module name above them."""
    names: set[str] = set()
    for ckpt in ckpts:
        with safe_open(ckpt / "model.safetensors", "pt") as f:
            tensors = f.keys()  # safe_open is not a mapping
        for tensor in tensors:
            parts = tensor.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names)


def _sane_pattern(rng: random.Random, names: list[str]) -> str:
    """A pattern of the kind people write: a name with pieces made general."""
    parts = rng.choice(names).split(".")
    pieces = [
        rng.choice(
            [
                re.escape(part),
                part,
                r"\d+" if part.isdigit() else r"\w+",
                "[^.]+",
                ".*",
                f"({part}|{rng.choice(parts)})",
                part[: rng.randrange(len(part) + 1)] + ".*",
            ]
        )
        for part in parts[rng.randrange(len(parts)) :]
    ]
    head = rng.choice(["", ".*", r"model\.", "^"])
    return "re:" + head + rng.choice([r"\.", "."]).join(pieces) + rng.choice(["", "$", r"\b", ".*"])


def test_ignore_patterns_select_what_re_selects(rng, tiny_ckpt, tiny_moe_ckpt):
    """The patterns match through `regex` (for its timeout) exactly what Python's `re.match` selects, the
    meaning llm-compressor and compressed-tensors give them: on every tensor and module name of the tiny
    checkpoints, for the shipped recipes' patterns, llm-compressor-style ones and fresh random ones."""
    names = _names(tiny_ckpt, tiny_moe_ckpt)
    shipped = {p for name in list_recipes() for p in load_recipe(name).quantization.ignore if p.startswith("re:")}
    assert shipped  # the router pattern at least
    patterns = sorted(shipped) + LLMC_STYLE + [_sane_pattern(rng, names) for _ in range(300)]
    selected = 0
    for pattern in patterns:
        compiled = IgnoreList((pattern,))
        ours = [n for n in names if compiled.matches(n)]
        assert ours == [n for n in names if re.match(pattern[3:], n)], pattern
        selected += bool(ours)
    assert selected > len(patterns) // 2  # the comparison is not vacuous
    for name in list_recipes():  # and Recipe.ignores as the ignore list was read before: any entry equal or re.match
        recipe = load_recipe(name)
        ignore = recipe.quantization.ignore
        expected = [n for n in names if any(n == p or p.startswith("re:") and re.match(p[3:], n) for p in ignore)]
        assert [n for n in names if recipe.ignores(n)] == expected, name


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("re:([", r"'re:\(\[' is not a valid regex \("),
        ("re:(?<n>a)", "is not a valid regex"),  # `regex` would accept it; the readers of the export would not
        (r"re:\p{L}", "is not a valid regex"),
        ("re:.*gate{e<=1}$", r"'\{' at position 6 is not a repeat count \{m,n\} \(the regex package reads fuzzy"),
        ("re:(?x)gate {1, 2}", r"'\{' at position 9 is not a repeat count"),
        ("re:[[:digit:]]+", r"'\[' inside a set at position 1 .*POSIX class"),
        (r"re:[^a\w\W]", r"excludes both \\w and \\W"),
        ("re:" + "a" * 1025, r"1,025 characters; a pattern may be at most 1,024"),
        ("re:" + "(" * 33 + ")" * 33, "groups nested more than 32 deep"),
        ("re:(?:a{400}){300}", "unroll to 120,000 items, over 100,000"),
        ("re:(?:a{2,400}){1,300}", "unroll to 120,000 items"),  # the larger count, where it is finite
    ],
)
def test_bad_ignore_pattern_names_file_key_and_pattern(pattern, message, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"quantization": {"ignore": ["lm_head", pattern]}}))
    with pytest.raises(RecipeError, match=rf"mine\.yaml: quantization\.ignore entry .*{message}"):
        load_recipe(str(path))


def test_ignore_pattern_bounds_admit_what_people_write():
    IgnoreList(tuple(f"re:model\\.layers\\.{i}\\.mlp" for i in range(256)))  # one per layer of a big model
    IgnoreList(("re:" + "(?:a|b)" * 146,))  # 1,022 characters
    IgnoreList(("re:" + "(" * 32 + ")" * 32, r"re:[\w.]{0,200}\d{1,3}$", "re:(?:a{100}){100}"))
    with pytest.raises(RecipeError, match=r"quantization\.ignore holds 257 're:' patterns; the limit is 256"):
        IgnoreList(tuple(f"re:model\\.layers\\.{i}\\.mlp" for i in range(257)))


def test_ignore_match_time_is_bounded_per_name_and_in_all():
    slow = IgnoreList(("lm_head", r"re:(.|.)*\d$"))
    assert slow.matches("lm_head")  # the first entry decides, as `any` did: the pattern is not tried
    start = time.perf_counter()
    with pytest.raises(RecipeError, match=r"entry 're:\(\.\|\.\)\*\\\\d\$' took more than 0\.05 s to match 'model"):
        slow.matches("model.layers.0.self_attn.q_proj")
    assert time.perf_counter() - start < 1.0
    spent = IgnoreList(("lm_head", "re:.*mlp.gate$"), budget_seconds=1e-3)
    with pytest.raises(
        RecipeError, match=r"quantization\.ignore: matching its patterns .* took more than 0\.001 s in all"
    ):
        for layer in range(1_000_000):
            spent.matches(f"model.layers.{layer}.mlp.gate_proj")
    assert spent.matches("lm_head")  # exact names cost no matching time
