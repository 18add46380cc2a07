"""Qwen3-VL's text decoder in plain torch, float32: one sequence, no cache (the reference forward's half
after the vision tower).

Each layer, as transformers 5.17's Qwen3VLTextDecoderLayer (and the MoE one) computes it:
  x = x + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))  on rms_norm(x)    (causal, GQA)
  x = x + mlp(rms_norm(x))    SwiGLU, or the sparse MoE block (softmax router, top-k renormalized)
and after each of the first len(deepstack) layers, deepstack[i] is added to the rows of the image
tokens. Then the final rms_norm. The rotary cos / sin are M-RoPE's (positions.mrope_cos_sin),
applied rotate-half style.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from qruntime.vision.reference_config import MoeConfig, TextConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last axis."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [T, heads, head_dim] with cos / sin [T, head_dim]."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _linear(w: Mapping[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def attention(
    w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, c: TextConfig
) -> torch.Tensor:
    """Causal self-attention of layer prefix `p` on x [T, hidden] → [T, hidden]."""
    t, d = x.shape[0], c.head_dim
    q = rms_norm(_linear(w, p + "q_proj", x).view(t, c.num_attention_heads, d), w[p + "q_norm.weight"], c.rms_norm_eps)
    k = rms_norm(_linear(w, p + "k_proj", x).view(t, c.num_key_value_heads, d), w[p + "k_norm.weight"], c.rms_norm_eps)
    v = _linear(w, p + "v_proj", x).view(t, c.num_key_value_heads, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = c.num_attention_heads // c.num_key_value_heads  # query heads per kv head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, heads, d]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=d**-0.5
    )  # [heads, T, d]
    return _linear(w, p + "o_proj", out.transpose(0, 1).reshape(t, c.num_attention_heads * d))


def dense_mlp(w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return _linear(w, p + "down_proj", F.silu(_linear(w, p + "gate_proj", x)) * _linear(w, p + "up_proj", x))


def sparse_moe(w: Mapping[str, torch.Tensor], p: str, x: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """Each token through its top-k experts of the router's softmax, their outputs summed with the
    k probabilities renormalized to sum to 1. x [T, hidden] → [T, hidden]."""
    probs = torch.softmax(F.linear(x, w[p + "gate.weight"]), dim=-1)  # [T, E]
    top_probs, top_experts = probs.topk(moe.num_experts_per_tok, dim=-1)  # [T, k]
    top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    gate_up, down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]  # [E, 2I, H], [E, H, I]
    out = torch.zeros_like(x)
    for expert in top_experts.unique().tolist():
        tokens, slot = torch.nonzero(top_experts == expert, as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])  # [tokens, H]
        out.index_add_(0, tokens, y * top_probs[tokens, slot, None])
    return out


def decode_layers(
    w: Mapping[str, torch.Tensor],
    c: TextConfig,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    visual_mask: torch.Tensor,
    deepstack: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The decoder over the input embeddings x [T, hidden] (image embeddings already in place) →
    the final-normed hidden states [T, hidden]. visual_mask [T] bool marks the image tokens, and
    deepstack[i] [visual tokens, hidden] is added to them after layer i."""
    if len(deepstack) > c.num_hidden_layers:
        raise ValueError(f"{len(deepstack)} deepstack features but only {c.num_hidden_layers} text layers")
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        x = x + attention(
            w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps), cos, sin, c
        )
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        x = x + (sparse_moe(w, p + "mlp.", h, c.moe) if c.is_sparse(i) else dense_mlp(w, p + "mlp.", h))
        if i < len(deepstack):
            x = x.index_put((visual_mask,), x[visual_mask] + deepstack[i])
    return rms_norm(x, w["norm.weight"], c.rms_norm_eps)
