"""Synthesized checkpoints: complete, loadable by transformers, deterministic, correctly sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qcompile.errors import ArtifactError
from qcompile.io.safetensors_stream import OutputTensor
from qcompile.source.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from qcompile.source.model import expected_tensors
from qcompile.synth import checkpoint as synth_checkpoint
from qcompile.synth import plan_checkpoint, write_checkpoint
from qcompile.synth.weights import CHUNK_ELEMENTS, chunks_of, random_chunk

TINY_FIXTURES = ["tiny_ckpt", "tiny_tied_ckpt", "tiny_moe_ckpt", "tiny_odd_ckpt"]


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            out.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return out


def _weight_bytes(ckpt: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(ckpt.glob("*.safetensors"))}


@pytest.mark.parametrize("fixture", TINY_FIXTURES)
def test_checkpoint_is_complete(fixture, request):
    ckpt = request.getfixturevalue(fixture)
    checkpoint = Checkpoint.open(ckpt)  # the compiler's own validation: every tensor, shape, dtype
    assert checkpoint.unused == ()
    assert set(checkpoint.tensors) == set(expected_tensors(checkpoint.spec))
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert not any(name.startswith(".") for name in names)


@pytest.mark.parametrize("fixture", TINY_FIXTURES)
def test_transformers_loads_and_runs(fixture, request):
    from transformers import AutoModelForCausalLM

    ckpt = request.getfixturevalue(fixture)
    config = json.loads((ckpt / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == config["architectures"][0]
    assert model.dtype == torch.bfloat16
    tensors = _tensors(ckpt)
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert torch.equal(state[name], tensors[name])
    if config["tie_word_embeddings"]:
        assert "lm_head.weight" not in tensors
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    if "num_experts" in config:  # transformers fuses the experts on load; ours must land in place
        experts = model.model.layers[0].mlp.experts
        gate, up = (tensors[f"model.layers.0.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(experts.gate_up_proj[3], torch.cat([gate, up]))
        assert torch.equal(experts.down_proj[3], tensors["model.layers.0.mlp.experts.3.down_proj.weight"])

    input_ids = torch.randint(0, config["vocab_size"], (2, 7))
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (2, 7, config["vocab_size"])
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0.01  # random weights still give position-dependent outputs


def test_values_follow_the_init_rules(tiny_moe_ckpt):
    for name, tensor in _tensors(tiny_moe_ckpt).items():
        values = tensor.float()
        assert tensor.dtype == torch.bfloat16
        assert values.std() > 0, name  # never constant, never all zeros
        if name.endswith("norm.weight"):
            assert values.mean() == pytest.approx(1.0, abs=0.03), name
        else:
            assert values.mean() == pytest.approx(0.0, abs=0.01), name
            assert values.std() == pytest.approx(0.02, rel=0.15), name


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_ckpt, make_ckpt, tmp_path):
    again = write_checkpoint("tiny", tmp_path / "again", seed=0, threads=3)  # thread count must not matter
    assert _weight_bytes(again.path) == _weight_bytes(tiny_ckpt)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again.path / name).read_bytes() == (tiny_ckpt / name).read_bytes()
    other = _tensors(make_ckpt("tiny", seed=1))
    for name, tensor in _tensors(tiny_ckpt).items():
        assert not torch.equal(tensor, other[name]), name


def test_distinct_tensors_get_distinct_values(tiny_ckpt):
    tensors = _tensors(tiny_ckpt)
    k0, v0 = tensors["model.layers.0.self_attn.k_proj.weight"], tensors["model.layers.0.self_attn.v_proj.weight"]
    assert not torch.equal(k0, v0)
    assert not torch.equal(k0, tensors["model.layers.1.self_attn.k_proj.weight"])


def test_chunks_are_reproducible_on_their_own():
    """A chunk's values depend on (seed, name, chunk) only, so chunks can be made in any order."""
    rows = CHUNK_ELEMENTS // 64
    tensor = OutputTensor("model.embed_tokens.weight", torch.bfloat16, (2 * rows + 5, 64))
    chunks = list(chunks_of(tensor))
    assert [offset for _, offset in chunks] == [0, rows * 128, 2 * rows * 128]
    last = random_chunk(tensor, 7, 2)
    assert last.shape == (5, 64)
    assert torch.equal(last, random_chunk(tensor, 7, 2))
    assert not torch.equal(random_chunk(tensor, 7, 0)[:5], last)


def test_small_shards_get_a_valid_index(make_ckpt, tiny_moe_ckpt, tmp_path):
    result = write_checkpoint("tiny-moe", tmp_path / "sharded", max_shard_bytes=60_000)
    ckpt = result.path
    assert result.shards > 3
    assert not (ckpt / SINGLE_FILE).exists()
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{result.shards:05d}.safetensors" for i in range(1, result.shards + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = _tensors(ckpt)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == result.weight_bytes
    for shard in shards[:-1]:  # each file stays under the limit unless one tensor alone exceeds it
        with safe_open(ckpt / shard, "pt") as handle:
            names = list(handle.keys())  # noqa: SIM118
            size = sum(tensors[n].numel() * 2 for n in names)
            assert size <= 60_000 or len(names) == 1
    Checkpoint.open(ckpt)
    # sharding changes the files, never the values
    single = _tensors(tiny_moe_ckpt)
    assert all(torch.equal(tensors[name], single[name]) for name in single)


def test_refuses_when_the_disk_is_too_small(monkeypatch, tmp_path):
    class Usage:
        total, used, free = 10**12, 10**12 - 1000, 1000

    monkeypatch.setattr(synth_checkpoint.shutil, "disk_usage", lambda path: Usage())
    with pytest.raises(ArtifactError, match=r"needs \d+\.\d+ MB of free disk space but only 1\.00 kB is free"):
        write_checkpoint("tiny", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tiny_ckpt, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(ArtifactError, match="already exists"):
        write_checkpoint("tiny", target)
    write_checkpoint("tiny", target, force=True)
    assert not (target / "old.txt").exists()
    assert _weight_bytes(target) == _weight_bytes(tiny_ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_config_dict_with_overrides(make_ckpt):
    ckpt = make_ckpt("tiny", num_hidden_layers=3, intermediate_size=96)
    checkpoint = Checkpoint.open(ckpt)
    assert checkpoint.spec.num_hidden_layers == 3
    assert checkpoint.entry("model.layers.2.mlp.up_proj.weight").shape == (96, 64)


def test_plan_refuses_a_bad_shard_size():
    with pytest.raises(ArtifactError, match="positive"):
        plan_checkpoint("tiny", max_shard_bytes=0)


def test_big_plans_are_cheap():
    """Planning the 235B model (36k tensors) is instant and splits it into ~5 GB shards."""
    plan = plan_checkpoint("qwen3-235b-a22b")
    assert len(plan.weight_map()) == len(expected_tensors(plan.spec))
    fewest = -(-plan.weight_bytes // 5_000_000_000)
    assert fewest <= len(plan.shards) <= fewest + 1
    assert max(s.nbytes for s in plan.shards) <= 5_000_000_000
