"""KV-cache calibration and the draft-layer search run a Qwen3-VL checkpoint's text decoder layer by
layer through transformers' Qwen3 (Qwen3-MoE) layers (compile/source_layers.py): on text, where
M-RoPE's three positions are equal, each layer's output equals transformers' Qwen3-VL text model's."""

from __future__ import annotations

import pytest
import torch
from qwen3_vl_checkpoints import IMAGE, write_checkpoint

from qcompile.compile.source_layers import SourceLayers
from qcompile.source.checkpoint import Checkpoint


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_layers_on_text_equal_the_vl_text_model(kind, tmp_path, rng):
    rope = dict(rope_type="default", rope_theta=500000.0, mrope_section=[4, 2, 2], mrope_interleaved=True)
    model = write_checkpoint(tmp_path, kind, text={"rope_parameters": rope})  # not transformers' default theta
    source = SourceLayers(Checkpoint.open(tmp_path), "test")
    ids = torch.tensor([[rng.randrange(IMAGE) for _ in range(23)] for _ in range(2)])
    with torch.no_grad():
        want = model.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
        hidden = source.embed(ids)
        positions = torch.arange(ids.shape[1])[None]
        cos, sin = source.rotary(hidden[:1], positions)
        assert torch.equal(hidden, want[0])
        for index, layer in source.layers(range(model.config.text_config.num_hidden_layers - 1)):
            out = layer(
                hidden, attention_mask=None, position_ids=positions.expand(2, -1), position_embeddings=(cos, sin)
            )
            hidden = out[0] if isinstance(out, tuple) else out
            error = float((hidden - want[index + 1]).abs().max() / want[index + 1].abs().max())
            assert error < 1e-5, f"layer {index}: {error:.2e}"
