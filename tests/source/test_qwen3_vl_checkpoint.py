"""Qwen3-VL checkpoints read under Qwen3's names (qcompile.source.qwen3_vl, qwen3_vl_spec).

Tiny random Qwen3VLForConditionalGeneration (tied head) and Qwen3VLMoeForConditionalGeneration (own
head, layer 1 dense among sparse ones) saved by transformers 5.17's save_pretrained, plus the MoE one
rewritten with its stacked experts transposed ([E, H, 2I] / [E, I, H], as the published checkpoints
store them). Every tensor the compiler reads, whole and by random row ranges, must equal the
transformers model's parameter slice exactly; broken checkpoints and configs are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from qwen3_vl_checkpoints import MOE, VISION, write_checkpoint
from qwen3_vl_checkpoints import TEXT as BASE_TEXT
from qwen3_vl_checkpoints import TOKEN_IDS as IDS
from safetensors.torch import load_file, save_file

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.errors import CheckpointError
from qcompile.recipe.schema import load_recipe
from qcompile.source.checkpoint import Checkpoint
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec

# the shared tiny model, with a norm epsilon, context and rope theta of its own (so the spec's fields
# are seen to come from this config, not from defaults)
TEXT_OVERRIDES = dict(
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    rope_parameters=dict(rope_type="default", rope_theta=20000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
)
TEXT = dict(BASE_TEXT, **TEXT_OVERRIDES)
# 2 * moe_intermediate_size != hidden_size: the transposed layout is told apart by its shape
MOE_TEXT = dict(TEXT, **MOE)
STACKED = ".mlp.experts."


@pytest.fixture(scope="module", params=["dense", "moe", "moe-transposed"])
def saved(request, tmp_path_factory):
    """(checkpoint dir, transformers state_dict): dense tied, MoE untied, MoE with transposed experts."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(path, "dense" if request.param == "dense" else "moe", text=TEXT_OVERRIDES)
    if request.param == "moe-transposed":
        tensors = load_file(path / "model.safetensors")
        swapped = {k: v.transpose(1, 2).contiguous() if STACKED in k else v for k, v in tensors.items()}
        assert any(swapped[k].shape != tensors[k].shape for k in tensors)
        save_file(swapped, path / "model.safetensors", metadata={"format": "pt"})
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _want(name: str, state: dict[str, torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """The transformers parameter (slice) a Qwen3 name of the view stands for."""
    parts = name.split(".")
    if STACKED in name and len(parts) == 8:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
        layer, expert, proj = parts[2], int(parts[5]), parts[6]
        inter = spec.moe.moe_intermediate_size
        prefix = f"model.language_model.layers.{layer}.mlp.experts."
        if proj == "down_proj":
            return state[prefix + "down_proj"][expert]
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return state[prefix + "gate_up_proj"][expert, rows]
    if name.startswith("model.") and not name.startswith("model.visual."):
        return state["model.language_model." + name[len("model.") :]]
    return state[name]


def test_spec_fields_equal_the_config(saved):
    path, _ = saved
    config = json.loads((path / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    spec = Checkpoint.open(path).spec
    assert spec.architecture == config["architectures"][0]
    assert spec.dtype == "float32"  # save_pretrained writes the top-level dtype
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(spec, key) == text[key], key
    assert (spec.head_dim, spec.intermediate_size) == (text["head_dim"], text["intermediate_size"])
    assert (spec.rms_norm_eps, spec.max_position_embeddings) == (1e-5, 2048)
    assert spec.rope_theta == 20000.0
    assert spec.tie_word_embeddings == config["tie_word_embeddings"]
    assert spec.tie_word_embeddings == (config["model_type"] == "qwen3_vl")
    v = spec.vision
    assert v.mrope_section == (4, 2, 2)
    assert (v.image_token_id, v.video_token_id, v.vision_start_token_id) == (120, 121, 122)
    assert (v.spatial_merge_size, v.deepstack_layers) == (2, 2)
    assert json.loads(v.tower_config) == vision
    if config["model_type"] == "qwen3_vl":
        assert spec.moe is None
    else:
        assert spec.moe.num_experts == 4 and spec.moe.num_experts_per_tok == 2
        assert spec.moe.moe_intermediate_size == 20 and spec.moe.norm_topk_prob
        assert spec.moe.mlp_only_layers == (1,) and spec.moe.decoder_sparse_step == 1
        assert [spec.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_every_tensor_reads_as_the_transformers_parameter(saved, rng):
    path, state = saved
    ckpt = Checkpoint.open(path)
    spec = ckpt.spec
    assert ckpt.source_shapes() == expected_tensors(spec)  # the text graph's sources, Qwen3's names
    tower = ckpt.tower_tensors()
    assert set(tower) == {k for k in state if k.startswith("model.visual.")}
    assert len(tower) > 30
    for name, shape in [*expected_tensors(spec).items(), *((n, e.shape) for n, e in tower.items())]:
        entry = ckpt.entry(name)
        want = _want(name, state, spec)
        assert entry.shape == shape == tuple(want.shape), name
        assert entry.row_bytes * shape[0] == want.numel() * want.element_size(), name  # what chunking counts
        assert torch.equal(entry.read(), want), name
        for _ in range(2):  # row ranges, as the writer reads them
            start = rng.randrange(shape[0])
            stop = rng.randrange(start + 1, shape[0] + 1)
            assert torch.equal(entry.read_rows(start, stop), want[start:stop]), (name, start, stop)


def _copy(path: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _stacked_of(proj: str, layer: int = 0) -> str:
    return f"model.language_model.layers.{layer}.mlp.experts.{proj}"


def _drop_down(tensors):
    del tensors[_stacked_of("down_proj")]


def _extra_text(tensors):
    tensors["model.language_model.layers.0.mlp.extra.weight"] = torch.ones(3)


def _extra_tower(tensors):
    tensors["model.visual.blocks.0.extra.bias"] = torch.ones(3)


def _outside(tensors):
    tensors["model.embed_tokens.weight"] = tensors.pop("model.language_model.embed_tokens.weight")


def _bad_stacked(tensors):
    name = _stacked_of("gate_up_proj", 2)
    tensors[name] = tensors[name][:, :-1].contiguous()


def _experts_in_dense_layer(tensors):
    for proj in ("gate_up_proj", "down_proj"):
        tensors[_stacked_of(proj, 1)] = tensors[_stacked_of(proj, 0)].clone()


def _missing_embed(tensors):
    del tensors["model.language_model.embed_tokens.weight"]


def _bad_norm(tensors):
    tensors["model.language_model.layers.2.self_attn.q_norm.weight"] = torch.ones(15)


def _bad_tower(tensors):
    tensors["model.visual.merger.linear_fc2.bias"] = torch.ones(47)


def _missing_tower(tensors):
    del tensors["model.visual.deepstack_merger_list.1.norm.weight"]


@pytest.mark.parametrize("saved", ["moe", "moe-transposed"], indirect=True)  # the ones with stacked experts
@pytest.mark.parametrize(
    "edit, message",
    [
        (
            _drop_down,
            r"tensor 'model.language_model.layers.0.mlp.experts.down_proj' \(read as "
            r"'model.layers.0.mlp.experts.0.down_proj.weight'\) is missing",
        ),
        (_extra_text, r"unexpected tensor 'model.language_model.layers.0.mlp.extra.weight' \(read as 'model.layers"),
        (_extra_tower, "unexpected tensor 'model.visual.blocks.0.extra.bias'"),
        (_outside, "unexpected tensor 'model.embed_tokens.weight' for Qwen3VLMoeForConditionalGeneration"),
        (
            _bad_stacked,
            r"tensor 'model.language_model.layers.2.mlp.experts.gate_up_proj' has shape \[4, (39, 48|47, 40)\], "
            r"config.json implies \[4, 40, 48\] \(or \[4, 48, 40\] stored transposed\)",
        ),
        (
            _experts_in_dense_layer,
            r"unexpected tensor 'model.language_model.layers.1.mlp.experts.(gate_up|down)_proj' \(read as "
            r"'model.layers.1.mlp.experts.0.",
        ),
        (
            _bad_norm,
            r"tensor 'model.language_model.layers.2.self_attn.q_norm.weight' \(read as "
            r"'model.layers.2.self_attn.q_norm.weight'\) has shape \[15\], config.json implies \[16\]",
        ),
        (
            _missing_embed,
            r"tensor 'model.language_model.embed_tokens.weight' \(read as 'model.embed_tokens.weight'\) is missing",
        ),
        (_bad_tower, r"tensor 'model.visual.merger.linear_fc2.bias' has shape \[47\], config.json implies \[48\]"),
        (_missing_tower, "tensor 'model.visual.deepstack_merger_list.1.norm.weight' is missing"),
    ],
)
def test_broken_checkpoints_are_refused_by_name(saved, tmp_path, edit, message):
    path = _copy(saved[0], tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint.open(path)


@pytest.mark.parametrize("saved", ["dense"], indirect=True)
def test_experts_in_a_dense_model_are_refused(saved, tmp_path):
    def add(tensors):
        tensors["model.language_model.layers.0.mlp.experts.down_proj"] = torch.ones(2, 48, 8)

    with pytest.raises(
        CheckpointError, match="unexpected tensor 'model.language_model.layers.0.mlp.experts.down_proj'"
    ):
        Checkpoint.open(_copy(saved[0], tmp_path, add))


def _config(moe: bool = False) -> dict:
    text = dict(MOE_TEXT if moe else TEXT, model_type="qwen3_vl_moe_text" if moe else "qwen3_vl_text")
    text["rope_parameters"] = dict(text["rope_parameters"])
    return {
        "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "text_config": text,
        "vision_config": dict(VISION, hidden_act="gelu_pytorch_tanh"),
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        **IDS,
    }


def test_config_spellings():
    """rope_scaling + rope_theta (the published checkpoints' spelling), text_config's dtype first."""
    config = _config(moe=True)
    text = config["text_config"]
    text["rope_scaling"] = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text["rope_theta"] = 5e6
    del text["rope_parameters"]
    text["dtype"] = "float16"
    spec = ModelSpec.from_config(config)
    assert spec.rope_theta == 5e6 and spec.dtype == "float16" and spec.vision.mrope_section == (4, 2, 2)
    del text["dtype"], config["dtype"]
    config["torch_dtype"] = "float32"
    assert ModelSpec.from_config(config).dtype == "float32"
    del config["torch_dtype"]
    assert ModelSpec.from_config(config).dtype == "bfloat16"


def _edit(config: dict, path: str, value) -> dict:
    *keys, last = path.split(".")
    node = config
    for key in keys:
        node = node[key]
    node[last] = value
    return config


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("text_config.rope_parameters.mrope_interleaved", False, "mrope_interleaved"),
        ("text_config.rope_parameters.mrope_section", [4, 2, 3], "mrope_section"),
        ("model_type", "qwen3_vl_next", "model_type"),
        ("text_config.attention_bias", True, "attention_bias"),
        ("text_config.num_hidden_layers", 1, "deepstack_visual_indexes"),
        ("text_config.max_position_embeddings", 0, "'max_position_embeddings'"),
        ("vision_config.out_hidden_size", 40, "out_hidden_size"),
        ("image_token_id", 500, "image_token_id"),
        ("text_config.rope_parameters.rope_type", "yarn", "rope_type"),
        ("dtype", "int8", "dtype"),
    ],
)
def test_config_refusals_name_the_key(path, value, message):
    with pytest.raises(CheckpointError, match=f"^config.json[: ].*{message}"):
        ModelSpec.from_config(_edit(_config(), path, value))


def test_architecture_and_model_type_must_agree():
    config = _config()
    config["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    with pytest.raises(CheckpointError, match="'model_type' is 'qwen3_vl'.*'qwen3_vl_moe'"):
        ModelSpec.from_config(config)


@pytest.mark.parametrize("saved", ["moe", "moe-transposed"], indirect=True)
def test_the_writer_reads_the_view_unchanged(saved, tmp_path):
    """A bf16 compile (the writer's own reads, by row chunks) writes each sparse layer's fused experts
    as transformers' stacked tensors, whichever layout the checkpoint stores them in."""
    path, state = saved
    prepared = prepare(path, load_recipe("bf16"), calibrate=False, tokenizer=False)
    compile_checkpoint(prepared, tmp_path / "artifact", progress=False)
    written: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "artifact").rglob("*.safetensors")):
        written.update(load_file(shard))
    for layer in (0, 2):
        stacked = f"model.language_model.layers.{layer}.mlp.experts."
        assert torch.equal(written[f"model.layers.{layer}.mlp.experts.w13.weight"], state[stacked + "gate_up_proj"])
        assert torch.equal(written[f"model.layers.{layer}.mlp.experts.w2.weight"], state[stacked + "down_proj"])
    same = [name for name in written if name in expected_tensors(prepared.checkpoint.spec)]
    assert len(same) > 20
    for name in same:
        assert torch.equal(written[name], _want(name, state, prepared.checkpoint.spec)), name


@pytest.mark.parametrize("saved", ["moe-transposed"], indirect=True)
def test_a_sharded_checkpoint_reads_the_same(saved, tmp_path):
    """Two shards and an index naming the stored tensors: the same view, the same bytes."""
    path, _ = saved
    out = tmp_path / "sharded"
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, out / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    one, two = Checkpoint.open(path), Checkpoint.open(out)
    assert len(two.shards) == 2 and one.tensors.keys() == two.tensors.keys()
    for name in one.tensors:
        assert torch.equal(one.entry(name).read(), two.entry(name).read()), name
