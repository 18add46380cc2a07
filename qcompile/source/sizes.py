"""config.json's sizes held to the tensors a checkpoint's shards hold, before anything is built from them.

`ModelSpec.from_config` checks each size's type and range alone; `check_sizes` then compares them
with the shapes and names in the safetensors headers, in time linear in the number of tensors, so
a config that says 10**9 layers or experts is an error naming the key, never a list of 10**9 names.
"""

from __future__ import annotations

from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.io.safetensors_stream import TensorEntry
from qcompile.source.model import EMBED, attn_proj, expert_of, expert_proj, layer_of, mlp_proj, norm, router
from qcompile.source.qwen3_vl import label, stored_name
from qcompile.source.spec import ModelSpec


def check_sizes(spec: ModelSpec, tensors: dict[str, TensorEntry], source: str = "config.json") -> None:
    """Hold config.json's sizes to the tensors the shards hold, in time linear in their number, before
    anything is listed or built from the sizes (a config saying 10**12 layers must not make the
    compiler enumerate them). Each error names the key and the tensor that contradicts it."""
    layers = {i for name in tensors if (i := layer_of(name)) is not None}
    if spec.num_hidden_layers != len(layers):
        held = f"model.layers.{min(layers)} to model.layers.{max(layers)}" if layers else "none"
        raise CheckpointError(
            f"{source}: 'num_hidden_layers' is {spec.num_hidden_layers} but the checkpoint's tensors hold "
            f"{len(layers)} decoder layers ({held})"
        )
    h, d = spec.hidden_size, spec.head_dim
    vl = spec.vision is not None
    kinds = [spec.is_sparse_layer(i) for i in range(spec.num_hidden_layers)]
    if spec.moe is not None:  # each layer sparse by the config's rule exactly when it holds a router
        for layer, sparse in enumerate(kinds):
            if sparse != (f"{router(layer)}.weight" in tensors):
                raise CheckpointError(
                    f"{source}: 'decoder_sparse_step' ({spec.moe.decoder_sparse_step}) and 'mlp_only_layers' "
                    f"({shown(list(spec.moe.mlp_only_layers))}) make layer {layer} {'sparse' if sparse else 'dense'}, "
                    f"but the checkpoint {'lacks' if sparse else 'holds'} its router {router(layer)}.weight"
                )
    checks = [
        (f"{EMBED}.weight", (spec.vocab_size, h), "'vocab_size' x 'hidden_size'"),
        (f"{norm(0, 'self_attn.q_norm')}.weight", (d,), "'head_dim'"),
        (f"{attn_proj(0, 'q_proj')}.weight", (spec.q_size, h), "'num_attention_heads' x 'head_dim'"),
        (f"{attn_proj(0, 'k_proj')}.weight", (spec.kv_size, h), "'num_key_value_heads' x 'head_dim'"),
    ]
    if False in kinds:  # the first dense layer
        checks.append(
            (f"{mlp_proj(kinds.index(False), 'gate_proj')}.weight", (spec.intermediate_size, h), "'intermediate_size'")
        )
    for name, shape, keys in checks:
        _expect(tensors, name, shape, keys, source, vl)
    if spec.moe is not None and True in kinds:
        sparse = kinds.index(True)
        moe = spec.moe
        _expect(tensors, f"{router(sparse)}.weight", (moe.num_experts, h), "'num_experts'", source, vl)
        held = {e for name in tensors if (e := expert_of(name, sparse)) is not None}
        if len(held) != moe.num_experts:
            raise CheckpointError(
                f"{source}: 'num_experts' is {moe.num_experts} but layer {sparse}'s tensors hold {len(held)} experts"
            )
        gate = f"{expert_proj(sparse, 0, 'gate_proj')}.weight"
        _expect(tensors, gate, (moe.moe_intermediate_size, h), "'moe_intermediate_size'", source, vl)


def _expect(
    tensors: dict[str, TensorEntry], name: str, shape: tuple[int, ...], keys: str, source: str, vl: bool
) -> None:
    entry = tensors.get(name)
    if entry is None:
        stored = stored_name(name) if vl else name  # a Qwen3-VL checkpoint stores it under another name
        named = repr(name) if stored == name else f"{stored!r} (read as {name!r})"
        raise CheckpointError(f"tensor {named} is missing from the checkpoint (needed to check {source}'s {keys})")
    if entry.shape != shape:
        raise CheckpointError(
            f"{entry.file.name}: tensor {label(name, entry)} has shape {list(entry.shape)}, config.json implies {list(shape)} "
            f"(from {keys} in {source})"
        )
