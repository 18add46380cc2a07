"""An llm-compressor AWQModifier's own arguments, translated onto `w4a16-awq`'s search.

AWQModifier (llmcompressor.modifiers.transform.awq) only smooths; the QuantizationModifier beside it
(or, in recipes written for llm-compressor before AWQModifier became a transform, its own `scheme` /
`config_groups` / `targets` / `ignore`) quantizes. Its arguments and what we make of them:

    mappings        AWQModifier's default for Qwen3 or Qwen3-MoE, spelled out: accepted, recorded as
                    quantization.awq_mappings (checked against the checkpoint's architecture at
                    compile time); any other list is refused
    duo_scaling     true (its default): our grid; false and "both" are refused
    n_grid          20 (its default): our grid; other values are refused
    offload_device  where AWQModifier keeps its cached activations: no bearing on the result (the
                    search streams one layer at a time), accepted whatever it says
"""

from __future__ import annotations

from typing import Any

from qruntime.shown import shown

from qcompile.errors import RecipeError

# AWQModifier's default mappings (llm-compressor's AWQ_MAPPING_REGISTRY) for the architectures we
# compile, as a recipe writes them; tests/recipe checks them against the installed llm-compressor
_ATTENTION = (
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
    {"smooth_layer": "re:.*v_proj$", "balance_layers": ["re:.*o_proj$"]},
)
_UP_DOWN = ({"smooth_layer": "re:.*up_proj$", "balance_layers": ["re:.*down_proj$"]},)
DEFAULT_MAPPINGS = {
    "qwen3": (  # Qwen3ForCausalLM: llm-compressor's default_mappings
        *_ATTENTION,
        {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*gate_proj$", "re:.*up_proj$"]},
        *_UP_DOWN,
    ),
    "qwen3-moe": (  # Qwen3MoeForCausalLM: llm-compressor's _moe_default_mappings
        *_ATTENTION,
        {
            "smooth_layer": "re:.*post_attention_layernorm$",
            "balance_layers": ["re:.*mlp.gate$", "re:.*mlp.experts.*.gate_proj$", "re:.*mlp.experts.*.up_proj$"],
        },
        *_UP_DOWN,
    ),
}
DUO_SCALING, N_GRID = True, 20  # the grid qcompile.quant.awq.AwqConfig searches by default
AWQ_KEYS = frozenset({"mappings", "duo_scaling", "n_grid", "offload_device"})


def translate_awq_arguments(args: dict[str, Any], where: str, source: str) -> str:
    """quantization.awq_mappings for an AWQModifier's own arguments (AWQ_KEYS only): "auto" when it
    names no mappings; a RecipeError naming the file, the modifier and the field for what the search
    cannot honour."""
    duo = args.get("duo_scaling", DUO_SCALING)
    if duo is not DUO_SCALING:
        raise RecipeError(
            f"{source}: {where}.duo_scaling {shown(duo)} is not supported: w4a16-awq searches AWQModifier's "
            f"default grid only (duo_scaling: true, n_grid: {N_GRID}); leave duo_scaling out or set it to true"
        )
    n_grid = args.get("n_grid", N_GRID)
    if isinstance(n_grid, bool) or n_grid != N_GRID:
        raise RecipeError(
            f"{source}: {where}.n_grid {shown(n_grid)} is not supported: w4a16-awq searches AWQModifier's "
            f"default grid only (n_grid: {N_GRID}, duo_scaling: true); leave n_grid out or set it to {N_GRID}"
        )
    offload = args.get("offload_device")
    if offload is not None and not isinstance(offload, str):
        raise RecipeError(f"{source}: {where}.offload_device must be a device name or null, got {shown(offload)}")
    return _mappings(args.get("mappings"), where, source)


def _mappings(given: Any, where: str, source: str) -> str:
    if given is None:
        return "auto"
    if isinstance(given, list):
        normal = [_mapping(m) for m in given]
        for name, default in DEFAULT_MAPPINGS.items():
            if normal == list(default):
                return name
    raise RecipeError(
        f"{source}: {where}.mappings {shown(given, 200)} are not supported: w4a16-awq searches AWQModifier's "
        "default mappings for Qwen3 and Qwen3-MoE (input_layernorm -> q/k/v, v_proj -> o_proj, "
        "post_attention_layernorm -> gate/up (the router and every expert's in Qwen3-MoE), up_proj -> down_proj); "
        "leave mappings out to take them, or spell out exactly those (llm-compressor's AWQ_MAPPING_REGISTRY)"
    )


def _mapping(entry: Any) -> Any:
    """A mapping as DEFAULT_MAPPINGS writes it (a missing or null activation_hook_target left out);
    anything else unchanged, so that it matches no default."""
    if not isinstance(entry, dict):
        return entry
    if "activation_hook_target" in entry and entry["activation_hook_target"] is None:
        entry = {k: v for k, v in entry.items() if k != "activation_hook_target"}
    return entry
