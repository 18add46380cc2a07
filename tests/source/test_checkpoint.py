"""The dry run over every shard header: complete checkpoints open, broken ones are named."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qcompile.errors import CheckpointError
from qcompile.source.checkpoint import Checkpoint, fingerprint
from qcompile.source.model import expected_tensors
from qcompile.synth import get_preset, write_checkpoint


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    """A private, writable copy of the tiny dense checkpoint (single file)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, path)
    return path


@pytest.fixture
def sharded(tmp_path):
    """tiny-moe written in several shards with an index."""
    path = tmp_path / "sharded"
    write_checkpoint(get_preset("tiny-moe").config(), path, seed=1, max_shard_bytes=100_000)
    return path


def _rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_opens_dense_moe_tied(tiny_ckpt, tiny_moe_ckpt, tiny_tied_ckpt, sharded):
    for path in (tiny_ckpt, tiny_moe_ckpt, tiny_tied_ckpt, sharded):
        ckpt = Checkpoint.open(path)
        assert set(ckpt.tensors) == set(expected_tensors(ckpt.spec))
        assert ckpt.unused == ()
    assert len(Checkpoint.open(sharded).shards) > 1
    assert "lm_head.weight" not in Checkpoint.open(tiny_tied_ckpt).tensors


def test_fingerprint_changes_with_a_byte(ckpt):
    before = fingerprint(Checkpoint.open(ckpt))
    assert before == fingerprint(Checkpoint.open(ckpt))
    _rewrite(ckpt, lambda t: t["model.norm.weight"].mul_(2))
    assert fingerprint(Checkpoint.open(ckpt)) != before


def test_missing_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    with pytest.raises(CheckpointError, match=f"{victim}: shard listed in model.safetensors.index.json is missing"):
        Checkpoint.open(sharded)


def test_truncated_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sharded / sorted(set(index["weight_map"].values()))[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{victim.name}: truncated file: tensor"):
        Checkpoint.open(sharded)


def test_tensor_in_two_shards(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    a = load_file(sharded / first)
    b = load_file(sharded / second)
    name = next(iter(a))
    b[name] = a[name]
    save_file(b, sharded / second)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is duplicated: in {first} and in {second}"):
        Checkpoint.open(sharded)


def test_wrong_dtype(ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name].to(torch.float16)))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor '{name}' is F16, config.json says bfloat16"):
        Checkpoint.open(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' has shape \[64, 127\], config.json implies \[64, 128\]"
    ):
        Checkpoint.open(ckpt)


def test_missing_and_unexpected_tensor(ckpt, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(CheckpointError, match="'model.layers.1.post_attention_layernorm.weight' is missing"):
        Checkpoint.open(ckpt)
    _rewrite(
        other, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.ones(64, dtype=torch.bfloat16))
    )
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        Checkpoint.open(other)


def test_config_errors(ckpt):
    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(
        CheckpointError, match="'MistralForCausalLM' is not supported; supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM"
    ):
        Checkpoint.open(ckpt)
    config_path.write_text(json.dumps(config)[:-5])
    with pytest.raises(CheckpointError, match="config.json: malformed JSON"):
        Checkpoint.open(ckpt)
    config_path.unlink()
    with pytest.raises(CheckpointError, match="config.json: not found"):
        Checkpoint.open(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "weights-a.safetensors")
    with pytest.raises(CheckpointError, match="found weights-a.safetensors but no model.safetensors.index.json"):
        Checkpoint.open(ckpt)
    (ckpt / "weights-a.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint.open(ckpt)
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        Checkpoint.open(ckpt / "nowhere")


def test_tied_checkpoint_with_lm_head_is_noted(tiny_tied_ckpt, tmp_path, caplog):
    path = tmp_path / "tied"
    shutil.copytree(tiny_tied_ckpt, path)
    _rewrite(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    with caplog.at_level(logging.WARNING):
        ckpt = Checkpoint.open(path)
    assert ckpt.unused == ("lm_head.weight",)
    assert "tie_word_embeddings=true" in caplog.text


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        (None, {}),
        ("---\nlicense: apache-2.0\ntags: [a]\n---\n# model\n", {"license": "apache-2.0"}),
        (
            "---\nlicense: other\nlicense_name: qwen\nlicense_link: https://example.com/LICENSE\n---\ntext\n",
            {"license": "other", "license_name": "qwen", "license_link": "https://example.com/LICENSE"},
        ),
        ("# no front matter\nlicense: mit\n", {}),
        ("---\nlicense: mit\n", {}),  # no closing line
        ("---\nlicense: [unclosed\n---\n", {}),  # not YAML
        ("---\n- a list\n---\n", {}),
    ],
)
def test_license_from_the_model_card(ckpt, card, expected):
    if card is not None:
        (ckpt / "README.md").write_text(card, encoding="utf-8")
    assert Checkpoint.open(ckpt).license() == expected


def test_license_files_are_side_files(ckpt):
    (ckpt / "LICENSE").write_text("terms\n")
    (ckpt / "LICENSE.md").write_text("more terms\n")
    (ckpt / "LICENSES").mkdir()  # a directory is not copied
    names = [p.name for p in Checkpoint.open(ckpt).side_files()]
    assert names[-2:] == ["LICENSE", "LICENSE.md"] and "LICENSES" not in names and "README.md" not in names
