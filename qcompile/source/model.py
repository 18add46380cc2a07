"""Qwen3's tensor names and shapes in the Hugging Face checkpoint layout, as data.

The rest of the compiler asks this module what a layer's source tensors are called; nothing else
spells out a Hugging Face name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from qcompile.source.spec import ModelSpec

EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"
LM_HEAD = "lm_head"
_LAYER = re.compile(r"model\.layers\.(\d{1,10})\.")
_INDEX = re.compile(r"(\d{1,10})\.")


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def layer_of(name: str) -> int | None:
    """The decoder layer index a tensor name belongs to (`model.layers.{i}.…`), None for others."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def expert_of(name: str, layer: int) -> int | None:
    """The expert index of a tensor name of layer `layer`'s experts (`….mlp.experts.{e}.…`), else None."""
    prefix = f"{layer_prefix(layer)}.mlp.experts."
    match = _INDEX.match(name, len(prefix)) if name.startswith(prefix) else None
    return int(match.group(1)) if match else None


def attn_proj(layer: int, proj: str) -> str:
    """Module name of q_proj / k_proj / v_proj / o_proj."""
    return f"{layer_prefix(layer)}.self_attn.{proj}"


def mlp_proj(layer: int, proj: str) -> str:
    """Module name of a dense MLP's gate_proj / up_proj / down_proj."""
    return f"{layer_prefix(layer)}.mlp.{proj}"


def expert_proj(layer: int, expert: int, proj: str) -> str:
    return f"{layer_prefix(layer)}.mlp.experts.{expert}.{proj}"


def router(layer: int) -> str:
    return f"{layer_prefix(layer)}.mlp.gate"


def norm(layer: int, which: str) -> str:
    """input_layernorm / post_attention_layernorm / self_attn.q_norm / self_attn.k_norm."""
    return f"{layer_prefix(layer)}.{which}"


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a complete checkpoint of `spec` holds, name -> shape (all in spec.dtype)."""
    return dict(iter_expected(spec))


def count_expected(spec: ModelSpec) -> int:
    """len(expected_tensors(spec)), counted per layer without naming a tensor."""
    count = 2 if spec.tie_word_embeddings else 3  # embed_tokens, norm (, lm_head)
    for i in range(spec.num_hidden_layers):
        count += 8 + (1 + 3 * spec.moe.num_experts if spec.moe is not None and spec.is_sparse_layer(i) else 3)
    return count


def iter_expected(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a complete checkpoint of `spec`, embedding first, layer by layer."""
    h, d = spec.hidden_size, spec.head_dim
    yield f"{EMBED}.weight", (spec.vocab_size, h)
    yield f"{FINAL_NORM}.weight", (h,)
    if not spec.tie_word_embeddings:
        yield f"{LM_HEAD}.weight", (spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        yield f"{norm(i, 'input_layernorm')}.weight", (h,)
        yield f"{norm(i, 'post_attention_layernorm')}.weight", (h,)
        yield f"{norm(i, 'self_attn.q_norm')}.weight", (d,)
        yield f"{norm(i, 'self_attn.k_norm')}.weight", (d,)
        yield f"{attn_proj(i, 'q_proj')}.weight", (spec.q_size, h)
        yield f"{attn_proj(i, 'k_proj')}.weight", (spec.kv_size, h)
        yield f"{attn_proj(i, 'v_proj')}.weight", (spec.kv_size, h)
        yield f"{attn_proj(i, 'o_proj')}.weight", (h, spec.q_size)
        if spec.moe is not None and spec.is_sparse_layer(i):
            inter = spec.moe.moe_intermediate_size
            yield f"{router(i)}.weight", (spec.moe.num_experts, h)
            for e in range(spec.moe.num_experts):
                yield f"{expert_proj(i, e, 'gate_proj')}.weight", (inter, h)
                yield f"{expert_proj(i, e, 'up_proj')}.weight", (inter, h)
                yield f"{expert_proj(i, e, 'down_proj')}.weight", (h, inter)
        else:
            inter = spec.intermediate_size
            yield f"{mlp_proj(i, 'gate_proj')}.weight", (inter, h)
            yield f"{mlp_proj(i, 'up_proj')}.weight", (inter, h)
            yield f"{mlp_proj(i, 'down_proj')}.weight", (h, inter)
