"""A Qwen3-VL checkpoint's tensors for the reference forward: read from safetensors, held to the config.

transformers 5.17's save_pretrained writes the text model under `model.language_model.`
(embed_tokens, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.…}, norm) and the head as `lm_head.weight` (left out when tied). A
sparse layer's MLP is mlp.gate.weight [E, H] and the stacked experts mlp.experts.gate_up_proj
[E, 2I, H] (gate rows, then up rows) and mlp.experts.down_proj [E, H, I]; the published MoE
checkpoints store both experts transposed ([E, H, 2I], [E, I, H]), which transformers turns back
whenever the shape is not already its own, and so does this reader. The match is a bijection:
every expected tensor present with its shape, nothing else in the checkpoint (the vision tower's
names are load_vision_tower's to check). Errors name the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from qruntime import bounded_json
from qruntime.shown import shown
from qruntime.vision.reference_config import ReferenceConfig, TextConfig
from qruntime.vision.tower_weights import DEFAULT_PREFIX as TOWER_PREFIX

TEXT_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_MAX_INDEX_BYTES = 64 << 20
# Stacked experts the published checkpoints store with the last two axes swapped.
_MAY_BE_TRANSPOSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def text_tensor_shapes(config: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the text model (names without TEXT_PREFIX) → its shape, as transformers holds it."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q_width, kv_width = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows, cols in (("q", q_width, h), ("k", kv_width, h), ("v", kv_width, h), ("o", h, q_width)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, cols)
            if c.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if c.is_sparse(i):
            e, inter = c.moe.num_experts, c.moe.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * inter, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, inter)
        else:
            inter = c.intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["norm.weight"] = (h,)
    return shapes


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: model.safetensors, or the shards model.safetensors.index.json
    lists (each tensor in the shard the index names, no tensor twice). Only JSON and safetensors are
    read; nothing in the directory is executed."""
    root = Path(path)
    if (root / _INDEX).is_file():
        return _read_sharded(root)
    if (root / _SINGLE).is_file():
        return load_file(root / _SINGLE)
    raise ValueError(f"{root}: no {_SINGLE} or {_INDEX} (a Qwen3-VL checkpoint's weights)")


def _read_sharded(root: Path) -> dict[str, torch.Tensor]:
    index_path = root / _INDEX
    if index_path.stat().st_size > _MAX_INDEX_BYTES:
        raise ValueError(f"{index_path}: larger than {_MAX_INDEX_BYTES} bytes")
    index = bounded_json.loads(index_path.read_bytes(), what=_INDEX)
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map must map tensor names to shard file names")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in (".", ".."):
            raise ValueError(f"{index_path}: shard {shown(shard)} is not a file name in the checkpoint directory")
        for name, tensor in load_file(root / shard).items():
            if name in tensors:
                raise ValueError(f"{root}: tensor {shown(name)} is stored twice (again in {shard})")
            if weight_map.get(name) != shard:
                raise ValueError(
                    f"{root}: tensor {shown(name)} is in {shard} but the index says {weight_map.get(name)}"
                )
            tensors[name] = tensor
    for name, shard in weight_map.items():
        if name not in tensors:
            raise ValueError(f"{root}: tensor {shown(name)} listed in the index is not in {shard}")
    return tensors


def text_weights(
    state_dict: Mapping[str, torch.Tensor], config: ReferenceConfig, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The text model's tensors (names without TEXT_PREFIX) and "lm_head.weight", in float32 on
    `device`, checked against `config`; any tensor of `state_dict` that is neither the text model's,
    the head nor under the tower's prefix is refused. A tied head is the embeddings; a stored copy of
    it is accepted only if equal to them."""
    shapes = text_tensor_shapes(config.text)
    for name in state_dict:
        if name.startswith(TOWER_PREFIX) or name == LM_HEAD:
            continue
        if not name.startswith(TEXT_PREFIX) or name[len(TEXT_PREFIX) :] not in shapes:
            raise ValueError(f"checkpoint: unexpected tensor {shown(name)} (not part of this config's model)")
    weights = {name: _checked(state_dict, TEXT_PREFIX + name, shape, device) for name, shape in shapes.items()}
    embed = weights["embed_tokens.weight"]
    if not config.tie_word_embeddings:
        weights[LM_HEAD] = _checked(state_dict, LM_HEAD, embed.shape, device)
    elif LM_HEAD in state_dict:
        head = _checked(state_dict, LM_HEAD, embed.shape, device)
        if not torch.equal(head, embed):
            raise ValueError(
                f"checkpoint: tensor {LM_HEAD} differs from the token embeddings, but tie_word_embeddings is true "
                "(transformers would drop it and use the embeddings)"
            )
        weights[LM_HEAD] = embed
    else:
        weights[LM_HEAD] = embed
    return weights


def _checked(
    state_dict: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], device: str | torch.device
) -> torch.Tensor:
    """state_dict[name] in float32 on `device`, its shape checked (stacked experts may come transposed)."""
    if name not in state_dict:
        raise ValueError(f"checkpoint: tensor {name} is missing")
    tensor = state_dict[name]
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"checkpoint: tensor {name} is {kind}, expected a floating-point tensor")
    shape = tuple(shape)
    swapped = (*shape[:-2], shape[-1], shape[-2]) if len(shape) == 3 else None
    if tuple(tensor.shape) != shape:
        if name.endswith(_MAY_BE_TRANSPOSED) and tuple(tensor.shape) == swapped:
            tensor = tensor.transpose(1, 2)
        else:
            raise ValueError(f"checkpoint: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
    # A copy in memory of our own: CPU matmuls round differently by the data's alignment, which the
    # file's layout would otherwise decide (a sharded copy of a checkpoint gave other last bits).
    return tensor.to(device, torch.float32, copy=True).contiguous()
