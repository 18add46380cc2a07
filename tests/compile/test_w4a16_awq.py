"""`w4a16-awq` (issue 20): AWQ scales searched on --calib text, one source layer at a time, folded
into the source while the writer streams it, then the w4a16 round to nearest.

Fresh random checkpoints each run (the seed printed), dense and Qwen3-MoE. Folding scales leaves the
unquantized model's function unchanged (fp32), the MoE router's logits included; the experts' search
inputs are the tokens routed to each; the artifact compiles, loads and generates, its linears (the
stacked experts too) being exactly w4a16's quantization of the scaled source; the search holds one
layer at a time; bad inputs are errors naming the flag, the file or the tensor."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from qcompile.compile import awq_groups
from qcompile.compile.awq_groups import layer_groups
from qcompile.compile.awq_scales import AwqScales
from qcompile.compile.awq_search import CalibrationSize, search_awq
from qcompile.compile.calibrate import CalibrationError
from qcompile.compile.pipeline import prepare
from qcompile.compile.source_layers import SourceLayers
from qcompile.errors import PlanError
from qcompile.quant.awq import AwqConfig
from qcompile.recipe.schema import RecipeError, load_recipe
from qcompile.source.checkpoint import Checkpoint

# every K a multiple of 128; 4 KV heads of 4: v_proj's rows are o_proj's columns (the v -> o group runs)
SHAPES = {"hidden_size": 128, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 4}
GQA = {**SHAPES, "num_key_value_heads": 2}
# tiny-moe: layers 0 and 2 sparse (8 experts of 128, top 2), layer 1 dense (intermediate 128)
MOE = {**SHAPES, "moe_intermediate_size": 128}
MODELS = {"dense": ("tiny", SHAPES), "moe": ("tiny-moe", MOE)}
SMALL = CalibrationSize(seq_len=64, max_sequences=12, batch=4)
QUICK = AwqConfig(n_grid=4)


@pytest.fixture
def seed() -> int:
    value = random.randrange(1 << 30)
    print(f"seed {value}")
    return value


def _text(path: Path, words: int, seed: int) -> Path:
    rng = random.Random(seed)
    vocab = ["def", "return", "self", "import", "class", "(", ")", ":", "x", "=", "+", "1", "for", "in", "\n"]
    path.write_text(" ".join(rng.choice(vocab) for _ in range(words)))
    return path


def _cli(*args):
    from click.testing import CliRunner

    from qcompile.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("model", MODELS)
def test_folding_scales_leaves_the_unquantized_model_unchanged(make_ckpt, seed, tmp_path, model):
    """Random scales (log-normal, far from 1) on exactly the tensors the search scales, one vector
    per searched group shared by its smooth op's rows and its linears' columns (the MoE router's
    among them): the fp32 model with them folded in gives the fp32 model's logits."""
    preset, shapes = MODELS[model]
    ckpt = make_ckpt(preset, seed=seed, **shapes)
    checkpoint = Checkpoint.open(ckpt)
    searched = search_awq(
        checkpoint, load_recipe("w4a16-awq"), _text(tmp_path / "c.txt", 4000, seed), config=QUICK, size=SMALL
    )
    entries = [g for g in searched.searched if not g.get("skipped")]
    assert "self_attn.v_proj" in {g["smooth"] for g in entries}
    gen = torch.Generator().manual_seed(seed)
    columns, rows = {}, {}
    for entry in entries:
        layer = entry["layer"]
        group = next(g for g in layer_groups(checkpoint.spec, layer) if g.smooth == entry["smooth"])
        s = torch.exp(torch.randn(searched.rows[f"model.layers.{layer}.{group.smooth}.weight"].shape, generator=gen))
        rows[f"model.layers.{layer}.{group.smooth}.weight"] = s
        columns.update({f"model.layers.{layer}.{b}.weight": s for b in group.balance})
    assert set(columns) == set(searched.columns) and set(rows) == set(searched.rows)
    if model == "moe":  # the router's columns follow the experts' gate/up; every expert's down is searched
        assert {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"} <= set(columns)
        assert len([g for g in searched.searched if ".experts." in g["smooth"]]) == 2 * 8
        assert len({g["layer"] for g in entries}) == 3
    else:
        assert len(entries) == 4 * 2  # 4 groups, 2 layers
    folded = AwqScales(columns, rows, searched.calibration)
    model_ = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    changed = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    state = changed.state_dict()
    for name, stacked in _stacked_experts(folded, checkpoint).items():  # transformers stacks the experts
        state[name] = stacked
    changed.load_state_dict({k: folded.apply(k, 0, v.shape[0], v) for k, v in state.items()})
    assert not torch.equal(
        changed.model.layers[0].input_layernorm.weight, model_.model.layers[0].input_layernorm.weight
    )
    ids = torch.randint(0, 500, (2, 48), generator=gen)
    with torch.inference_mode():
        want, got = model_(ids).logits, changed(ids).logits
        if model == "moe":
            for layer in (0, 2):  # the router sees the norm's output divided by s, through columns times s
                mlp, mlp_ = changed.model.layers[layer].mlp, model_.model.layers[layer].mlp
                h = torch.randn(64, 128, generator=gen)
                norm = f"model.layers.{layer}.post_attention_layernorm.weight"
                torch.testing.assert_close(mlp.gate(h / rows[norm])[0], mlp_.gate(h)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _stacked_experts(scales: AwqScales, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """transformers' stacked expert parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with
    each source expert tensor's scales applied, for the layers whose experts the scales touch."""
    out = {}
    moe = checkpoint.spec.moe
    for layer in range(checkpoint.spec.num_hidden_layers):
        if moe is None or not checkpoint.spec.is_sparse_layer(layer):
            continue

        def scaled(e: int, proj: str, layer: int = layer) -> torch.Tensor:
            name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            entry = checkpoint.entry(name)
            return scales.apply(name, 0, entry.shape[0], entry.read_rows(0, entry.shape[0]).float())

        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([scaled(e, "gate_proj"), scaled(e, "up_proj")]) for e in range(moe.num_experts)]
        )
        out[prefix + "down_proj"] = torch.stack([scaled(e, "down_proj") for e in range(moe.num_experts)])
    return out


def test_experts_search_inputs_are_the_tokens_routed_to_them(make_ckpt, seed):
    """routed_inputs: each expert's down_proj input on the tokens the router sends it. Their down_proj
    outputs, weighted by the router and summed per token, are the MoE block's output."""
    ckpt = make_ckpt("tiny-moe", seed=seed, **MOE)
    source = SourceLayers(Checkpoint.open(ckpt), "test")
    module = source.layer(0).float()
    mlp = module.mlp
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(2, 24, 128, generator=gen), torch.randn(1, 7, 128, generator=gen)]
    with torch.inference_mode():
        chosen = awq_groups.routes(mlp, inputs)
        for x, picked in zip(inputs, chosen, strict=True):
            want = mlp(x).reshape(-1, 128)
            _, weights, _ = mlp.gate(x.reshape(-1, 128))
            got = torch.zeros_like(want)
            counted = 0
            for e in range(8):
                routed = awq_groups.routed_inputs(mlp, [x], [picked], e, torch.float32)
                tokens = (picked == e).any(-1).nonzero().squeeze(-1)
                assert routed.shape == (tokens.numel(), 128)
                down = routed @ mlp.experts.down_proj[e].T
                got.index_add_(0, tokens, down * weights[tokens, (picked[tokens] == e).int().argmax(-1), None])
                counted += tokens.numel()
            assert counted == x.shape[0] * x.shape[1] * 2  # top 2: every token reaches two experts
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_an_expert_no_calibration_token_reaches_keeps_scales_of_one(make_ckpt, seed, tmp_path, monkeypatch):
    """An expert the router never picks on the calibration text has no inputs to search its down_proj
    on: its up rows and down columns are left alone (AWQModifier skips it too) and the manifest's
    entry says so; its gate/up columns still take the group's scales with every other expert's."""
    routes = awq_groups.routes
    monkeypatch.setattr(awq_groups, "routes", lambda mlp, x: [torch.where(c == 7, 0, c) for c in routes(mlp, x)])
    ckpt = make_ckpt("tiny-moe", seed=seed, **MOE)
    result = search_awq(
        Checkpoint.open(ckpt), load_recipe("w4a16-awq"), _text(tmp_path / "c.txt", 4000, seed), config=QUICK, size=SMALL
    )
    skipped = {(g["layer"], g["smooth"], g["tokens"]) for g in result.searched if g.get("skipped")}
    # others may be unreached too: a random router can leave an expert without tokens
    assert {(0, "mlp.experts.7.up_proj", 0), (2, "mlp.experts.7.up_proj", 0)} <= skipped
    assert all(tokens == 0 for _, _, tokens in skipped)
    assert all("alpha" not in g for g in result.searched if g.get("skipped"))
    for layer in (0, 2):
        expert = f"model.layers.{layer}.mlp.experts.7"
        assert f"{expert}.down_proj.weight" not in result.columns and f"{expert}.up_proj.weight" not in result.rows
        norm = result.rows[f"model.layers.{layer}.post_attention_layernorm.weight"]
        assert torch.equal(result.columns[f"{expert}.up_proj.weight"], norm)


@pytest.mark.parametrize("model", MODELS)
def test_awq_artifact_compiles_loads_and_generates(make_ckpt, seed, tmp_path, monkeypatch, model):
    """The CLI end to end: the manifest records the recipe and the calibration; the runtime
    generates, close to the unquantized model (grouped-query attention: no v -> o group)."""
    import qruntime
    from qruntime.artifact import read_manifest

    from qcompile.compile import awq_search

    monkeypatch.setattr(awq_search, "CalibrationSize", lambda: SMALL)  # small text: a fast test
    monkeypatch.setattr(awq_search, "AwqConfig", lambda: QUICK)
    preset, shapes = MODELS[model]
    ckpt = make_ckpt(preset, seed=seed, **{**shapes, "num_key_value_heads": 2})
    calib = _text(tmp_path / "calib.txt", 4000, seed)
    art, rtn = tmp_path / "awq", tmp_path / "rtn"
    result = _cli("compile", ckpt, "-o", art, "-r", "w4a16-awq", "--calib", calib, "-q")
    assert result.exit_code == 0, result.output
    assert _cli("compile", ckpt, "-o", rtn, "-r", "w4a16", "-q").exit_code == 0
    manifest = read_manifest(art)
    assert manifest["recipe"]["name"] == "w4a16-awq" and manifest["recipe"]["quantization"]["method"] == "awq"
    entry = manifest["awq"]
    assert entry["calibration"]["file"] == "calib.txt" and entry["calibration"]["tokens"] == 12 * 64
    assert len(entry["calibration"]["sha256"]) == 64
    smooths = {g["smooth"] for g in entry["groups"]}
    assert {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"} <= smooths
    if model == "moe":
        experts = [g for g in entry["groups"] if ".experts." in g["smooth"]]
        assert smooths - {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"} == {
            f"mlp.experts.{e}.up_proj" for e in range(8)
        }
        assert {g["layer"] for g in experts} == {0, 2}
        assert sum(g["tokens"] for g in experts) == 2 * 2 * 12 * 64  # top 2, two sparse layers
    else:
        assert smooths == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}
    assert "method" not in read_manifest(rtn)["recipe"]["quantization"]

    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist() for n in (5, 17)]
    engine = qruntime.load(art, device="cpu", dtype=torch.float32)
    outputs = engine.generate(prompts, qruntime.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = prompts[1]
    with torch.inference_mode():
        ref = reference(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids).float()
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (got - ref).pow(2).mean())
    assert float(sqnr) > 10, float(sqnr)  # int4 of a random model: close, not equal


def _artifact_weights(art: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for f in (art / "weights").glob("*.safetensors"):
        weights.update(load_file(f))
    return weights


def _drawn_scales(prepared, seed: int):
    """`prepared` with random scales in [0.5, 2] standing in for the searched ones (which may be 1:
    seed 335760566 chose alpha 0 for layer 1's MLP in CI, and then nothing would show that the
    writer applies them)."""
    generator = torch.Generator().manual_seed(seed)

    def drawn(scales: torch.Tensor) -> torch.Tensor:
        return torch.empty(scales.shape).uniform_(0.5, 2.0, generator=generator)

    searched = prepared.awq
    return dataclasses.replace(
        searched,
        columns={k: drawn(v) for k, v in searched.columns.items()},
        rows={k: drawn(v) for k, v in searched.rows.items()},
    )


def _scaled_source(awq: AwqScales, source: Checkpoint, name: str) -> torch.Tensor:
    entry = source.entry(name)
    return awq.apply(name, 0, entry.shape[0], entry.read_rows(0, entry.shape[0]))


def test_awq_artifact_linears_are_w4a16_of_the_scaled_source(make_ckpt, seed, tmp_path, monkeypatch):
    """The writer applies the scales it is given: the artifact's gate_up is the RTN int4 of [gate;
    up] with its columns scaled (up's rows divided by down's scales), its norms divided."""
    from qcompile.compile import awq_search
    from qcompile.compile.pipeline import compile_checkpoint, prepare
    from qcompile.quant.int4 import quantize_int4

    monkeypatch.setattr(awq_search, "CalibrationSize", lambda: SMALL)
    monkeypatch.setattr(awq_search, "AwqConfig", lambda: QUICK)
    ckpt = make_ckpt("tiny", seed=seed, **GQA)
    calib = _text(tmp_path / "calib.txt", 4000, seed)
    prepared = prepare(ckpt, load_recipe("w4a16-awq"), calib, progress=False)
    awq = _drawn_scales(prepared, seed)
    compile_checkpoint(dataclasses.replace(prepared, awq=awq), tmp_path / "art", progress=False)
    source = Checkpoint.open(ckpt)
    weights = _artifact_weights(tmp_path / "art")
    p = "model.layers.1"
    parts = [_scaled_source(awq, source, f"{p}.mlp.{proj}.weight") for proj in ("gate_proj", "up_proj")]
    packed, scale = quantize_int4(torch.cat(parts), 128)
    fused = [k for k in weights if k.startswith(f"{p}.") and "gate_up" in k and k.endswith("weight_packed")]
    assert len(fused) == 1
    assert torch.equal(weights[fused[0]], packed)
    assert torch.equal(weights[fused[0].replace("weight_packed", "weight_scale")], scale)
    norm = f"{p}.post_attention_layernorm.weight"
    raw = source.entry(norm).read_rows(0, source.entry(norm).shape[0])
    want = (raw.float() / awq.rows[norm]).to(raw.dtype)
    assert any(torch.equal(v, want) for k, v in weights.items() if "post_attention_layernorm" in k)
    assert not torch.equal(want, raw)


def test_awq_moe_artifact_experts_are_w4a16_of_the_scaled_source(make_ckpt, seed, tmp_path, monkeypatch):
    """MoE: the artifact's stacked experts (w13 [E, 2I, H/8], w2 [E, H, I/8] packed) are, expert by
    expert, the RTN int4 of the scaled source's [gate; up] and down; the router stays bf16 with its
    columns scaled like the experts' gate/up, and the norm before them divided by the same scales."""
    from qcompile.compile import awq_search
    from qcompile.compile.pipeline import compile_checkpoint, prepare
    from qcompile.quant.int4 import quantize_int4

    monkeypatch.setattr(awq_search, "CalibrationSize", lambda: SMALL)
    monkeypatch.setattr(awq_search, "AwqConfig", lambda: QUICK)
    ckpt = make_ckpt("tiny-moe", seed=seed, **MOE)
    prepared = prepare(ckpt, load_recipe("w4a16-awq"), _text(tmp_path / "calib.txt", 4000, seed), progress=False)
    awq = _drawn_scales(prepared, seed)
    compile_checkpoint(dataclasses.replace(prepared, awq=awq), tmp_path / "art", progress=False)
    source = Checkpoint.open(ckpt)
    weights = _artifact_weights(tmp_path / "art")
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp"
        router, norm = f"{p}.gate.weight", f"model.layers.{layer}.post_attention_layernorm.weight"
        searched = prepared.awq  # one vector per group: the router's logits unchanged by the fold
        assert torch.equal(searched.columns[router], searched.rows[norm])
        for e in range(8):
            expert = f"{p}.experts.{e}"
            assert torch.equal(searched.columns[f"{expert}.gate_proj.weight"], searched.rows[norm])
            assert torch.equal(searched.columns[f"{expert}.up_proj.weight"], searched.rows[norm])
            if f"{expert}.up_proj.weight" not in searched.rows:  # no calibration token reached it (a seed in testing)
                assert f"{expert}.down_proj.weight" not in searched.columns
                continue
            assert torch.equal(
                searched.columns[f"{expert}.down_proj.weight"], searched.rows[f"{expert}.up_proj.weight"]
            )
        assert torch.equal(weights[router], _scaled_source(awq, source, router))
        assert weights[router].dtype == torch.bfloat16 and not torch.equal(
            weights[router], source.entry(router).read_rows(0, 8)
        )
        w13 = [
            quantize_int4(
                torch.cat(
                    [_scaled_source(awq, source, f"{p}.experts.{e}.{proj}.weight") for proj in ("gate_proj", "up_proj")]
                ),
                128,
            )
            for e in range(8)
        ]
        w2 = [quantize_int4(_scaled_source(awq, source, f"{p}.experts.{e}.down_proj.weight"), 128) for e in range(8)]
        for name, parts in ((f"{p}.experts.w13", w13), (f"{p}.experts.w2", w2)):
            assert torch.equal(weights[f"{name}.weight_packed"], torch.stack([q for q, _ in parts]))
            assert torch.equal(weights[f"{name}.weight_scale"], torch.stack([s for _, s in parts]))
        want = _scaled_source(awq, source, norm)
        assert any(torch.equal(v, want) for k, v in weights.items() if f"layers.{layer}.post_attention_layernorm" in k)


@pytest.mark.parametrize("model", MODELS)
def test_the_search_holds_one_layer_at_a_time(make_ckpt, seed, tmp_path, monkeypatch, model):
    """When a layer's weights are read, every earlier layer's module is gone (the source streams)."""
    preset, shapes = MODELS[model]
    ckpt = make_ckpt(preset, seed=seed, **shapes, num_hidden_layers=3)
    alive: list[weakref.ref] = []
    original = SourceLayers.layer

    def layer(self, index):
        gc.collect()
        assert all(ref() is None for ref in alive), f"layer {index} read while an earlier one is held"
        module = original(self, index)
        alive.append(weakref.ref(module))
        return module

    monkeypatch.setattr(SourceLayers, "layer", layer)
    result = search_awq(
        Checkpoint.open(ckpt), load_recipe("w4a16-awq"), _text(tmp_path / "c.txt", 3000, seed), config=QUICK, size=SMALL
    )
    assert len(alive) == 3 and len({g["layer"] for g in result.searched}) == 3


def test_bad_inputs_are_errors_naming_the_flag_or_the_file(make_ckpt, seed, tmp_path):
    ckpt = make_ckpt("tiny", seed=seed, **GQA)
    out = tmp_path / "art"
    missing = _cli("compile", ckpt, "-o", out, "-r", "w4a16-awq", "-q")
    assert missing.exit_code == 1 and "--calib" in missing.output and not out.exists()
    absent = _cli("compile", ckpt, "-o", out, "-r", "w4a16-awq", "--calib", tmp_path / "no.txt", "-q")
    assert absent.exit_code == 1 and "no.txt" in absent.output and not out.exists()
    short = _text(tmp_path / "short.txt", 150, seed)
    with pytest.raises(CalibrationError, match="short.txt"):
        search_awq(Checkpoint.open(ckpt), load_recipe("w4a16-awq"), short, config=QUICK, size=SMALL)
    with pytest.raises(RecipeError, match="quantization.method"):
        load_recipe("w4a16-awq", ["quantization.scheme=ptpc-fp8"])
    with pytest.raises(RecipeError, match="quantization.method"):
        load_recipe("w4a16", ["quantization.method=gptq"])
    # experts 32 wide: not whole int4 groups, the expert tensor named before any search
    moe = make_ckpt("tiny-moe", seed=seed, **SHAPES)
    calib = _text(tmp_path / "calib.txt", 4000, seed)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight"):
        prepare(moe, load_recipe("w4a16-awq"), calib, progress=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight"):
        AwqScales({"model.layers.0.mlp.experts.3.down_proj.weight": torch.ones(7)}, {}, ("c", "", 0)).apply(
            "model.layers.0.mlp.experts.3.down_proj.weight", 0, 4, torch.ones(4, 128)
        )
