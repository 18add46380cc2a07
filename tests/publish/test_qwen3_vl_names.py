"""qcompile.publish.qwen3_vl: Qwen3-VL checkpoint names, the stacked experts' layout and its refusals
(the end-to-end export is tests/publish/test_export_qwen3_vl.py)."""

from __future__ import annotations

import random

import pytest
import torch

from qcompile.errors import ExportError
from qcompile.publish.qwen3_vl import (
    VISION_IGNORE,
    check_expert_scheme,
    checkpoint_name,
    expert_stack,
    stack_layout,
    vision_quantization_config,
)

PREFIX = "model.layers.3.mlp.experts"
STACK = "model.language_model.layers.3.mlp.experts"


def test_names_go_back_under_the_language_model():
    assert checkpoint_name("model.layers.0.self_attn.q_proj.weight") == (
        "model.language_model.layers.0.self_attn.q_proj.weight"
    )
    assert checkpoint_name("model.embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert checkpoint_name("model.norm.weight") == "model.language_model.norm.weight"
    for kept in ("model.visual.blocks.0.attn.qkv.weight", "lm_head.weight", "lm_head.weight_scale"):
        assert checkpoint_name(kept) == kept
    assert expert_stack(f"{PREFIX}.7.gate_proj.weight") == f"{STACK}.gate_up_proj"
    assert expert_stack(f"{PREFIX}.7.up_proj.weight") == f"{STACK}.gate_up_proj"
    assert expert_stack(f"{PREFIX}.7.down_proj.weight") == f"{STACK}.down_proj"
    for other in (
        "model.layers.3.mlp.gate.weight",
        f"{PREFIX}.7.gate_proj.weight_scale",
        "model.layers.3.mlp.gate_proj.weight",
    ):
        assert expert_stack(other) is None


def _parts(experts: int, rows: dict[str, int], cols: int, dtype: torch.dtype, rng: random.Random):
    parts = [(f"{PREFIX}.{e}.{kind}_proj.weight", dtype, (n, cols)) for e in range(experts) for kind, n in rows.items()]
    rng.shuffle(parts)  # any order: each part's place comes from its name
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_layout_is_transformers(dtype, rng):
    """Each part's bytes at its offset make transformers' [E, 2I, H] (gate rows, then up) / [E, H, I]."""
    experts, inter, hidden = rng.randint(1, 6), rng.randint(1, 9), rng.randint(1, 9)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    gate, up = torch.randn(experts, inter, hidden, generator=gen), torch.randn(experts, inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    values = {
        f"{PREFIX}.{e}.{k}_proj.weight": t[e]
        for e in range(experts)
        for k, t in zip(("gate", "up", "down"), (gate, up, down), strict=True)
    }
    for stack, rows, want in (
        (f"{STACK}.gate_up_proj", {"gate": inter, "up": inter}, torch.cat([gate, up], dim=1)),
        (f"{STACK}.down_proj", {"down": hidden}, down),
    ):
        out, offsets = stack_layout(stack, _parts(experts, rows, want.shape[-1], dtype, rng))
        assert out.name == stack and out.dtype == dtype and out.shape == tuple(want.shape)
        flat = torch.zeros(out.nbytes, dtype=torch.uint8)
        for name, offset in offsets.items():
            raw = values[name].to(dtype).contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()] = raw
        assert set(offsets) == {n for n in values if (".down_" in n) == stack.endswith("down_proj")}
        assert torch.equal(flat.view(dtype).reshape(out.shape), want.to(dtype))


def test_incomplete_or_unequal_experts_are_refused(rng):
    parts = _parts(3, {"gate": 4, "up": 4}, 5, torch.float32, rng)
    missing = [p for p in parts if p[0] != f"{PREFIX}.1.up_proj.weight"]
    with pytest.raises(ExportError, match=r"expert 1 of .*gate_up_proj': its up weight is missing"):
        stack_layout(f"{STACK}.gate_up_proj", missing)
    gap = [p for p in parts if ".1." not in p[0]]
    with pytest.raises(ExportError, match=r"are \[0, 2\] .* needs experts 0..E-1"):
        stack_layout(f"{STACK}.gate_up_proj", gap)
    wide = [(n, d, (s[0], 6)) if n.startswith(f"{PREFIX}.2.gate") else (n, d, s) for n, d, s in parts]
    with pytest.raises(
        ExportError, match=r"expert 2 .* gate weight is torch.float32 \[4, 6\], but .* needs torch.float32 \[4, 5\]"
    ):
        stack_layout(f"{STACK}.gate_up_proj", wide)
    halves = [(n, torch.bfloat16, s) if ".up_" in n else (n, d, s) for n, d, s in parts]
    with pytest.raises(
        ExportError, match=r"expert 0 .* up weight is torch.bfloat16 \[4, 5\], but .* needs torch.float32 \[4, 5\]"
    ):
        stack_layout(f"{STACK}.gate_up_proj", halves)
    uneven = [(n, d, (3, s[1])) if ".up_" in n else (n, d, s) for n, d, s in parts]
    with pytest.raises(ExportError, match="have 4 gate rows but 3 up rows"):
        stack_layout(f"{STACK}.gate_up_proj", uneven)
    with pytest.raises(ExportError, match="comes twice"):
        stack_layout(f"{STACK}.gate_up_proj", parts + parts[:1])


def test_quantized_experts_are_refused_naming_the_tensor():
    check_expert_scheme(f"{PREFIX}.0.gate_proj.weight", "none", False)
    with pytest.raises(ExportError, match=r"'model.layers.3.mlp.experts.0.gate_proj.weight' is quantized \(w4a16\)"):
        check_expert_scheme(f"{PREFIX}.0.gate_proj.weight", "w4a16", True)


def test_the_tower_joins_the_ignore_list_once():
    config = {"ignore": ["lm_head", "re:model.visual.*"], "format": "float-quantized"}
    got = vision_quantization_config(config)
    assert got["ignore"] == ["lm_head", "re:model.visual.*", "re:visual.*"] and got["format"] == "float-quantized"
    assert config["ignore"] == ["lm_head", "re:model.visual.*"]  # not modified in place
    assert set(VISION_IGNORE) <= set(vision_quantization_config({"ignore": []})["ignore"])
