"""`qruntime.load` on broken artifacts: every fault refused with a message naming it, nothing left
behind that breaks the next load; and a CPU engine's FP8 weights map the shard file (zero copy).

What load checks: without verify, that every file the manifest lists exists with its size (cheap);
only verify=True reads every byte and compares sha256, so a same-size corruption of a shard loads
without it (the test below shows the engine then really sees the changed byte)."""

import json
import os
import random
import re
import shutil
import time

import onnx
import pytest
import qruntime
import torch
from qruntime.artifact import ArtifactFormatError, sha256_file
from safetensors.torch import load_file

SMALL_CACHE = {"num_kv_blocks": 64}


@pytest.fixture(scope="module")
def art(compiled, tiny_ckpt):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture
def copy(art, tmp_path):
    """A private copy of the artifact to break."""
    return shutil.copytree(art, tmp_path / "art")


def manifest(root):
    return json.loads((root / "manifest.json").read_text())


def edit_manifest(root, change):
    data = manifest(root)
    change(data)
    (root / "manifest.json").write_text(json.dumps(data))


def refresh_entry(root, rel):
    """Record a file's new size and sha256 in the manifest, as if the compiler had written it."""

    def change(data):
        data["files"][rel] = {"sha256": sha256_file(root / rel), "bytes": (root / rel).stat().st_size}

    edit_manifest(root, change)


def the_shard(root):
    (shard,) = (root / "weights").glob("*.safetensors")
    return shard


def test_unknown_format_version_names_both(copy):
    version = f"{random.randint(2, 99)}.0"
    edit_manifest(copy, lambda m: m.update(format_version=version))
    with pytest.raises(ArtifactFormatError, match=rf"format_version '{re.escape(version)}' .* reads format 1\.0"):
        qruntime.load(copy, **SMALL_CACHE)


def test_missing_shard_is_named(copy):
    shard = the_shard(copy)
    shard.unlink()
    with pytest.raises(ArtifactFormatError, match=rf"does not match its manifest:\n  weights/{shard.name}: missing"):
        qruntime.load(copy, **SMALL_CACHE)


def test_truncated_shard_size_mismatch(copy):
    shard = the_shard(copy)
    data = shard.read_bytes()
    cut = random.randint(1, len(data) // 2)
    shard.write_bytes(data[:-cut])
    message = f"weights/{shard.name}: size {len(data) - cut} != manifest {len(data)}"
    with pytest.raises(ArtifactFormatError, match=re.escape(message)):
        qruntime.load(copy, **SMALL_CACHE)


def test_flipped_byte_only_verify_notices(copy):
    shard = the_shard(copy)
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    at = random.randrange(header, len(data))  # a byte of tensor data, same file size
    data[at] ^= 1 << random.randrange(8)
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ArtifactFormatError, match=re.escape(f"weights/{shard.name}: sha256 does not match the manifest")
    ):
        qruntime.load(copy, verify=True, **SMALL_CACHE)

    # without verify only sizes are checked: the engine loads and reads the changed byte
    engine = qruntime.load(copy, "cpu", **SMALL_CACHE)
    fp8 = next(w for w in engine.runner.plan.weights.values() if w.dtype == torch.float8_e4m3fn)
    mapped = torch.empty(0, dtype=torch.uint8).set_(fp8.untyped_storage())
    assert int(mapped[at]) == data[at]


def test_garbage_graph(copy):
    (copy / "graph.onnx").write_bytes(b"this is not ONNX" + os.urandom(random.randint(16, 4096)))
    refresh_entry(copy, "graph.onnx")  # the files match the manifest: the fault is the content
    with pytest.raises(ArtifactFormatError, match=re.escape(f"{copy / 'graph.onnx'}: cannot be read as ONNX")):
        qruntime.load(copy, **SMALL_CACHE)


def test_unknown_op_names_node_and_type(copy):
    model = onnx.load(str(copy / "graph.onnx"), load_external_data=False)
    node = random.choice(list(model.graph.node))
    node.op_type = "NoSuchOp"
    (copy / "graph.onnx").write_bytes(model.SerializeToString())
    refresh_entry(copy, "graph.onnx")
    where = f"graph.onnx node {node.name!r} ({node.domain or 'ai.onnx'}::NoSuchOp): no implementation of this op"
    with pytest.raises(ArtifactFormatError, match=re.escape(where)):
        qruntime.load(copy, **SMALL_CACHE)


def test_tp_other_than_the_artifacts_names_both(art):
    tp = random.choice([2, 4, 8])
    with pytest.raises(ValueError, match=rf"tp={tp} was asked for but .* is sharded for tp=1: load it with tp=1"):
        qruntime.load(art, tp=tp, **SMALL_CACHE)


def test_tp_manifest_without_a_graph_per_rank(copy):
    edit_manifest(copy, lambda m: m.update(tp=2))  # graph still {"file": "graph.onnx"}
    with pytest.raises(
        ArtifactFormatError, match=r"graph.files must be a list of 2 graph files \(one per rank at tp=2\)"
    ):
        qruntime.load(copy, **SMALL_CACHE)


def test_bad_dtype(art):
    with pytest.raises(
        ValueError, match=re.escape("dtype 'int8' is not one of ['bf16', 'bfloat16', 'float16', 'float32']")
    ):
        qruntime.load(art, dtype="int8", **SMALL_CACHE)


def test_max_model_len_beyond_context(art):
    context = manifest(art)["spec"]["max_position_embeddings"]
    too_long = context + random.randint(1, 1000)
    message = f"max_model_len {too_long} must be in 2..{context} (the model's context)"
    with pytest.raises(ValueError, match=re.escape(message)):
        qruntime.load(art, max_model_len=too_long, **SMALL_CACHE)


def test_kv_cache_too_small_says_what_to_change(art):
    with pytest.raises(ValueError) as info:
        qruntime.load(art, max_model_len=64, num_kv_blocks=1)
    message = str(info.value)
    assert "holds 16 tokens (1 block(s) of 16), less than max_model_len 64" in message
    assert "give more num_kv_blocks / kv_cache_memory or a smaller max_model_len" in message
    engine = qruntime.load(art, max_model_len=64, num_kv_blocks=4)  # exactly enough
    assert engine.description["max_model_len"] == 64 and "4 blocks x 16" in engine.description["kv_cache"]


def test_load_says_where_its_time_went(art):
    """description["load_seconds"]: each phase of the load (imports, setup, weights, plan, kernels,
    cache and graphs, rest) in order, none negative, adding up to the total, which is within the wall time of load()."""
    start = time.perf_counter()
    engine = qruntime.load(art, **SMALL_CACHE)
    wall = time.perf_counter() - start
    phases = engine.description["load_seconds"]
    print(phases)
    assert list(phases) == ["imports", "setup", "weights", "plan", "kernels", "cache_and_graphs", "rest", "total"]
    parts = [v for k, v in phases.items() if k != "total"]
    assert all(v >= 0 for v in parts)
    assert sum(parts) == pytest.approx(phases["total"], abs=0.005)
    assert 0 < phases["total"] <= wall + 0.0005  # rounded to the millisecond


def test_failed_loads_leave_no_trace(art, copy):
    prompt = [random.randrange(500) for _ in range(random.randint(2, 12))]
    params = qruntime.SamplingParams(max_tokens=6, ignore_eos=True)
    before = qruntime.load(art, "cpu", **SMALL_CACHE).generate(prompt, params)[0]

    model = onnx.load(str(copy / "graph.onnx"), load_external_data=False)
    model.graph.node[-1].op_type = "NoSuchOp"  # fails after the weights are mapped
    (copy / "graph.onnx").write_bytes(model.SerializeToString())
    refresh_entry(copy, "graph.onnx")
    failures = [
        ({"path": copy}, ArtifactFormatError, "::NoSuchOp\\): no implementation of this op"),
        ({"path": art, "dtype": "int8"}, ValueError, "dtype 'int8' is not one of"),
        ({"path": art, "num_kv_blocks": 1}, ValueError, "the KV cache holds 16 tokens"),
    ]
    for kwargs, error, match in failures:
        with pytest.raises(error, match=match):
            qruntime.load(**{"max_model_len": 64, **SMALL_CACHE, **kwargs})

    after = qruntime.load(art, "cpu", **SMALL_CACHE).generate(prompt, params)[0]
    assert after.token_ids == before.token_ids and len(after.token_ids) == 6


def test_cpu_fp8_weights_map_the_shard(art):
    engine = qruntime.load(art, "cpu", **SMALL_CACHE)
    shard = the_shard(art)
    size = shard.stat().st_size
    stored = load_file(shard)
    fp8 = {name: w for name, w in engine.runner.plan.weights.items() if w.dtype == torch.float8_e4m3fn}
    expected = {name for name, info in manifest(art)["tensors"].items() if info["dtype"] == "F8_E4M3"}
    assert set(fp8) == expected and expected
    storages = {w.untyped_storage().data_ptr() for w in fp8.values()}
    assert len(storages) == 1  # one mapping of the file, every weight a view into it
    for name, w in fp8.items():
        assert w.untyped_storage().nbytes() == size, name
        assert torch.equal(w.view(torch.uint8), stored[name].view(torch.uint8)), name


def test_load_initializers_reads_the_files_or_makes_them_and_needs_a_root_to_read(art):
    from qruntime.weights import load_initializers, runtime_dtype

    graph = onnx.load(str(art / "graph.onnx"), load_external_data=False).graph
    read = load_initializers(art, graph, torch.device("cpu"), torch.float32)
    seen = []

    def make(init, dtype):
        seen.append((init.name, dtype))
        return torch.full(list(init.dims), 2.0).to(dtype)

    made = load_initializers(None, graph, torch.device("cpu"), torch.float32, external=make)
    assert read.keys() == made.keys() and len(seen) > 0
    for name, dtype in seen:  # made in place of the file bytes, then in the same run-time dtype
        assert made[name].dtype == read[name].dtype == runtime_dtype(dtype, torch.float32)
        assert made[name].shape == read[name].shape and not torch.equal(made[name], read[name])
    for name in read.keys() - {name for name, _ in seen}:  # inline constants: read either way
        assert torch.equal(made[name], read[name])
    with pytest.raises(ValueError, match="needs the artifact's root"):
        load_initializers(None, graph, torch.device("cpu"), torch.float32)
