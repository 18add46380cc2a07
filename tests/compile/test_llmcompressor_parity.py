"""Byte-for-byte parity with llm-compressor.

qcompile's weights, split back to the source names (`split_to_sources`), must equal what
llm-compressor writes for the same checkpoint: every FP8 weight, every bf16 `weight_scale`, and
every tensor left unquantized (embeddings, norms, MoE router, lm_head), with nothing missing and
nothing extra. Two llm-compressor paths are compared: `model_free_ptq` (streams the safetensors
like we do; it has no model, so the embedding must be named in `ignore`) and `oneshot` (loads the
transformers model). The `quantization_config` of config.json is compared too, parsed with
compressed-tensors. tensor-fp8 has no llm-compressor preset; it is compared with a custom scheme
(`strategy: tensor` weights, dynamic per-tensor activations), whose [1] weight scales
split_to_sources gives back from the artifact's repeated rows.

llm-compressor's outputs are cached per module (one run per checkpoint and scheme), and so are
our compiles, which keeps these tests to a few seconds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from llmc_reference import (
    BF16,
    EMBED,
    FP8,
    IGNORE,
    LMHEAD_IGNORE,
    MODEL_FREE_IGNORE,
    OBSERVER,
    SIZE128,
    TENSOR_FP8,
    Tensors,
    assert_identical,
    cached_runs,
    group_dicts,
    ignored_modules,
    linear_modules,
    quantization_config,
    read_tensors,
    run_model_free,
    run_oneshot,
)
from prequantized_inputs import copy_checkpoint, rewrite_tensors

import qcompile.compile.pipeline
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.compile.writer import iter_tasks, write_weights
from qcompile.publish.unfuse import split_to_sources
from qcompile.recipe.schema import load_recipe

SMALL_CHUNK = 1000  # bytes: 7 rows of 64 bf16 columns, 15 of 32


# ----------------------------------------------------------------------------------- helpers


def split(artifact: Path) -> Tensors:
    """Our artifact's weights under the source names: `X.weight` and `X.weight_scale`."""
    out: Tensors = {}
    for name, weight, scale in split_to_sources(artifact):
        pairs = [(name, weight)] + ([(name + "_scale", scale)] if scale is not None else [])
        for key, tensor in pairs:
            assert key not in out, f"split_to_sources yielded {key} twice"
            out[key] = tensor
    return out


def quantized_names(tensors: Tensors) -> set[str]:
    """Modules whose weight is FP8 — each must come with a scale."""
    names = {k.removesuffix(".weight") for k, t in tensors.items() if k.endswith(".weight") and t.dtype == FP8}
    assert all(f"{n}.weight_scale" in tensors for n in names)
    return names


# ------------------------------------------------------------------- cached runs (per module)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


def _run_compile(ckpt: Path, out: Path, recipe: str, overrides: tuple[str, ...] = ()) -> None:
    compile_checkpoint(prepare(ckpt, load_recipe(recipe, list(overrides))), out, workers=2, progress=False)


@pytest.fixture(scope="module")
def model_free(workdir: Path) -> Callable[..., Path]:
    """`model_free(ckpt, scheme="FP8_DYNAMIC", ignore=MODEL_FREE_IGNORE) -> output dir`."""
    get = cached_runs(workdir, "model-free", run_model_free)
    return lambda ckpt, scheme="FP8_DYNAMIC", ignore=tuple(MODEL_FREE_IGNORE): get(ckpt, scheme, tuple(ignore))


@pytest.fixture(scope="module")
def one_shot(workdir: Path) -> Callable[..., Path]:
    """`one_shot(ckpt, scheme="FP8_DYNAMIC", ignore=IGNORE) -> output dir` of oneshot + save_pretrained(save_compressed)."""
    get = cached_runs(workdir, "oneshot", run_oneshot)
    return lambda ckpt, scheme="FP8_DYNAMIC", ignore=tuple(IGNORE): get(ckpt, scheme, tuple(ignore))


@pytest.fixture(scope="module")
def compiled(workdir: Path) -> Callable[..., Path]:
    """`compiled(ckpt, recipe, overrides=()) -> artifact dir`."""
    get = cached_runs(workdir, "qcompile", _run_compile)
    return lambda ckpt, recipe, overrides=(): get(ckpt, recipe, tuple(overrides))


@pytest.fixture(scope="module")
def ckpt128(make_ckpt: Callable[..., Path]) -> Path:
    """Dense, every linear dimension a multiple of 128 (fused block-fp8 needs aligned parts)."""
    return make_ckpt("tiny", **SIZE128, intermediate_size=256)


@pytest.fixture(scope="module")
def moe128(make_ckpt: Callable[..., Path]) -> Path:
    return make_ckpt("tiny-moe", **SIZE128, intermediate_size=256, moe_intermediate_size=128)


CHECKPOINTS = ["tiny_ckpt", "tiny_tied_ckpt", "tiny_moe_ckpt", "tiny_odd_ckpt"]


@pytest.fixture(scope="module")
def fresh_moe_ckpt(tiny_moe_ckpt: Path, workdir: Path) -> Path:
    """tiny-moe with fresh random weights each run, every tensor of its own random magnitude."""
    ckpt = copy_checkpoint(tiny_moe_ckpt, workdir / "fresh-moe")

    def edit(tensors: Tensors) -> None:
        for name, t in tensors.items():
            tensors[name] = (torch.randn(t.shape) * 10 ** random.uniform(-4, 2)).to(BF16)

    rewrite_tensors(ckpt, edit)
    return ckpt


# ---------------------------------------------------------------------- ptpc-fp8 == FP8_DYNAMIC


@pytest.mark.parametrize("recipe", ["ptpc-fp8", "ptpc-fp8-unfused"])
@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_ptpc_fp8_equals_model_free_ptq(request, fixture, recipe, compiled, model_free):
    ckpt = request.getfixturevalue(fixture)
    reference = read_tensors(model_free(ckpt))
    ours = split(compiled(ckpt, recipe))
    assert_identical(ours, reference)
    expected = {m for m in linear_modules(ckpt) if m != "lm_head" and not m.endswith(".mlp.gate")}
    assert quantized_names(reference) == expected
    assert reference["model.embed_tokens.weight"].dtype == BF16
    assert ("lm_head.weight" in reference) == (fixture != "tiny_tied_ckpt")


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_ptpc_fp8_equals_oneshot(request, fixture, compiled, one_shot):
    """oneshot on the transformers model. transformers 5 holds Qwen3-MoE experts as 3-D tensors
    (Qwen3MoeExperts); llm-compressor linearizes them into per-expert nn.Linear before
    calibrating, and save_pretrained writes them back under the per-expert source names, 2-D."""
    ckpt = request.getfixturevalue(fixture)
    reference = read_tensors(one_shot(ckpt))
    stacked = sorted(k for k, t in reference.items() if t.dim() > 2)
    assert not stacked, f"oneshot saved stacked tensors; split them before comparing: {stacked}"
    assert_identical(split(compiled(ckpt, "ptpc-fp8")), reference)
    if fixture == "tiny_moe_ckpt":
        assert reference["model.layers.0.mlp.experts.7.down_proj.weight"].dtype == FP8


# ------------------------------------------------------------ tensor-fp8 == strategy: tensor


def assert_per_source_scales(artifact: Path, ours: Tensors) -> None:
    """The artifact repeats each source's one scale on its rows: a fused qkv_proj holds the three
    values that q_proj, k_proj and v_proj split back to."""
    tensors = read_tensors(artifact / "weights")
    fused = tensors["model.layers.0.self_attn.qkv_proj.weight_scale"]  # [q + k + v rows, 1]
    parts = [ours[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"]
    assert all(p.shape == (1,) for p in parts)
    rows = [ours[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv"]
    assert torch.equal(fused, torch.cat([p.expand(r) for p, r in zip(parts, rows, strict=True)])[:, None])


@pytest.mark.parametrize("overrides", [(), ("passes=[]",)], ids=["fused", "unfused"])
@pytest.mark.parametrize("fixture", [*CHECKPOINTS, "fresh_moe_ckpt"])
def test_tensor_fp8_equals_model_free_ptq(request, fixture, overrides, compiled, model_free):
    ckpt = request.getfixturevalue(fixture)
    reference = read_tensors(model_free(ckpt, TENSOR_FP8))
    artifact = compiled(ckpt, "tensor-fp8", overrides)
    ours = split(artifact)
    assert_identical(ours, reference)
    expected = {m for m in linear_modules(ckpt) if m != "lm_head" and not m.endswith(".mlp.gate")}
    assert quantized_names(reference) == expected
    assert all(reference[m + ".weight_scale"].shape == (1,) for m in expected)
    if not overrides:
        assert_per_source_scales(artifact, ours)


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_tensor_fp8_equals_oneshot(request, fixture, compiled, one_shot):
    """oneshot with the custom per-tensor scheme: every weight's bytes and its one bf16 scale (and
    every unquantized tensor) equal ours split back to source names."""
    ckpt = request.getfixturevalue(fixture)
    reference = read_tensors(one_shot(ckpt, TENSOR_FP8))
    scales = {k: t for k, t in reference.items() if k.endswith(".weight_scale")}
    assert scales and all(t.shape == (1,) and t.dtype == BF16 for t in scales.values())
    artifact = compiled(ckpt, "tensor-fp8")
    ours = split(artifact)
    assert_identical(ours, reference)
    if fixture == "tiny_moe_ckpt":
        w13 = read_tensors(artifact / "weights")["model.layers.0.mlp.experts.w13.weight_scale"]  # [E, 2I, 1]
        gate, up = (ours[f"model.layers.0.mlp.experts.3.{p}_proj.weight_scale"] for p in ("gate", "up"))
        assert bool((w13[3, :32] == gate).all()) and bool((w13[3, 32:] == up).all())


def test_edge_values_tensor_fp8_equal_model_free_ptq(tiny_ckpt, workdir, compiled, model_free):
    """Per-tensor scales over edge values: rows of every edge kind inside tensors (a 1e30 outlier or
    values near the bf16 maximum set their tensor's scale), and whole tensors all zero, all -0, all
    subnormal (epsilon scales) and of normal values whose scale is a bf16 subnormal."""
    k, up = "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    slots = [
        ("zero", k, 0),
        ("negzero", k, 31),
        ("subnormal", q, 7),
        ("subnormal_scale", q, 60),
        ("huge", up, 0),
        ("outlier", up, 64),
        ("bf16max", k, 16),
    ]
    ckpt = _edge_checkpoint(tiny_ckpt, workdir / "edge-tensor", slots, group=1)
    whole = {
        "model.layers.1.self_attn.v_proj.weight": "zero",
        "model.layers.0.mlp.gate_proj.weight": "negzero",
        "model.layers.0.self_attn.o_proj.weight": "subnormal",
        "model.layers.1.mlp.down_proj.weight": "subnormal_scale",
    }

    def edit(tensors: Tensors) -> None:
        for name, kind in whole.items():
            if name in tensors:
                tensors[name] = _edge_block(kind, *tensors[name].shape)

    rewrite_tensors(ckpt, edit)
    reference = read_tensors(model_free(ckpt, TENSOR_FP8))
    for overrides in ((), ("passes=[]",)):
        ours = split(compiled(ckpt, "tensor-fp8", overrides))
        assert_identical(ours, reference)
    scale = {kind: ours[name + "_scale"].item() for name, kind in whole.items()}
    eps = torch.finfo(BF16).eps
    assert scale["zero"] == scale["negzero"] == scale["subnormal"] == eps
    assert scale["subnormal_scale"] == 2.0**-132
    assert bool((ours["model.layers.0.mlp.gate_proj.weight"].view(torch.uint8) == 0x80).all())
    assert float(ours["model.layers.1.mlp.down_proj.weight"].float().max()) == 448


# -------------------------------------------------------------------------------- FP8 lm_head


def test_lmhead_untied_equals_model_free_ptq(tiny_ckpt, compiled, model_free):
    reference = read_tensors(model_free(tiny_ckpt, ignore=LMHEAD_IGNORE))
    assert reference["lm_head.weight"].dtype == FP8
    assert_identical(split(compiled(tiny_ckpt, "ptpc-fp8-lmhead")), reference)


def test_lmhead_tied_equals_model_free_on_the_embedding(tiny_tied_ckpt, workdir, compiled, model_free):
    """Our FP8 lm_head of a tied model is the embedding table quantized as a linear weight.

    Reference: an untied copy of the checkpoint whose lm_head.weight is the embedding table, run
    through the whole of model_free_ptq — llm-compressor's own observer, qparams and compressor,
    none of our code — with lm_head quantized. The embedding itself stays bf16 on both sides.
    """
    untied = copy_checkpoint(tiny_tied_ckpt, workdir / "tied-as-untied")

    def add_lm_head(tensors: Tensors) -> None:
        if EMBED + ".weight" in tensors:
            tensors["lm_head.weight"] = tensors[EMBED + ".weight"].clone()

    rewrite_tensors(untied, add_lm_head)
    config = json.loads((untied / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(config, indent=2))

    reference = read_tensors(model_free(untied, ignore=LMHEAD_IGNORE))
    ours = split(compiled(tiny_tied_ckpt, "ptpc-fp8-lmhead"))
    assert reference["lm_head.weight"].dtype == FP8 and ours[EMBED + ".weight"].dtype == BF16
    assert_identical(ours, reference)


def test_lmhead_tied_equals_oneshot(tiny_tied_ckpt, compiled, one_shot):
    """llm-compressor's own handling of a tied model whose lm_head is quantized: oneshot unties the
    embeddings (a bf16 table and an FP8 lm_head) and saves both."""
    ref_dir = one_shot(tiny_tied_ckpt, ignore=("re:.*mlp.gate$",))
    reference = read_tensors(ref_dir)
    assert reference["lm_head.weight"].dtype == FP8
    ours_dir = compiled(tiny_tied_ckpt, "ptpc-fp8-lmhead")
    assert_identical(split(ours_dir), reference)
    # the rest of config.json is not compared: save_pretrained rewrites it (and, having untied the
    # model, writes tie_word_embeddings false)
    assert_equivalent(ours_dir, ref_dir, tiny_tied_ckpt, drop=OBSERVER, same_config=False)


# -------------------------------------------------------------------------------- edge values


def _edge_block(kind: str, rows: int, cols: int) -> torch.Tensor:
    """`rows` x `cols` bf16 values of one edge kind, fresh random each run."""
    r = torch.randn(rows, cols)
    if kind == "zero":
        return torch.zeros(rows, cols, dtype=BF16)
    if kind == "negzero":
        return torch.full((rows, cols), -0.0, dtype=BF16)
    if kind == "subnormal":  # below bf16's smallest normal (2**-126): amax / 448 underflows to 0
        return (r * 2.0**-130).to(BF16)
    if kind == "subnormal_scale":
        # normal values whose scale amax / 448 is a bf16 subnormal: amax 67 * 2**-129 gives a scale
        # of 2 subnormal steps (2**-132, rounded down by 16%), so amax / scale = 536 is clamped to 448
        r = r.clamp(-4, 4) * 2.0**-125  # below 67 * 2**-129 = 4.19 * 2**-125
        r[:, torch.randint(cols, ())] = 67 * 2.0**-129
        return r.to(BF16)
    if kind == "huge":
        return (r * 1e30).to(BF16)
    if kind == "outlier":  # one huge value: the rest of the row underflows to fp8 zero / subnormals
        r *= 0.02
        r[:, torch.randint(cols, ())] = 1e30
        return r.to(BF16)
    if kind == "bf16max":  # around the largest bf16: w / scale lands on or just past 448
        return (r.clamp(-1, 1) * torch.finfo(BF16).max).to(BF16)
    raise ValueError(kind)


EDGE_KINDS = ("zero", "negzero", "subnormal", "subnormal_scale", "huge", "outlier", "bf16max")


def _edge_checkpoint(src: Path, dst: Path, slots: list[tuple[str, str, int]], group: int) -> Path:
    """A copy of `src` where, for each (kind, tensor, first row) slot, `group` rows get that edge kind."""
    assert {kind for kind, _, _ in slots} == set(EDGE_KINDS)
    copy_checkpoint(src, dst)
    done: list[tuple[str, str, int]] = []

    def edit(tensors: Tensors) -> None:
        for kind, name, row in slots:
            if name in tensors:
                tensors[name][row : row + group] = _edge_block(kind, group, tensors[name].shape[1])
                done.append((kind, name, row))

    rewrite_tensors(dst, edit)
    assert sorted(done) == sorted(slots)
    values = torch.cat([t.flatten().float() for t in read_tensors(dst).values()])
    assert bool(((values == 0) & values.signbit()).any()), "no negative zero was written"
    assert bool(((values != 0) & (values.abs() < 2.0**-126)).any()), "no subnormal was written"
    assert float(values.abs().max()) > 1e38
    return dst


def test_edge_values_dense_equal_model_free_ptq(tiny_ckpt, workdir, compiled, model_free):
    # the rows sit at the ends of fused parts: k in the middle of qkv, up at the end of gate_up
    k, up = "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"
    slots = [
        ("zero", k, 0),
        ("negzero", k, 31),
        ("subnormal", k, 7),
        ("subnormal_scale", up, 127),
        ("huge", up, 0),
        ("outlier", up, 64),
        ("bf16max", k, 16),
    ]
    ckpt = _edge_checkpoint(tiny_ckpt, workdir / "edge-dense", slots, group=1)
    reference = read_tensors(model_free(ckpt))
    for recipe in ("ptpc-fp8", "ptpc-fp8-unfused"):
        ours = split(compiled(ckpt, recipe))
        assert_identical(ours, reference)
    # the all-zero rows: zero bytes (+0 and -0) and the epsilon scale, as llm-compressor writes
    assert bool((ours[k][0].view(torch.uint8) == 0).all())
    assert bool((ours[k][31].view(torch.uint8) == 0x80).all())
    assert ours[k + "_scale"][0].item() == ours[k + "_scale"][31].item() == torch.finfo(BF16).eps
    assert ours[up + "_scale"][127].item() == 2.0**-132 and float(ours[up][127].float().max()) == 448


def test_edge_values_moe_equal_model_free_ptq(tiny_moe_ckpt, workdir, compiled, model_free):
    gate, down = "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.7.down_proj.weight"
    router = "model.layers.2.mlp.gate.weight"  # kept bf16: copied bit for bit, -0 and subnormals included
    slots = [
        ("zero", gate, 0),
        ("negzero", gate, 31),
        ("subnormal", down, 63),
        ("subnormal_scale", gate, 12),
        ("huge", down, 0),
        ("outlier", down, 30),
        ("bf16max", gate, 20),
        ("negzero", router, 7),
        ("subnormal", router, 0),
        ("huge", router, 3),
    ]
    ckpt = _edge_checkpoint(tiny_moe_ckpt, workdir / "edge-moe", slots, group=1)
    reference = read_tensors(model_free(ckpt))
    for recipe in ("ptpc-fp8", "ptpc-fp8-unfused"):
        assert_identical(split(compiled(ckpt, recipe)), reference)


def test_edge_values_block_fp8_equal_model_free_ptq(ckpt128, workdir, compiled, model_free):
    """Whole 128-row bands of one kind, so entire 128 x 128 tiles are zero, -0, subnormal, …"""
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    slots = [
        ("zero", q, 0),
        ("negzero", q, 128),
        ("subnormal", k, 0),
        ("subnormal_scale", v, 0),
        ("huge", gate, 0),
        ("outlier", gate, 128),
        ("bf16max", up, 128),
    ]
    ckpt = _edge_checkpoint(ckpt128, workdir / "edge-block", slots, group=128)
    reference = read_tensors(model_free(ckpt, "FP8_BLOCK"))
    for overrides in ((), ("passes=[]",)):
        assert_identical(split(compiled(ckpt, "block-fp8", overrides)), reference)


# ------------------------------------------------------------------------- block-fp8 == FP8_BLOCK


@pytest.mark.parametrize("overrides", [(), ("passes=[]",)], ids=["fused", "unfused"])
@pytest.mark.parametrize("fixture", ["ckpt128", "moe128"])
def test_block_fp8_equals_model_free_ptq(request, fixture, overrides, compiled, model_free):
    ckpt = request.getfixturevalue(fixture)
    reference = read_tensors(model_free(ckpt, "FP8_BLOCK"))
    ours = split(compiled(ckpt, "block-fp8", overrides))
    assert ours["model.layers.0.self_attn.q_proj.weight_scale"].shape == (2, 1)
    assert_identical(ours, reference)


def test_block_fp8_ragged_edges_equal_oneshot(tiny_odd_ckpt, compiled, one_shot):
    """Dims that are not multiples of 128 (96, 72, 48): edge tiles take the amax of what they hold.

    model_free_ptq cannot compare here (llm-compressor 0.14 fails saving a non-contiguous weight
    for such shapes); oneshot quantizes them, with the same edge-tile rule as ours.
    """
    reference = read_tensors(one_shot(tiny_odd_ckpt, "FP8_BLOCK"))
    assert reference["model.layers.0.mlp.down_proj.weight_scale"].shape == (1, 1)
    assert_identical(split(compiled(tiny_odd_ckpt, "block-fp8", ("passes=[]",))), reference)


# -------------------------------------------------------------------- streamed row chunks


@pytest.mark.parametrize(
    ("fixture", "recipe", "scheme"),
    [
        ("tiny_moe_ckpt", "ptpc-fp8", "FP8_DYNAMIC"),
        ("moe128", "block-fp8", "FP8_BLOCK"),
        ("tiny_moe_ckpt", "tensor-fp8", TENSOR_FP8),
        ("tiny_odd_ckpt", "tensor-fp8", TENSOR_FP8),
    ],
)
def test_small_row_chunks_equal_model_free_ptq(request, fixture, recipe, scheme, tmp_path, monkeypatch, model_free):
    """Real checkpoints stream in many row chunks per tensor; the tiny ones fit in one. With 1000-byte
    chunks every tensor is written in several ragged pieces, and the bytes must not change (per-tensor
    scales: each source's amax comes from a pre-pass over the same chunks)."""
    ckpt = request.getfixturevalue(fixture)
    counts: list[tuple[int, int]] = []

    def chunked(root, checkpoint, plan, **kwargs):
        counts.append((sum(1 for _ in iter_tasks(plan, SMALL_CHUNK)), len(plan.source_shapes)))
        write_weights(root, checkpoint, plan, chunk_bytes=SMALL_CHUNK, **kwargs)

    monkeypatch.setattr(qcompile.compile.pipeline, "write_weights", chunked)
    _run_compile(ckpt, tmp_path / "art", recipe)
    ((tasks, sources),) = counts
    assert tasks > sources
    assert_identical(split(tmp_path / "art"), read_tensors(model_free(ckpt, scheme)))


# ------------------------------------------------------------------------ quantization_config


def assert_equivalent(
    ours_dir: Path, ref_dir: Path, ckpt: Path, drop: tuple[str, ...] = (), same_config: bool = True
) -> None:
    ours, ours_rest = quantization_config(ours_dir)
    ref, ref_rest = quantization_config(ref_dir)
    assert ours.format == ref.format
    assert ours.quant_method == ref.quant_method == "compressed-tensors"
    assert ours.quantization_status == ref.quantization_status
    assert ours.kv_cache_scheme == ref.kv_cache_scheme
    assert group_dicts(ours, drop) == group_dicts(ref, drop)
    modules = linear_modules(ckpt)
    assert ignored_modules(ours, modules) == ignored_modules(ref, modules)
    # and what the config says is what the weights are: quantized exactly where not ignored
    tensors = split(ours_dir)
    present = modules & {k.removesuffix(".weight") for k in tensors if k.endswith(".weight")}
    assert quantized_names(tensors) == present - ignored_modules(ours, modules)
    if same_config:  # the rest of config.json: the source's, untouched, on both sides
        assert ours_rest == ref_rest


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_quantization_config_equals_model_free_ptq(request, fixture, compiled, model_free):
    ckpt = request.getfixturevalue(fixture)
    assert_equivalent(compiled(ckpt, "ptpc-fp8"), model_free(ckpt), ckpt)
    assert_equivalent(compiled(ckpt, "ptpc-fp8-unfused"), model_free(ckpt), ckpt)


def test_quantization_config_lmhead_equals_model_free_ptq(tiny_ckpt, compiled, model_free):
    assert_equivalent(compiled(tiny_ckpt, "ptpc-fp8-lmhead"), model_free(tiny_ckpt, ignore=LMHEAD_IGNORE), tiny_ckpt)


def test_quantization_config_block_equals_model_free_ptq(ckpt128, compiled, model_free):
    ours, ref = compiled(ckpt128, "block-fp8"), model_free(ckpt128, "FP8_BLOCK")
    assert_equivalent(ours, ref, ckpt128)
    (group,) = quantization_config(ours)[0].config_groups.values()
    assert group.weights.block_structure == [128, 128] and group.input_activations.group_size == 128


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_quantization_config_equals_oneshot(request, fixture, compiled, one_shot):
    """oneshot records the calibration observer ("memoryless_minmax") in the weight args; it only
    matters while calibrating, so it is left out. save_pretrained writes transformers' own
    serialization of the rest of config.json, so only the quantization_config is compared."""
    ckpt = request.getfixturevalue(fixture)
    assert_equivalent(compiled(ckpt, "ptpc-fp8"), one_shot(ckpt), ckpt, drop=OBSERVER, same_config=False)


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_quantization_config_tensor_fp8_equals_llmcompressor(request, fixture, compiled, one_shot, model_free):
    ckpt = request.getfixturevalue(fixture)
    ours = compiled(ckpt, "tensor-fp8")
    assert_equivalent(ours, one_shot(ckpt, TENSOR_FP8), ckpt, drop=OBSERVER, same_config=False)
    assert_equivalent(ours, model_free(ckpt, TENSOR_FP8), ckpt)
    (group,) = quantization_config(ours)[0].config_groups.values()
    assert group.weights.strategy == group.input_activations.strategy == "tensor"
    assert group.input_activations.dynamic is True and group.weights.dynamic is False
