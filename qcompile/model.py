"""Qwen3's tensor names and shapes in the Hugging Face checkpoint layout, as data.

The rest of the compiler asks this module what a layer's source tensors are called; nothing else
spells out a Hugging Face name.
"""

from __future__ import annotations

from qcompile.spec import ModelSpec

EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"
LM_HEAD = "lm_head"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


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
    h, d = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {f"{EMBED}.weight": (spec.vocab_size, h), f"{FINAL_NORM}.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes[f"{LM_HEAD}.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        shapes[f"{norm(i, 'input_layernorm')}.weight"] = (h,)
        shapes[f"{norm(i, 'post_attention_layernorm')}.weight"] = (h,)
        shapes[f"{norm(i, 'self_attn.q_norm')}.weight"] = (d,)
        shapes[f"{norm(i, 'self_attn.k_norm')}.weight"] = (d,)
        shapes[f"{attn_proj(i, 'q_proj')}.weight"] = (spec.q_size, h)
        shapes[f"{attn_proj(i, 'k_proj')}.weight"] = (spec.kv_size, h)
        shapes[f"{attn_proj(i, 'v_proj')}.weight"] = (spec.kv_size, h)
        shapes[f"{attn_proj(i, 'o_proj')}.weight"] = (h, spec.q_size)
        if spec.is_sparse_layer(i):
            assert spec.moe is not None
            inter = spec.moe.moe_intermediate_size
            shapes[f"{router(i)}.weight"] = (spec.moe.num_experts, h)
            for e in range(spec.moe.num_experts):
                shapes[f"{expert_proj(i, e, 'gate_proj')}.weight"] = (inter, h)
                shapes[f"{expert_proj(i, e, 'up_proj')}.weight"] = (inter, h)
                shapes[f"{expert_proj(i, e, 'down_proj')}.weight"] = (h, inter)
        else:
            inter = spec.intermediate_size
            shapes[f"{mlp_proj(i, 'gate_proj')}.weight"] = (inter, h)
            shapes[f"{mlp_proj(i, 'up_proj')}.weight"] = (inter, h)
            shapes[f"{mlp_proj(i, 'down_proj')}.weight"] = (h, inter)
    return shapes
