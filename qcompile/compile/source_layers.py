"""The source checkpoint run one decoder layer at a time: transformers' own Qwen3 layer classes, each
layer's weights read from the shards and dropped after use, so memory holds one layer and the
activations, never the model (KV-cache calibration and the draft-layer search run it so)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from qcompile.errors import QCompileError
from qcompile.source import model as hf
from qcompile.source.checkpoint import Checkpoint


def layer_state(checkpoint: Checkpoint, layer: int) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors, named as transformers' layer module names them (MoE experts
    stacked into its fused gate_up_proj [E, 2I, H] / down_proj [E, H, I])."""
    prefix = hf.layer_prefix(layer) + "."
    state = {}
    for name, entry in checkpoint.tensors.items():
        if name.startswith(prefix) and ".mlp.experts." not in name:
            state[name[len(prefix) :]] = entry.read_rows(0, entry.shape[0])
    moe = checkpoint.spec.moe
    if moe is not None and checkpoint.spec.is_sparse_layer(layer):
        read = [
            {
                p: checkpoint.entry(f"{hf.expert_proj(layer, e, p)}.weight")
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            for e in range(moe.num_experts)
        ]
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([r[p].read_rows(0, r[p].shape[0]) for p in ("gate_proj", "up_proj")]) for r in read]
        )
        state["mlp.experts.down_proj"] = torch.stack(
            [r["down_proj"].read_rows(0, r["down_proj"].shape[0]) for r in read]
        )
    return state


class SourceLayers:
    """transformers' pieces for the checkpoint: config, decoder layer class, rotary embedding."""

    def __init__(self, checkpoint: Checkpoint, what: str) -> None:
        try:
            from transformers import AutoConfig
        except ImportError as exc:
            raise QCompileError(
                f"{what} runs the source model with transformers: pip install 'qcompile[reference]'"
            ) from exc
        self.checkpoint = checkpoint
        self.config = (
            _text_config(checkpoint) if checkpoint.spec.vision else AutoConfig.from_pretrained(checkpoint.path)
        )
        self.config._attn_implementation = "sdpa"  # with no mask, sdpa attends causally
        self.config._experts_implementation = "eager"
        if checkpoint.spec.moe is not None:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer as Layer
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding as Rotary
        else:
            from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer as Layer
            from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary
        self.layer_class, self.rotary = Layer, Rotary(self.config)
        self.dtype = getattr(torch, checkpoint.spec.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, T, H] of ids [N, T]."""
        embed = self.checkpoint.entry(f"{hf.EMBED}.weight")
        return torch.nn.functional.embedding(ids, embed.read_rows(0, embed.shape[0]))

    def layer(self, index: int) -> Any:
        """Decoder layer `index` with its weights, in the checkpoint's dtype, for inference."""
        with torch.device("meta"):
            module = self.layer_class(self.config, index)  # the index picks a MoE layer's sparse or dense MLP
        module.load_state_dict(layer_state(self.checkpoint, index), strict=True, assign=True)
        return module.to(self.dtype).eval()

    def layers(self, indexes: Iterator[int] | range) -> Iterator[tuple[int, Any]]:
        """(index, layer) one at a time, each dropped before the next is read."""
        for index in indexes:
            module = self.layer(index)
            yield index, module
            del module


def _text_config(checkpoint: Checkpoint) -> Any:
    """A Qwen3-VL checkpoint's text decoder as a Qwen3 (or Qwen3-MoE) config: what calibration and the
    draft-layer search run on text alone, where M-RoPE's three positions are equal and so its rotary is
    plain RoPE at the same theta. transformers' Qwen3-VL MoE blocks always renormalize the top-k weights."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    spec = checkpoint.spec
    text = {k: v for k, v in checkpoint.config["text_config"].items() if k not in _VL_ONLY_KEYS}
    text.update(
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
    )
    if spec.moe is None:
        return Qwen3Config(**text)
    return Qwen3MoeConfig(**text, norm_topk_prob=True)


# text_config keys of a Qwen3-VL checkpoint that mean something else (or nothing) to a Qwen3 config
_VL_ONLY_KEYS = frozenset({"model_type", "rope_scaling", "rope_parameters", "rope_theta", "architectures"})
