"""Pre-quantized asymmetric int4 checkpoints (a zero point per group of 128) as compiler input, transcoded
bit for bit into `w4a16-zp` artifacts: compressed-tensors W4A16 with `symmetric: false` (llm-compressor's
W4A16_ASYM preset, oneshot) and AutoAWQ GEMM (`quant_method: awq`, written from AutoAWQ's published
layout by zero_point_inputs.py from the same codes, zero points and scales).

Fresh random checkpoints each run (the seed printed). The artifact's weights, dequantized as
(code - zero) * scale, equal each source's own dequantization exactly: transformers' decompression of
the compressed-tensors checkpoint, AutoAWQ's dequantize_gemm arithmetic for the AWQ one. Both formats
of one quantization give the same artifact byte for byte. Generation equals that of the unquantized
checkpoint holding the dequantized weights (the W4A16 reference op forms the same weights, then the same
Gemm). Broken inputs are refused naming the tensor and file, or the config key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import qruntime
import torch
from int4_shapes import INT4_SHAPES
from llmc_reference import (
    IGNORE,
    OBSERVER,
    assert_identical,
    group_dicts,
    ignored_modules,
    linear_modules,
    quantization_config,
    read_tensors,
)
from prequantized_inputs import (
    assert_same_artifact,
    cached_compiler,
    compile_to,
    copy_checkpoint,
    edit_config,
    make_checkpoints,
    quantize_with_llmcompressor,
    rewrite_tensors,
)
from qruntime.artifact import read_manifest
from zero_point_inputs import awq_dequantize, compressed_tensors_to_awq, write_dequantized

from qcompile.errors import CheckpointError, PlanError, TensorValueError
from qcompile.publish.unfuse import split_to_sources, split_zero_points
from qcompile.quant.int4 import dequantize
from qcompile.recipe.prequantized import default_recipe

PRESETS = {
    "dense": ("tiny", INT4_SHAPES),
    "moe": ("tiny-moe", {**INT4_SHAPES, "moe_intermediate_size": 256}),
    "three-groups": ("tiny", {**INT4_SHAPES, "intermediate_size": 384, "vocab_size": 538}),
}
O_PROJ = "model.layers.0.self_attn.o_proj"  # [128, 256]: 2 groups a row


@pytest.fixture(scope="module")
def ckpts(make_ckpt: Callable[..., Path]) -> dict[str, Path]:
    return make_checkpoints(make_ckpt, PRESETS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prequantized-w4a16-zp")


@pytest.fixture(scope="module")
def inputs(ckpts, workdir) -> Callable[[str, str], Path]:
    """`inputs(kind, fmt)`: the asymmetric W4A16 checkpoint of `kind` as `fmt` ('ct': llm-compressor's
    compressed-tensors; 'awq': the same as AutoAWQ GEMM; 'awq-fp16': that in float16), cached."""
    made: dict[tuple[str, str], Path] = {}

    def get(kind: str, fmt: str = "ct") -> Path:
        if (kind, fmt) not in made:
            if fmt == "ct":
                out = workdir / f"ct-{kind}"
                made[(kind, fmt)] = quantize_with_llmcompressor(ckpts[kind], out, "W4A16_ASYM", IGNORE)
            else:
                dtype = torch.float16 if fmt == "awq-fp16" else None
                made[(kind, fmt)] = compressed_tensors_to_awq(get(kind), workdir / f"{fmt}-{kind}", dtype)
        return made[(kind, fmt)]

    return get


@pytest.fixture(scope="module")
def compiled(workdir) -> Callable[..., Path]:
    return cached_compiler(workdir)


def artifact_weights(art: Path) -> dict[str, torch.Tensor]:
    """{source name: (code - zero) * scale} of every int4 weight of the artifact, in the scales' dtype."""
    zero_points = split_zero_points(art)
    out = {}
    for name, weight, scale in split_to_sources(art):
        if scale is not None:
            out[name] = dequantize(weight, scale, 128, zero_points[name])
    return out


def hf_decompressed(ckpt: Path) -> dict[str, torch.Tensor]:
    """The linears' weights transformers (compressed-tensors) decompresses the checkpoint into."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.bfloat16
    )
    state = model.state_dict()
    quantized = {n.removesuffix("_scale") for n in state if n.endswith(".weight_scale")}
    return {n: state[n] for n in quantized}


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kind", ["dense", "three-groups"])
def test_compressed_tensors_asymmetric_dequantizes_to_transformers_weights(kind, inputs, compiled):
    ckpt = inputs(kind)
    assert default_recipe(ckpt) == "w4a16-zp"
    ours = artifact_weights(compiled(ckpt))
    theirs = hf_decompressed(ckpt)
    assert sorted(ours) == sorted(theirs) and len(ours) == 14  # 2 layers x q, k, v, o, gate, up, down
    bad = [n for n in theirs if not equal_bits(ours[n], theirs[n])]
    assert not bad, bad
    manifest = read_manifest(compiled(ckpt))
    assert manifest["source"]["quantization"] == {
        "method": "compressed-tensors",
        "format": "pack-quantized",
        "scheme": "w4a16-zp",
    }
    zp = manifest["tensors"]["model.layers.0.self_attn.qkv_proj.weight_zero_point"]
    assert (zp["dtype"], zp["role"], zp["scheme"], zp["shape"]) == ("U8", "zero_point", "w4a16-zp", [512, 1])
    zeros = split_zero_points(compiled(ckpt))
    assert len({int(v) for z in zeros.values() for v in z.unique()}) > 1  # asymmetric: not all 8


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_awq_gives_the_same_artifact_and_its_own_weights(kind, inputs, compiled):
    """The AWQ checkpoint of the same quantization transcodes to the same bytes, and its weights are
    AutoAWQ's dequantization of qweight / qzeros / scales, bit for bit."""
    awq = inputs(kind, "awq")
    assert default_recipe(awq) == "w4a16-zp"
    assert_same_artifact(compiled(awq), compiled(inputs(kind)))
    source = read_manifest(compiled(awq))["source"]["quantization"]
    assert source == {"method": "awq", "format": "gemm", "scheme": "w4a16-zp"}
    tensors = read_tensors(awq)
    ours = artifact_weights(compiled(awq))
    assert len(ours) == len([n for n in tensors if n.endswith(".qweight")]) > 0
    for name, weight in ours.items():
        module = name.removesuffix(".weight")
        t = [tensors[f"{module}.{k}"] for k in ("qweight", "qzeros", "scales")]
        assert equal_bits(weight, awq_dequantize(*t, 128)), name


def test_awq_in_float16_transcodes_and_generates(inputs, compiled):
    awq = inputs("dense", "awq-fp16")
    art = compiled(awq)
    tensors = read_tensors(awq)
    for name, weight in artifact_weights(art).items():
        module = name.removesuffix(".weight")
        want = awq_dequantize(*(tensors[f"{module}.{k}"] for k in ("qweight", "qzeros", "scales")), 128)
        assert weight.dtype == torch.float16 and equal_bits(weight, want), name
    params = qruntime.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(qruntime.load(art, device="cpu").generate([3, 17, 42, 5], params)[0].token_ids) == 6


@pytest.mark.parametrize(("kind", "fmt"), [("dense", "ct"), ("moe", "ct"), ("moe", "awq")])
def test_transcoded_artifact_generates_as_its_dequantized_weights_do(kind, fmt, ckpts, inputs, compiled, workdir):
    """Greedy tokens (ignore_eos: random weights) of the w4a16-zp artifact equal those of the bf16
    checkpoint holding its dequantized weights: the reference op forms those weights, then a Gemm."""
    art = compiled(inputs(kind, fmt))
    plain = write_dequantized(ckpts[kind], workdir / f"dequantized-{kind}-{fmt}", artifact_weights(art))
    params = qruntime.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [3, 17, 42, 5]
    tokens = [
        qruntime.load(a, device="cpu").generate(prompt, params)[0].token_ids for a in (art, compiled(plain, "bf16"))
    ]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]


def test_tp2_ranks_hold_slices_of_the_tp1_zero_points(inputs, compiled):
    tp1, tp2 = compiled(inputs("moe")), compiled(inputs("moe"), None, "tp=2")
    from safetensors.torch import load_file

    whole = {k: v for f in sorted(tp1.glob("weights/*.safetensors")) for k, v in load_file(f).items()}
    tensors = read_manifest(tp2)["tensors"]
    checked = 0
    for name, info in tensors.items():
        if info["role"] != "zero_point":
            continue
        for rank, held in enumerate(info["ranks"]):
            got = load_file(tp2 / "weights" / f"rank{rank}" / Path(held["file"]).name)[name]
            if info["axis"] is None:
                want = whole[name]
            else:
                want = torch.cat([whole[name].narrow(info["axis"], b, e - b) for b, e in held["spans"]], info["axis"])
            assert torch.equal(got, want), (name, rank)
            checked += 1
    assert checked > 0


def test_the_w4a16_zp_recipe_is_refused_on_an_unquantized_checkpoint(ckpts, tmp_path):
    with pytest.raises(PlanError, match=r"scheme 'w4a16-zp' \(int4 with zero points\) is read from pre-quantized"):
        compile_to(ckpts["dense"], tmp_path / "out", "w4a16-zp")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ hostile inputs


def _edit_case(fmt: str, edit, message: str):
    return pytest.param(fmt, edit, message)


@pytest.mark.parametrize(
    ("fmt", "edit", "message"),
    [
        (
            "ct",
            lambda t: t.pop(f"{O_PROJ}.weight_zero_point"),
            rf"tensor '{O_PROJ}\.weight_zero_point' is missing from the checkpoint",
        ),
        (
            "ct",
            lambda t: t.update({f"{O_PROJ}.weight_zero_point": t[f"{O_PROJ}.weight_zero_point"][:8].contiguous()}),
            rf"model\.safetensors: tensor '{O_PROJ}\.weight_zero_point' has shape \[8, 2\]; compressed-tensors "
            r"pack-quantized stores it as \[16, 2\]",
        ),
        (
            "ct",
            lambda t: t.update({f"{O_PROJ}.weight_zero_point": t[f"{O_PROJ}.weight_zero_point"].to(torch.int64)}),
            rf"tensor '{O_PROJ}\.weight_zero_point' is I64; compressed-tensors pack-quantized stores it as I32",
        ),
        ("awq", lambda t: t.pop(f"{O_PROJ}.qzeros"), rf"tensor '{O_PROJ}\.qzeros' is missing from the checkpoint"),
        (
            "awq",
            lambda t: t.update({f"{O_PROJ}.qzeros": t[f"{O_PROJ}.qzeros"][:1].contiguous()}),
            rf"model\.safetensors: tensor '{O_PROJ}\.qzeros' has shape \[1, 16\]; awq gemm stores it as \[2, 16\]",
        ),
        (
            "awq",
            lambda t: t.update({f"{O_PROJ}.scales": t[f"{O_PROJ}.scales"].T.contiguous()}),
            rf"tensor '{O_PROJ}\.scales' has shape \[128, 2\]; awq gemm stores it as \[2, 128\]",
        ),
        (
            "awq",
            lambda t: t.update({f"{O_PROJ}.scales": t[f"{O_PROJ}.scales"].to(torch.float16)}),
            rf"tensor '{O_PROJ}\.scales' is F16; awq gemm stores it as BF16 \(the model dtype",
        ),
        (
            "awq",
            lambda t: t.update({f"{O_PROJ}.qweight": t[f"{O_PROJ}.qweight"][:, :8].contiguous()}),
            rf"tensor '{O_PROJ}\.scales' has shape \[2, 128\]; awq gemm stores it as \[2, 64\]",
        ),
    ],
    ids=["ct-no-zp", "ct-zp-shape", "ct-zp-dtype", "awq-no-qzeros", "awq-qzeros-shape", "awq-scales-shape",
         "awq-scales-dtype", "awq-qweight-shape"],
)  # fmt: skip
def test_broken_tensors_are_refused_naming_tensor_and_file(fmt, edit, message, inputs, tmp_path):
    ckpt = copy_checkpoint(inputs("dense", fmt), tmp_path / "ckpt")
    rewrite_tensors(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0])
def test_bad_awq_scales_are_refused_naming_the_tensor(value, inputs, tmp_path):
    ckpt = copy_checkpoint(inputs("dense", "awq"), tmp_path / "ckpt")
    name = f"{O_PROJ}.scales"

    def edit(tensors):
        scale = tensors[name].clone()
        scale[1, 100] = value
        tensors[name] = scale

    rewrite_tensors(ckpt, edit)
    with pytest.raises(TensorValueError, match=rf"tensor '{name}' holds {value} at index \[1, 100\]"):
        compile_to(ckpt, tmp_path / "out")


def _awq(config: dict) -> dict:
    return config["quantization_config"]


def _ct_weights(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    ("fmt", "edit", "message"),
    [
        ("awq", lambda c: _awq(c).update(group_size=64), r"quantization_config\.group_size is 64; .*groups of 128"),
        ("awq", lambda c: _awq(c).update(version="gemv"), r"quantization_config\.version is 'gemv'; .*'gemm' layout"),
        ("awq", lambda c: _awq(c).update(bits=8), r"quantization_config\.bits is 8"),
        ("awq", lambda c: _awq(c).update(zero_point=False), r"quantization_config\.zero_point is False"),
        ("awq", lambda c: _awq(c).update(desc_act=True), r"quantization_config\.'desc_act' is not read"),
        ("ct", lambda c: _ct_weights(c).update(group_size=64), r"match no qcompile scheme.*groups of 128 only"),
    ],
    ids=["awq-group-64", "awq-gemv", "awq-8-bit", "awq-no-zero-point", "awq-act-order", "ct-group-64"],
)
def test_configs_we_cannot_honour_are_refused(fmt, edit, message, inputs, tmp_path):
    ckpt = copy_checkpoint(inputs("dense", fmt), tmp_path / "ckpt")
    edit_config(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(ckpt, tmp_path / "out", "w4a16-zp")
    assert not (tmp_path / "out").exists()


def test_awq_modules_to_not_convert_must_match_the_tensors(inputs, tmp_path):
    ckpt = copy_checkpoint(inputs("dense", "awq"), tmp_path / "ckpt")
    edit_config(ckpt, lambda c: _awq(c).update(modules_to_not_convert=["o_proj"]))
    with pytest.raises(CheckpointError, match=r"o_proj is stored quantized .*lists it in 'ignore'"):
        compile_to(ckpt, tmp_path / "out")
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"


# ------------------------------------------------------------------------------ export


@pytest.fixture(scope="module")
def exported(workdir) -> Callable[[Path], Path]:
    """`exported(art)`: `qcompile export`'s compressed-tensors checkpoint of artifact `art`, cached."""
    from qcompile.publish.export import export_compressed_tensors

    made: dict[Path, Path] = {}

    def get(art: Path) -> Path:
        if art not in made:
            made[art] = workdir / f"exported-{len(made)}"
            export_compressed_tensors(art, made[art], progress=False)
        return made[art]

    return get


@pytest.mark.parametrize(("kind", "fmt"), [("dense", "ct"), ("three-groups", "ct"), ("moe", "ct"), ("moe", "awq")])
def test_export_gives_back_the_compressed_tensors_checkpoint(kind, fmt, inputs, compiled, exported):
    """Exporting the w4a16-zp artifact writes llm-compressor's W4A16_ASYM checkpoint again: every
    tensor (weight_packed, weight_scale, weight_shape, weight_zero_point packed eight rows to a word,
    everything unquantized) with the same name, dtype, shape and bytes, and an equivalent
    quantization_config. The AWQ checkpoint of the same quantization exports to the same tensors."""
    ct = inputs(kind)
    out = exported(compiled(inputs(kind, fmt)))
    ours, theirs = read_tensors(out), read_tensors(ct)
    assert_identical(ours, theirs)
    assert sum(n.endswith(".weight_zero_point") for n in ours) == sum(n.endswith(".weight_packed") for n in ours) > 0
    config, rest = quantization_config(out)
    their_config, their_rest = quantization_config(ct)
    assert group_dicts(config, OBSERVER) == group_dicts(their_config, OBSERVER)
    assert config.format == their_config.format == "pack-quantized"
    assert config.config_groups["group_0"].weights.symmetric is False
    modules = linear_modules(ct)
    assert ignored_modules(config, modules) == ignored_modules(their_config, modules)
    assert rest["tie_word_embeddings"] == their_rest["tie_word_embeddings"]


@pytest.mark.parametrize("kind", ["dense", "three-groups"])
def test_transformers_runs_the_export_as_the_dequantized_bf16_model(
    kind, ckpts, inputs, compiled, exported, workdir, rng
):
    """transformers loads the export (decompressing (code - zero) * scale) and its logits equal those
    of the bf16 checkpoint that holds the artifact's dequantized weights, on random token ids."""
    from transformers import AutoModelForCausalLM

    art = compiled(inputs(kind))
    plain = write_dequantized(ckpts[kind], workdir / f"export-dequantized-{kind}", artifact_weights(art))
    vocab = json.loads((ckpts[kind] / "config.json").read_text())["vocab_size"]
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(rng.randrange(20, 60))]])
    logits = []
    for path in (exported(art), plain):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            logits.append(model(ids).logits[0].float())
    assert logits[0].abs().max() > 0
    assert torch.equal(logits[0], logits[1]), float((logits[0] - logits[1]).abs().max())


def test_transformers_loads_no_asymmetric_moe_experts_not_even_llmcompressors(inputs, compiled, exported):
    """transformers 5's DecompressExperts builds each expert without its weight_zero_point, so it
    refuses llm-compressor's own W4A16_ASYM MoE checkpoint, and our export of it (the same tensors,
    test above) alike. A tripwire: once this fails, transformers loads them; add moe to the logits test."""
    from transformers import AutoModelForCausalLM

    for path in (inputs("moe"), exported(compiled(inputs("moe")))):
        with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    # and the export's README says so, where a dense export's says transformers loads it
    assert "transformers 5.17 does not load" in (exported(compiled(inputs("moe"))) / "README.md").read_text()
    assert "Loads with transformers" in (exported(compiled(inputs("dense"))) / "README.md").read_text()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_exporting_and_transcoding_again_gives_the_same_artifact(kind, inputs, compiled, exported, tmp_path):
    art = compiled(inputs(kind))
    assert_same_artifact(compile_to(exported(art), tmp_path / "again"), art)
