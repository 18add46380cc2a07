"""AWQ's groups for one Qwen3 decoder layer, as data, and the layer's weights they name.

A group is llm-compressor's AWQModifier mapping resolved for one layer: the op whose output is
smoothed (a norm, or a linear whose rows are divided), the linears that read that output (their
columns are multiplied), and the module whose output the search's loss compares. Names are
relative to the layer (`model.layers.{i}.` + name + `.weight` is the source tensor).

    input_layernorm          -> q_proj, k_proj, v_proj   loss at self_attn's output
    v_proj (its rows)        -> o_proj                   only when v_proj's rows are o_proj's columns
    dense MLP:
    post_attention_layernorm -> gate_proj, up_proj       loss at the mlp's output
    up_proj (its rows)       -> down_proj                loss at down_proj's output
    MoE MLP (AWQModifier's Qwen3-MoE mappings):
    post_attention_layernorm -> the router (mlp.gate), every expert's gate_proj and up_proj
                                                         one scale vector; loss at the MoE block's output
    experts.{e}.up_proj      -> experts.{e}.down_proj    per expert, on the tokens routed to it

The router is in the MoE group so that its columns are scaled with the experts': its logits, and so
the routing, are unchanged by the fold. The recipe leaves it unquantized (scaled, never rounded).

transformers holds a MoE layer's experts as two stacked parameters (gate_up_proj [E, 2I, H],
down_proj [E, H, I]); `weight` and `swapped` reach one expert's projection inside them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from qcompile.source.spec import ModelSpec


@dataclass(frozen=True)
class Group:
    """One AWQ group: `smooth` (a norm, or a linear whose rows are divided), the `balance` linears
    that read its output, and `parent`, the module (or linear) whose output the loss compares."""

    smooth: str
    balance: tuple[str, ...]
    parent: str

    @property
    def expert(self) -> int | None:
        """The expert of a per-expert up_proj -> down_proj group, else None."""
        match = _EXPERT.fullmatch(self.smooth)
        return int(match.group(1)) if match else None


ATTENTION = (
    Group("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    Group("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
)
DENSE_MLP = (
    Group("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    Group("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")


def moe_mlp(num_experts: int) -> tuple[Group, ...]:
    """A sparse layer's MLP groups: the router and all experts' gate/up, then each expert's down."""
    experts = [f"mlp.experts.{e}" for e in range(num_experts)]
    gate_up = ("mlp.gate", *(f"{x}.{p}" for x in experts for p in ("gate_proj", "up_proj")))
    down = tuple(Group(f"{x}.up_proj", (f"{x}.down_proj",), f"{x}.down_proj") for x in experts)
    return (Group("post_attention_layernorm", gate_up, "mlp"), *down)


def layer_groups(spec: ModelSpec, layer: int) -> tuple[Group, ...]:
    """Every AWQ group of decoder layer `layer`, in the order they are searched."""
    if spec.is_sparse_layer(layer):
        assert spec.moe is not None
        return ATTENTION + moe_mlp(spec.moe.num_experts)
    return ATTENTION + DENSE_MLP


def _locate(module: Any, name: str) -> tuple[torch.nn.Parameter, tuple]:
    """The parameter holding linear `name`'s weight and the index of that weight in it."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return module.get_submodule(name).weight, ()
    experts = module.mlp.experts
    e, proj = int(match.group(1)), match.group(2)
    if proj == "down_proj":
        return experts.down_proj, (e,)
    inter = experts.gate_up_proj.shape[1] // 2
    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return experts.gate_up_proj, (e, rows)


def weight(module: Any, name: str) -> torch.Tensor:
    """Linear `name`'s weight [N, K] in the layer `module` (a view of its parameter)."""
    param, index = _locate(module, name)
    return param.data[index]


@contextmanager
def swapped(module: Any, names: Sequence[str], weights: Sequence[torch.Tensor]) -> Iterator[None]:
    """The layer with `weights` in place of the named linears' (a stacked experts parameter is
    copied once and the trial written into the copy), its own weights back on exit."""
    originals: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    try:
        for name, w in zip(names, weights, strict=True):
            param, index = _locate(module, name)
            if id(param) not in originals:
                originals[id(param)] = (param, param.data)
                if index:
                    param.data = param.data.clone()
            if index:
                param.data[index] = w
            else:
                param.data = w
        yield
    finally:
        for param, data in originals.values():
            param.data = data


def routes(mlp: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The experts the router picks for each token of each batch of the MoE block's inputs [B, T, H]
    (fp32, as the layer runs): top-k indices [B * T, k] per batch."""
    return [mlp.gate(x.reshape(-1, x.shape[-1]).float())[2] for x in inputs]


def routed_inputs(
    mlp: Any, inputs: Sequence[torch.Tensor], chosen: Sequence[torch.Tensor], expert: int, dtype: torch.dtype
) -> torch.Tensor:
    """down_proj's input of `expert` on the tokens routed to it [n, I], act(x @ gate^T) * (x @ up^T)
    in fp32 as transformers' Qwen3MoeExperts computes it, rounded to `dtype` as the other recorded
    inputs are; n = 0 when no token was."""
    experts = mlp.experts
    parts = []
    for x, picked in zip(inputs, chosen, strict=True):
        tokens = (picked == expert).any(-1).nonzero().squeeze(-1)
        h = x.reshape(-1, x.shape[-1])[tokens].float()
        gate, up = torch.nn.functional.linear(h, experts.gate_up_proj[expert]).chunk(2, dim=-1)
        parts.append((experts.act_fn(gate) * up).to(dtype))
    return torch.cat(parts)
