"""`qcompile compile --tp N` end to end: every rank's tensor an exact slice of the tp=1 artifact's
(every scheme, dense and MoE, fused and unfused), rank graphs pointing at their own bytes, the ranks'
partial outputs summing to the tp=1 output, inspect / verify / tune / publish on a sharded artifact,
and the refusals (a model that does not split, block scales off the grid) that leave nothing behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper
from qruntime.artifact import read_manifest
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.ops import collective
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from qruntime.ops.registry import reference_ops
from qruntime.plan import Plan
from qruntime.weights import load_initializers
from safetensors.torch import load_file

from qcompile.cli import main
from qcompile.compile import writer
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.errors import ArtifactError
from qcompile.graph.ops import COLLECTIVE_OPS
from qcompile.graph.schemas import deregister_op_schemas, register_op_schemas
from qcompile.io.safetensors_stream import TensorEntry
from qcompile.publish.unfuse import split_to_sources
from qcompile.recipe.schema import load_recipe
from qcompile.tune.gemm import gemm_shapes

BLOCK = 16
CPU = torch.device("cpu")
# head_dim 128 and intermediate sizes of 256: the 128 x 128 blocks of block-fp8 split 2 ways
ALIGNED = {"hidden_size": 128, "head_dim": 128, "intermediate_size": 256}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def _whole(art: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a tp=1 artifact."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted((art / "weights").glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _rank_files(art: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    ranks = []
    for rank in range(tp):
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted((art / "weights" / f"rank{rank}").glob("*.safetensors")):
            tensors.update(load_file(file))
        ranks.append(tensors)
    return ranks


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def check_slices(whole_art: Path, art: Path, tp: int) -> dict:
    """Every rank's tensor is the slice its manifest entry names of the tp=1 tensor, byte for byte."""
    whole, manifest = _whole(whole_art), read_manifest(art)
    ranks = _rank_files(art, tp)
    assert manifest["tp"] == tp and set(manifest["tensors"]) == set(whole)
    for rank in ranks:
        assert set(rank) == set(whole)  # the tp=1 names, each once per rank
    for name, info in manifest["tensors"].items():
        assert "file" not in info and list(info["shape"]) == list(whole[name].shape)
        assert len(info["ranks"]) == tp
        for r, entry in enumerate(info["ranks"]):
            assert entry["file"].startswith(f"weights/rank{r}/")
            want = whole[name]
            if info["axis"] is not None:
                want = torch.cat([want.narrow(info["axis"], b, e - b) for b, e in entry["spans"]], info["axis"])
            else:
                assert "spans" not in entry
            got = ranks[r][name]
            assert list(got.shape) == entry["shape"] == list(want.shape), name
            assert got.dtype == want.dtype and _bytes(got) == _bytes(want), f"{name} rank {r}"
    return manifest


def check_graphs(art: Path, manifest: dict) -> None:
    """graph.rank{r}.onnx: checker-clean, its initializers exactly rank r's bytes, two collectives per layer."""
    tp, layers = manifest["tp"], manifest["spec"]["num_hidden_layers"]
    assert manifest["graph"]["files"] == [f"graph.rank{r}.onnx" for r in range(tp)] and "file" not in manifest["graph"]
    ranks = _rank_files(art, tp)
    register_op_schemas()
    try:
        for rank, file in enumerate(manifest["graph"]["files"]):
            onnx.checker.check_model(str(art / file), full_check=True, check_custom_domain=True)
            model = onnx.load(str(art / file))  # reads every weight through its external data entry
            locations = {
                init.name: {e.key: e.value for e in init.external_data}["location"]
                for init in onnx.load(str(art / file), load_external_data=False).graph.initializer
                if init.external_data
            }
            props = {p.key: p.value for p in model.metadata_props}
            assert (props["rank"], props["tp"]) == (str(rank), str(tp))
            ops = [node.op_type for node in model.graph.node]
            # two sums a layer, and the gather of a vocabulary-parallel lm_head's logits
            gathers = int(manifest["tensors"].get("lm_head.weight", {}).get("axis") == 0)
            assert sum(op in COLLECTIVE_OPS for op in ops) == 2 * layers + gathers
            assert ops.count("AllGather") == gathers
            read = 0
            for init in model.graph.initializer:
                if init.name in ranks[rank]:
                    assert locations[init.name].startswith(f"weights/rank{rank}/")
                    assert numpy_helper.to_array(init).tobytes() == _bytes(ranks[rank][init.name]), init.name
                    read += 1
            assert read == len(ranks[rank])
    finally:
        deregister_op_schemas()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("recipe", ["ptpc-fp8", "bf16", "tensor-fp8", "ptpc-fp8-unfused"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_rank_tensors_are_slices_of_the_tp1_tensors(make_ckpt, compiled, preset, recipe, tp):
    """tiny and tiny-moe have 4 query / 2 KV heads: tp=2 splits the KV heads, tp=4 replicates them."""
    ckpt = make_ckpt(preset)
    art = compiled(ckpt, recipe, f"tp={tp}")
    manifest = check_slices(compiled(ckpt, recipe), art, tp)
    check_graphs(art, manifest)
    assert manifest["kv_cache"]["num_kv_heads"] == 2 // min(tp, 2) and manifest["spec"]["num_key_value_heads"] == 2
    tensors, quantized = manifest["tensors"], recipe != "bf16"
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert tensors[o_proj]["axis"] == 1 and tensors["model.norm.weight"]["axis"] is None
    vocab = manifest["spec"]["vocab_size"]  # lm_head by vocabulary rows; the embedding table whole
    assert [e["spans"] for e in tensors["lm_head.weight"]["ranks"]] == [
        [[r * vocab // tp, (r + 1) * vocab // tp]] for r in range(tp)
    ]
    assert tensors["model.embed_tokens.weight"]["axis"] is None
    if quantized:  # per-row scales of a row-parallel weight: whole on every rank
        assert tensors[o_proj + "_scale"]["axis"] is None
    if recipe != "ptpc-fp8-unfused":
        qkv = tensors["model.layers.0.self_attn.qkv_proj.weight"]
        heads, kv = 64 // tp, 16 if tp > 2 else 16 * 2 // tp
        first_kv = [r * 2 // tp * 16 for r in range(tp)]
        assert [entry["spans"] for entry in qkv["ranks"]] == [
            [[r * heads, (r + 1) * heads], [64 + h, 64 + h + kv], [96 + h, 96 + h + kv]] for r, h in enumerate(first_kv)
        ]
    if preset == "tiny-moe" and recipe != "ptpc-fp8-unfused":
        w13 = tensors["model.layers.0.mlp.experts.w13.weight"]
        assert w13["shape"] == [8, 64, 64] and w13["axis"] == 1 and w13["ranks"][0]["shape"] == [8, 64 // tp, 64]
        assert w13["ranks"][-1]["spans"] == [[32 - 32 // tp, 32], [64 - 32 // tp, 64]]  # gate slice, up slice
        w2 = tensors["model.layers.0.mlp.experts.w2.weight"]
        assert w2["axis"] == 2 and w2["ranks"][1]["spans"] == [[32 // tp, 2 * 32 // tp]]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_block_fp8_splits_on_the_block_grid(make_ckpt, compiled, preset, tmp_path):
    overrides = ALIGNED | ({"moe_intermediate_size": 256} if preset == "tiny-moe" else {})
    ckpt = make_ckpt(preset, **overrides)
    manifest = check_slices(compiled(ckpt, "block-fp8"), compiled(ckpt, "block-fp8", "tp=2"), 2)
    scale = manifest["tensors"]["model.layers.0.self_attn.o_proj.weight_scale"]
    assert scale["shape"] == [1, 4] and scale["axis"] == 1 and scale["ranks"][1]["spans"] == [[2, 4]]
    # at tp=4 a rank's 64 rows of gate_up cut a 128-row block: refused, naming the weight
    result = run("compile", ckpt, "-o", tmp_path / "art", "-q", "-r", "block-fp8", "--tp", "4")
    assert result.exit_code == 1
    weight = "mlp.experts.w13" if preset == "tiny-moe" else "mlp.gate_up_proj"
    assert f"tp=4: model.layers.0.{weight}.weight would be split between rows 63 and 64" in result.output
    assert "128-wide weight block of scheme 'block-fp8'" in result.output
    assert leftovers(tmp_path, "art") == []


def _dequantized(tensors: dict[str, torch.Tensor], name: str, block: bool) -> torch.Tensor:
    """A linear weight in float64, times its scale (per row, or per 128 x 128 block)."""
    w, scale = tensors[name + ".weight"].double(), tensors[name + ".weight_scale"].double()
    if block:
        scale = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : w.shape[-2], : w.shape[-1]]
    return w * scale


@pytest.mark.parametrize("recipe", ["ptpc-fp8", "tensor-fp8", "block-fp8"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_row_parallel_partial_outputs_sum_to_the_tp1_output(make_ckpt, compiled, preset, recipe):
    """o_proj, down_proj and the experts' down on the same activations: the sum over the ranks of
    x[:, rank's columns] @ W_rᵀ (each row's whole scale) is x @ Wᵀ of the tp=1 artifact."""
    block = recipe == "block-fp8"
    overrides = (ALIGNED | ({"moe_intermediate_size": 256} if preset == "tiny-moe" else {})) if block else {}
    ckpt = make_ckpt(preset, **overrides)
    whole, tp = _whole(compiled(ckpt, recipe)), 2
    art = compiled(ckpt, recipe, f"tp={tp}")
    ranks, manifest = _rank_files(art, tp), read_manifest(art)
    sparse = preset == "tiny-moe"
    names = ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"]
    names += ["model.layers.0.mlp.experts.w2"] if sparse else ["model.layers.0.mlp.down_proj"]
    for name in names:
        w = _dequantized(whole, name, block)  # [.., H, K]
        x = torch.randn(5, w.shape[-1], dtype=torch.float64)
        want = x @ w.transpose(-1, -2)
        got = 0
        for r in range(tp):
            (span,) = manifest["tensors"][name + ".weight"]["ranks"][r]["spans"]
            got = got + x[:, span[0] : span[1]] @ _dequantized(ranks[r], name, block).transpose(-1, -2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _ThreadGroup:
    """A process group stand-in for ranks run as threads of this process: `all_reduce` sums the ranks'
    tensors in rank order, so every rank gets the same sum."""

    def __init__(self, tp: int) -> None:
        self.barrier = threading.Barrier(tp, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * tp


class _Member:
    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank


def _all_reduce(tensor: torch.Tensor, group: _Member, **_: object) -> None:
    shared = group.group
    shared.slots[group.rank] = tensor.clone()
    shared.barrier.wait()
    total = shared.slots[0].clone()
    for part in shared.slots[1:]:
        total += part
    shared.barrier.wait()
    tensor.copy_(total)


def _all_gather_into_tensor(out: torch.Tensor, tensor: torch.Tensor, group: _Member, **_: object) -> None:
    shared = group.group
    shared.slots[group.rank] = tensor.clone()
    shared.barrier.wait()
    out.copy_(torch.cat(shared.slots, 0))  # the ranks' rows stacked in rank order, as NCCL and gloo write them
    shared.barrier.wait()


def _steps(vocab: int):
    """(feeds, metadata) of a prefill of two prompts, then a decode step of both."""
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (19, 6)]
    tables = [[3, 5], [1]]
    out = []
    for chunks in ([(prompts[0], 0), (prompts[1], 0)], [([7], 19), ([9], 6)]):
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for (tokens, start), table in zip(chunks, tables, strict=True):
            for i, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + i)
                slots.append(table[(start + i) // BLOCK] * BLOCK + (start + i) % BLOCK)
            starts.append(starts[-1] + len(tokens))
            lens.append(start + len(tokens))
        width = max(len(t) for t in tables)
        feeds = {
            "input_ids": torch.tensor(ids),
            "positions": torch.tensor(positions),
            "slot_mapping": torch.tensor(slots),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            "context_lens": torch.tensor(lens, dtype=torch.int32),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32),
            "logits_indices": torch.tensor(starts[1:]) - 1,
        }
        cache_slots = tuple(
            torch.tensor([tables[b][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]) for b, n in enumerate(lens)
        )
        out.append((feeds, AttentionMetadata(tuple(starts), tuple(lens), cache_slots)))
    return out


def _logits(art: Path, steps) -> list[torch.Tensor]:
    """Every step's logits of the artifact in fp32, its ranks (if any) run in lockstep as threads."""
    manifest = read_manifest(art)
    tp, spec = manifest["tp"], KVCacheSpec.from_manifest(manifest["kv_cache"])
    group = _ThreadGroup(tp)
    runners = []
    for rank, file in enumerate(manifest["graph"]["files"] if tp > 1 else [manifest["graph"]["file"]]):
        graph = onnx.load(str(art / file), load_external_data=False).graph
        weights = load_initializers(art, graph, CPU, torch.float32)
        env = OpEnv(torch.float32, CPU, spec, tp_group=_Member(group, rank) if tp > 1 else None)
        runners.append((Plan.build(graph, weights, env, reference_ops()), KVCache(spec, 8, torch.float32, CPU)))
    results = []
    for feeds, meta in steps:
        outputs: list[torch.Tensor | BaseException | None] = [None] * tp

        def rank_step(rank: int, feeds=feeds, meta=meta, outputs=outputs) -> None:
            plan, cache = runners[rank]
            try:
                outputs[rank] = plan.run(StepContext(cache, meta), feeds)
            except BaseException as exc:  # reported below
                group.barrier.abort()
                outputs[rank] = exc

        threads = [threading.Thread(target=rank_step, args=(r,)) for r in range(tp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for out in outputs:
            if isinstance(out, BaseException):
                raise out
        for out in outputs[1:]:
            assert torch.equal(out, outputs[0])  # every rank computes the same logits
        results.append(outputs[0])
    return results


@pytest.mark.parametrize(("recipe", "tp"), [("bf16", 2), ("bf16", 4), ("ptpc-fp8", 2), ("ptpc-fp8-unfused", 4)])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_ranks_run_together_give_the_tp1_logits(make_ckpt, compiled, monkeypatch, preset, recipe, tp):
    """The rank graphs run in lockstep (threads, a summing all_reduce) give the tp=1 graph's logits:
    to fp32 summation order unquantized; to FP8 activation rounding with per-token activation scales,
    which a row-parallel rank takes over its own columns."""
    monkeypatch.setattr(collective.dist, "all_reduce", _all_reduce)
    monkeypatch.setattr(collective.dist, "all_gather_into_tensor", _all_gather_into_tensor)
    monkeypatch.setattr(collective.dist, "all_gather_single", _all_gather_into_tensor, raising=False)
    monkeypatch.setattr(collective.dist, "get_world_size", lambda group: len(group.group.slots))
    ckpt = make_ckpt(preset)
    steps = _steps(int(read_manifest(compiled(ckpt, recipe))["spec"]["vocab_size"]))
    want = _logits(compiled(ckpt, recipe), steps)
    got = _logits(compiled(ckpt, recipe, f"tp={tp}"), steps)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(w).all()
        if recipe == "bf16":
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        else:
            snr = 10 * torch.log10(w.pow(2).mean() / (g - w).pow(2).mean())
            assert float(snr) > 18, f"{float(snr):.1f} dB"


def test_cli_inspect_verify_tune_export_on_a_sharded_artifact(tiny_ckpt, compiled, tmp_path):
    out = tmp_path / "art"
    # the flag wins over the recipe's tp and over --set
    result = run("compile", tiny_ckpt, "-o", out, "-q", "--set", "tp=4", "--tp", "2", "-j", "1")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tp"] == manifest["recipe"]["tp"] == 2
    assert set(manifest["files"]) == {
        p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"
    }
    assert {"graph.rank0.onnx", "graph.rank1.onnx", "weights/rank0/model-00001-of-00001.safetensors"} <= set(
        manifest["files"]
    )
    assert not (out / "graph.onnx").exists()
    again = tmp_path / "again"
    assert run("compile", tiny_ckpt, "-o", again, "-q", "--tp", "2", "-j", "2").exit_code == 0
    assert json.loads((again / "manifest.json").read_text())["files"] == manifest["files"]  # deterministic

    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    assert "tp         2 (pre-sharded: per rank 2 query / 1 KV head(s)" in result.output
    info = json.loads(run("inspect", out, "--json").output)
    assert info["tp"] == 2 and info["graphs"] == ["graph.rank0.onnx", "graph.rank1.onnx"]
    assert info["bytes"]["weights"] == sum(f["bytes"] for p, f in manifest["files"].items() if p.startswith("weights/"))
    whole = json.loads(run("inspect", compiled(tiny_ckpt, "ptpc-fp8"), "--json").output)
    assert info["model"]["parameters"] == whole["model"]["parameters"]  # the model's, not a rank's
    assert whole["tp"] == 1 and whole["graphs"] == ["graph.onnx"]

    # tune times each GPU's GEMMs: a rank's shapes
    assert gemm_shapes(manifest) == [(64, 32), (64, 64), (128, 64)]  # o_proj, qkv / down_proj, gate_up
    with pytest.raises(ArtifactError, match="sharded for tp=2"):
        next(split_to_sources(out))
    result = run("export", out, "-o", tmp_path / "ct", "--format", "compressed-tensors")
    assert result.exit_code == 1 and "sharded for tp=2; export reads tp=1 artifacts only" in result.output

    result = run("verify", out)
    assert result.exit_code == 0 and result.output.startswith(f"ok: {len(manifest['files'])} files verified")
    shard = out / "weights" / "rank1" / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run("verify", out)
    assert result.exit_code == 1
    assert "error: weights/rank1/model-00001-of-00001.safetensors: sha256 does not match the manifest" in result.output


def test_tp1_gemm_shapes_are_the_whole_tensors(tiny_ckpt, compiled):
    manifest = read_manifest(compiled(tiny_ckpt, "ptpc-fp8"))
    assert gemm_shapes(manifest) == [(64, 64), (64, 128), (128, 64), (256, 64)]


def test_publish_a_sharded_artifact(tiny_ckpt, compiled, tmp_path):
    art = compiled(tiny_ckpt, "ptpc-fp8", "tp=2")
    out = tmp_path / "pub"
    result = run("publish", art, "--to", out, "--base-model", "Qwen/Qwen3-tiny", "--no-progress")
    assert result.exit_code == 0, result.output
    assert run("verify", out).exit_code == 0
    card = (out / "README.md").read_text()
    assert "pre-sharded for 2-way tensor parallelism" in card and "`graph.rank1.onnx`" in card
    assert "| tensor parallel | 2: pre-sharded" in card and 'qruntime.load("Qwen3-tiny-ptpc-fp8", tp=2)' in card
    for rel in read_manifest(art)["files"]:
        assert f"| `{rel}` |" in card


@pytest.mark.parametrize(
    ("preset", "args", "message"),
    [
        ("tiny", ["--tp", "3"], "'tp' must be a power of two between 1 and 64, got 3"),
        ("tiny", ["--tp", "8"], "tp=8 is more than the model's num_attention_heads (4)"),
        ("tiny-odd", ["--tp", "2"], "tp=2 does not divide the model's num_key_value_heads (3)"),
        ("tiny-moe", ["-r", "bf16", "--set", "tp=4", "--set", "max_shard_mb=1", "--tp", "16"], "more than"),
    ],
)
def test_a_model_that_does_not_split_is_refused(make_ckpt, tmp_path, preset, args, message):
    result = run("compile", make_ckpt(preset), "-o", tmp_path / "art", "-q", *args)
    assert result.exit_code == 1
    assert message in result.output
    assert leftovers(tmp_path, "art") == []


@pytest.mark.parametrize("recipe", ["ptpc-fp8", "tensor-fp8"])
def test_the_source_is_read_once_whatever_the_tp(tiny_moe_ckpt, tmp_path, monkeypatch, recipe):
    """Each row chunk is read (and quantized) once and its slices written to every rank that holds
    them: a tp=4 compile reads exactly the rows a tp=1 compile reads (per-tensor: with its amax pre-pass)."""
    real, reads = TensorEntry.read_rows, []

    def counted(self, start, stop):
        reads.append((self.name, start, stop))
        return real(self, start, stop)

    monkeypatch.setattr(TensorEntry, "read_rows", counted)
    seen = {}
    for tp in (1, 4):
        reads.clear()
        prepared = prepare(tiny_moe_ckpt, load_recipe(recipe, [f"tp={tp}"]))
        compile_checkpoint(prepared, tmp_path / f"tp{tp}", workers=2, progress=False)
        seen[tp] = sorted(reads)
    assert seen[4] == seen[1] and len(seen[1]) > 0


def test_a_failed_tp_compile_leaves_nothing(tiny_moe_ckpt, tmp_path, monkeypatch):
    real, calls = writer._run_task, []

    def failing(task, *args):
        calls.append(task)
        if len(calls) == 9:
            raise OSError("simulated write failure")
        return real(task, *args)

    monkeypatch.setattr(writer, "_run_task", failing)
    result = run("compile", tiny_moe_ckpt, "-o", tmp_path / "art", "-q", "--tp", "2")
    assert result.exit_code != 0 and len(calls) >= 9
    assert leftovers(tmp_path, "art") == []


@pytest.mark.parametrize("quantized_head", [False, True])
def test_a_tied_head_is_vocabulary_parallel_only_as_a_tensor_of_its_own(
    make_ckpt, compiled, monkeypatch, quantized_head
):
    """Tied embeddings: an unquantized head reads the embedding table, which every rank holds whole
    (no split, no gather); an FP8 head made from it is its own tensor and splits by vocabulary."""
    ckpt = make_ckpt("tiny", tie_word_embeddings=True)
    overrides = ("quantization.ignore=[]",) if quantized_head else ()
    art = compiled(ckpt, "ptpc-fp8", *overrides, "tp=2")
    manifest = check_slices(compiled(ckpt, "ptpc-fp8", *overrides), art, 2)
    check_graphs(art, manifest)
    tensors = manifest["tensors"]
    assert tensors["model.embed_tokens.weight"]["axis"] is None
    assert ("lm_head.weight" in tensors) == quantized_head
    if quantized_head:
        assert tensors["lm_head.weight"]["axis"] == 0 and tensors["lm_head.weight_scale"]["axis"] == 0
    monkeypatch.setattr(collective.dist, "all_reduce", _all_reduce)
    monkeypatch.setattr(collective.dist, "all_gather_into_tensor", _all_gather_into_tensor)
    monkeypatch.setattr(collective.dist, "all_gather_single", _all_gather_into_tensor, raising=False)
    monkeypatch.setattr(collective.dist, "get_world_size", lambda group: len(group.group.slots))
    steps = _steps(int(manifest["spec"]["vocab_size"]))
    for g, w in zip(_logits(art, steps), _logits(compiled(ckpt, "ptpc-fp8", *overrides), steps), strict=True):
        snr = 10 * torch.log10(w.pow(2).mean() / (g - w).pow(2).mean())
        assert float(snr) > 18, f"{float(snr):.1f} dB"
