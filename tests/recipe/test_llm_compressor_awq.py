"""llm-compressor recipes with an AWQModifier translate to `w4a16-awq` (issue 20): the AWQModifier
beside a W4A16 QuantizationModifier, or quantizing itself (llm-compressor's older form), the scheme a
preset's name or config_groups spelling it out, AWQModifier's default mappings spelled out; whatever
the search cannot honour is refused naming the file, the modifier and the field."""

from __future__ import annotations

import dataclasses
import random

import pytest

from qcompile.compile.pipeline import prepare
from qcompile.errors import QCompileError
from qcompile.recipe.llm_compressor_awq import DEFAULT_MAPPINGS
from qcompile.recipe.schema import RecipeError, load_recipe

W4A16_GROUP = """\
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
"""
SCHEMES = {  # the same W4A16 scheme, written each way a recipe does
    "preset": "      scheme: W4A16\n",
    "preset-targets": "      scheme: {W4A16: [Linear]}\n",
    "config_groups": W4A16_GROUP,
}
IGNORE = '      targets: [Linear]\n      ignore: [lm_head, "re:.*mlp.gate$"]\n'


def two_modifiers(scheme: str = SCHEMES["preset"], awq: str = "    AWQModifier: {duo_scaling: true}\n") -> str:
    """An AWQModifier, then the QuantizationModifier that rounds what it smoothed (llm-compressor 0.14)."""
    return f"default_stage:\n  default_modifiers:\n{awq}    QuantizationModifier:\n{IGNORE}{scheme}"


def one_modifier(scheme: str = SCHEMES["preset"], extra: str = "") -> str:
    """An AWQModifier that quantizes itself (recipes written before AWQModifier became a transform)."""
    return f"quant_stage:\n  quant_modifiers:\n    AWQModifier:\n{IGNORE}{scheme}{extra}"


def mappings_yaml(name: str, mappings: list[dict] | None = None) -> str:
    """An AWQModifier's `mappings`: DEFAULT_MAPPINGS[name], or the given ones."""
    lines = ["      mappings:"]
    for m in DEFAULT_MAPPINGS[name] if mappings is None else mappings:
        balance = ", ".join(f'"{b}"' for b in m["balance_layers"])
        lines.append(f'        - smooth_layer: "{m["smooth_layer"]}"\n          balance_layers: [{balance}]')
    return "\n".join(lines) + "\n"


def router_last() -> list[dict]:
    """Qwen3-MoE's default mappings with the router after the experts: the same modules, not the default."""
    mappings = [dict(m) for m in DEFAULT_MAPPINGS["qwen3-moe"]]
    router, *experts = mappings[2]["balance_layers"]
    mappings[2]["balance_layers"] = [*experts, router]
    return mappings


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return random.Random(seed)


def _load(tmp_path, text: str):
    path = tmp_path / "llmc-awq.yaml"
    path.write_text(text)
    return load_recipe(str(path))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("form", ["two", "one"])
def test_awq_recipes_translate_to_w4a16_awq(tmp_path, scheme, form):
    text = two_modifiers(SCHEMES[scheme]) if form == "two" else one_modifier(SCHEMES[scheme])
    recipe = _load(tmp_path, text)
    ours = load_recipe("w4a16-awq")
    assert recipe.name == "llmc-awq" and "AWQModifier" in recipe.description
    assert dataclasses.replace(recipe, name=ours.name, description=ours.description) == ours
    assert recipe.needs_calib


def test_options_that_change_nothing_are_accepted(tmp_path, rng):
    """AWQModifier's defaults spelled out, in any order, and offload_device (placement only)."""
    options = ["duo_scaling: true", "n_grid: 20", f"offload_device: {rng.choice(['cpu', 'null', 'cuda:0'])}"]
    rng.shuffle(options)
    awq = "    AWQModifier: {" + ", ".join(options[: rng.randint(0, 3)]) + "}\n"
    print(awq)
    assert _load(tmp_path, two_modifiers(awq=awq)).quantization.method == "awq"
    assert _load(tmp_path, two_modifiers(awq="    AWQModifier:\n")).quantization.method == "awq"
    spelled_out = """\
      config_groups:
        any_name:
          targets: Linear
          weights: {num_bits: 4, type: int, symmetric: true, group_size: 128, dynamic: false, actorder: null,
                    observer: memoryless_minmax, observer_kwargs: {}}
          input_activations: null
          format: pack-quantized
"""
    assert _load(tmp_path, one_modifier(spelled_out)).quantization.scheme == "w4a16"
    plain = _load(tmp_path, "s:\n  m:\n    QuantizationModifier:\n" + W4A16_GROUP)  # no AWQ: w4a16's RTN
    assert plain.quantization == load_recipe("w4a16").quantization.__class__(scheme="w4a16", ignore=())


@pytest.mark.parametrize("name", DEFAULT_MAPPINGS)
def test_default_mappings_spelled_out_are_accepted_and_recorded(tmp_path, name):
    awq = "    AWQModifier:\n" + mappings_yaml(name)
    recipe = _load(tmp_path, two_modifiers(awq=awq))
    assert recipe.quantization.awq_mappings == name
    assert recipe.to_dict()["quantization"]["awq_mappings"] == name
    hooked = mappings_yaml(name).replace("balance_layers:", "activation_hook_target: null\n          balance_layers:")
    assert _load(tmp_path, one_modifier(extra=hooked)).quantization.awq_mappings == name
    assert "awq_mappings" not in load_recipe("w4a16-awq").to_dict()["quantization"]


def test_default_mappings_are_llmcompressors():
    registry = pytest.importorskip("llmcompressor.modifiers.transform.awq.mappings").AWQ_MAPPING_REGISTRY
    for name, arch in (("qwen3", "Qwen3ForCausalLM"), ("qwen3-moe", "Qwen3MoeForCausalLM")):
        theirs = [{k: v for k, v in dataclasses.asdict(m).items() if v is not None} for m in registry[arch]]
        assert theirs == list(DEFAULT_MAPPINGS[name]), arch


AWQ_PATH = "default_stage.default_modifiers.AWQModifier"
QUANT_PATH = "default_stage.default_modifiers.QuantizationModifier"
OWN_PATH = "quant_stage.quant_modifiers.AWQModifier"
GROUP_PATH = f"{OWN_PATH}.config_groups.group_0"
REFUSED = {
    "duo false": (two_modifiers(awq="    AWQModifier: {duo_scaling: false}\n"), f"{AWQ_PATH}.duo_scaling False"),
    "duo both": (two_modifiers(awq="    AWQModifier: {duo_scaling: both}\n"), f"{AWQ_PATH}.duo_scaling 'both'"),
    "n_grid": (two_modifiers(awq="    AWQModifier: {n_grid: 10}\n"), f"{AWQ_PATH}.n_grid 10"),
    "mappings": (
        two_modifiers(awq="    AWQModifier:\n" + mappings_yaml("qwen3").replace('"re:.*k_proj$", ', "")),
        f"{AWQ_PATH}.mappings .* are not supported",
    ),
    "mappings renamed": (one_modifier(extra=mappings_yaml("qwen3").replace("input_", "")), f"{OWN_PATH}.mappings"),
    "mappings other order": (one_modifier(extra=mappings_yaml("", router_last())), f"{OWN_PATH}.mappings"),
    "asymmetric preset": (
        two_modifiers("      scheme: W4A16_ASYM\n"),
        f"{QUANT_PATH}.scheme '?W4A16_ASYM'? is not supported",
    ),
    "fp8 preset": (two_modifiers("      scheme: FP8_DYNAMIC\n"), f"{QUANT_PATH}.scheme FP8_DYNAMIC .*W4A16 only"),
    "asymmetric group": (
        one_modifier(W4A16_GROUP.replace("symmetric: true", "symmetric: false")),
        f"{GROUP_PATH}.weights.symmetric False",
    ),
    "group 64": (one_modifier(W4A16_GROUP.replace("128", "64")), f"{GROUP_PATH}.weights.group_size 64"),
    "8 bits": (one_modifier(W4A16_GROUP.replace("num_bits: 4", "num_bits: 8")), f"{GROUP_PATH}.weights.num_bits 8"),
    "channel": (
        one_modifier(W4A16_GROUP.replace("strategy: group", "strategy: channel")),
        f"{GROUP_PATH}.weights.strategy 'channel'",
    ),
    "mse observer": (
        one_modifier(W4A16_GROUP.replace("group_size: 128", "group_size: 128, observer: mse")),
        f"{GROUP_PATH}.weights.observer 'mse'",
    ),
    "activations": (
        one_modifier(W4A16_GROUP + "          input_activations: {num_bits: 8, type: float, dynamic: true}\n"),
        f"{GROUP_PATH}.input_activations is not supported: activation quantization",
    ),
    "two groups": (
        one_modifier(W4A16_GROUP + W4A16_GROUP.split("\n", 1)[1].replace("group_0", "group_1")),
        f"{OWN_PATH}.config_groups must hold exactly one group",
    ),
    "scheme and groups": (one_modifier(SCHEMES["preset"] + W4A16_GROUP), f"{OWN_PATH}: give scheme or config_groups"),
    "kv cache": (one_modifier(extra="      kv_cache_scheme: {num_bits: 8}\n"), f"{OWN_PATH}.kv_cache_scheme is not"),
    "start": (two_modifiers(awq="    AWQModifier: {start: 0}\n"), f"{AWQ_PATH}.start is not supported"),
    "targets": (two_modifiers().replace("targets: [Linear]", "targets: [Embedding]"), f"{QUANT_PATH}.targets must be"),
    "no scheme": (
        "s:\n  m:\n    AWQModifier: {duo_scaling: true}\n",
        "s.m.AWQModifier smooths the weights for a QuantizationModifier .* found 0",
    ),
    "quantization first": (
        "s:\n  m:\n    QuantizationModifier: {scheme: W4A16}\n    AWQModifier: {}\n",
        "s.m.QuantizationModifier comes before s.m.AWQModifier",
    ),
    "scheme twice": (
        "s:\n  m:\n    AWQModifier: {scheme: W4A16}\n    QuantizationModifier: {scheme: W4A16}\n",
        "s.m.AWQModifier.scheme and s.m.QuantizationModifier both say how to quantize",
    ),
    "two awq": (
        "a:\n  m:\n    AWQModifier: {scheme: W4A16}\nb:\n  m:\n    AWQModifier: {scheme: W4A16}\n",
        r"found 2 AWQModifiers \(a.m.AWQModifier, b.m.AWQModifier\)",
    ),
    "gptq beside": (two_modifiers() + "    GPTQModifier: {}\n", "GPTQModifier is not supported"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_search_cannot_honour_is_refused_naming_file_modifier_and_field(tmp_path, case):
    text, message = REFUSED[case]
    with pytest.raises(RecipeError, match=message) as info:
        _load(tmp_path, text)
    assert str(info.value).startswith(str(tmp_path / "llmc-awq.yaml"))


@pytest.mark.parametrize("given, preset", [("qwen3", "tiny-moe"), ("qwen3-moe", "tiny")])
def test_mappings_of_the_other_architecture_are_refused_before_any_search(make_ckpt, tmp_path, given, preset):
    ckpt = make_ckpt(preset)
    recipe = _load(tmp_path, two_modifiers(awq="    AWQModifier:\n" + mappings_yaml(given)))
    with pytest.raises(QCompileError, match=f"quantization.awq_mappings {given} .* leave `mappings` out"):
        prepare(ckpt, recipe, tmp_path / "no-calib-read.txt", progress=False)
    with pytest.raises(RecipeError, match="awq_mappings needs quantization.method awq"):
        load_recipe("w4a16", [f"quantization.awq_mappings={given}"])
