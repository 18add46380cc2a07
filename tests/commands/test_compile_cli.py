"""`qcompile compile / inspect / verify` end to end, and every bad input of the issue:
a clear message naming the fault, a non-zero exit, and no partial artifact (no temp dir either)."""

import json
import math
import random
import shutil
import signal
import subprocess
import sys
import time

import onnx
import pytest
import torch
from child_signals import sigint_as
from click.testing import CliRunner
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from qcompile.cli import main
from qcompile.compile import writer


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(parent, name):
    """Anything at the output path or a temp dir beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@pytest.fixture
def ckpt(tiny_moe_ckpt, tmp_path):
    path = tmp_path / "src"
    shutil.copytree(tiny_moe_ckpt, path)
    return path


def test_compile_inspect_verify(tiny_moe_ckpt, tmp_path):
    out = tmp_path / "art"
    result = run("compile", tiny_moe_ckpt, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format_version"] == "1.0"
    assert manifest["spec"]["architecture"] == "Qwen3MoeForCausalLM"
    assert manifest["passes"] == list(manifest["recipe"]["passes"])
    assert manifest["kv_cache"]["layout"]["k_dims"] == ["blocks", "block_size", "kv_heads", "head_dim"]
    assert set(manifest["files"]) == {
        p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"
    }
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "graph.onnx", "config.json"} <= set(
        manifest["files"]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    # fused, stacked tensors as ARTIFACT.md names them
    tensors = manifest["tensors"]
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"]["dtype"] == "F8_E4M3"
    assert tensors["model.layers.0.mlp.experts.w13.weight"]["shape"] == [8, 64, 64]
    assert tensors["model.layers.0.mlp.experts.w13.weight_scale"]["shape"] == [8, 64, 1]
    assert tensors["model.layers.1.mlp.gate_up_proj.weight"]["shape"] == [256, 64]  # the dense layer
    assert tensors["lm_head.weight"]["dtype"] == "BF16"

    # the graph's external data points at exactly the safetensors bytes
    onnx.checker.check_model(str(out / "graph.onnx"))  # resolves external data beside the file
    model = onnx.load(str(out / "graph.onnx"), load_external_data=False)
    weights = {}
    for file in (out / "weights").glob("*.safetensors"):
        weights.update(load_file(file))
    onnx.load_external_data_for_model(model, str(out))
    checked = 0
    for init in model.graph.initializer:
        if init.name in weights:
            array = numpy_helper.to_array(init)
            ours = weights[init.name]
            assert list(array.shape) == list(ours.shape)
            assert array.tobytes() == ours.contiguous().view(torch.uint8).numpy().tobytes(), init.name
            checked += 1
    assert checked == len(weights)

    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    assert "Qwen3MoeForCausalLM" in result.output and "ptpc-fp8" in result.output and "layout nhd" in result.output
    info = json.loads(run("inspect", out, "--json").output)
    assert info["model"]["experts"] == 8 and info["scheme"] == "ptpc-fp8" and info["tuned_devices"] == []
    assert info["model"]["parameters"] == sum(math.prod(t["shape"]) for t in tensors.values() if t["role"] != "scale")

    result = run("verify", out)
    assert result.exit_code == 0 and result.output.startswith(f"ok: {len(manifest['files'])} files verified")

    # flip one byte in the weights: verify names that file and exits 1
    shard = next((out / "weights").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run("verify", out)
    assert result.exit_code == 1
    assert f"error: weights/{shard.name}: sha256 does not match the manifest" in result.output


def test_compile_is_deterministic_and_force_replaces(tiny_ckpt, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("compile", tiny_ckpt, "-o", a, "-q").exit_code == 0
    assert run("compile", tiny_ckpt, "-o", b, "-q", "-j", "1").exit_code == 0
    files_a = json.loads((a / "manifest.json").read_text())["files"]
    files_b = json.loads((b / "manifest.json").read_text())["files"]
    assert files_a == files_b
    result = run("compile", tiny_ckpt, "-o", a, "-q", "--recipe", "bf16", "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((a / "manifest.json").read_text())["recipe"]["name"] == "bf16"
    assert leftovers(tmp_path, "a") == ["a"]


def test_recipes_and_overrides(tiny_tied_ckpt, tmp_path):
    out = tmp_path / "art"
    result = run(
        "compile", tiny_tied_ckpt, "-o", out, "-q", "--recipe", "ptpc-fp8-lmhead",
        "--set", "kv_cache.layout=x-packed", "--set", "kv_cache.dtype=fp8_e4m3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache"]["dtype"] == "fp8_e4m3"
    assert manifest["kv_cache"]["layout"]["name"] == "x-packed"
    assert manifest["kv_cache"]["scales"] == {"calibrated": False, "k_scale": [1.0] * 2, "v_scale": [1.0] * 2}
    lm_head = manifest["tensors"]["lm_head.weight"]
    assert lm_head["dtype"] == "F8_E4M3" and lm_head["parts"] == [[["model.embed_tokens.weight", 0, 544]]]
    assert manifest["tensors"]["model.embed_tokens.weight"]["dtype"] == "BF16"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False  # as llm-compressor writes

    unfused = tmp_path / "unfused"
    assert run("compile", tiny_tied_ckpt, "-o", unfused, "-q", "--recipe", "ptpc-fp8-unfused").exit_code == 0
    manifest = json.loads((unfused / "manifest.json").read_text())
    assert manifest["passes"] == []
    assert "model.layers.0.self_attn.q_proj.weight" in manifest["tensors"]
    assert not any("qkv_proj" in name for name in manifest["tensors"])
    assert json.loads((unfused / "config.json").read_text())["tie_word_embeddings"] is True  # bf16 lm_head stays tied


def test_llmcompressor_recipe_file(tiny_ckpt, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
        "      targets: [Linear]\n      scheme: FP8_DYNAMIC\n      ignore: [lm_head, 're:.*down_proj$']\n"
    )
    out = tmp_path / "art"
    result = run("compile", tiny_ckpt, "-o", out, "-q", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    tensors = json.loads((out / "manifest.json").read_text())["tensors"]
    assert tensors["model.layers.0.mlp.down_proj.weight"]["dtype"] == "BF16"
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"]["dtype"] == "F8_E4M3"
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head", "re:.*down_proj$"]


def _rewrite(ckpt, change):
    tensors = load_file(ckpt / "model.safetensors")
    change(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def _nan(tensors):
    w = tensors["model.layers.2.self_attn.o_proj.weight"]
    w[5, 7] = float("nan")


def _inf_norm(tensors):
    tensors["model.norm.weight"][3] = float("inf")


def _wrong_dtype(tensors):
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].float()


def _wrong_shape(tensors):
    name = "model.layers.0.mlp.gate.weight"
    tensors[name] = tensors[name][:7].contiguous()


def _truncate(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _arch(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))


def _malformed(ckpt):
    (ckpt / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], ')


def _missing_shard(ckpt):
    (ckpt / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


BAD_CHECKPOINTS = {
    "nan weight": (lambda c: _rewrite(c, _nan), "'model.layers.2.self_attn.o_proj.weight' holds NaN or Inf values (first at index [5, 7]"),
    "inf norm": (lambda c: _rewrite(c, _inf_norm), "'model.norm.weight' holds NaN or Inf values"),
    "wrong dtype": (lambda c: _rewrite(c, _wrong_dtype), "tensor 'model.layers.0.self_attn.q_proj.weight' is F32, config.json says bfloat16"),
    "wrong shape": (lambda c: _rewrite(c, _wrong_shape), "tensor 'model.layers.0.mlp.gate.weight' has shape [7, 64], config.json implies [8, 64]"),
    "truncated shard": (_truncate, "model.safetensors: truncated file: tensor"),
    "unsupported architecture": (_arch, "'DeepseekV3ForCausalLM' is not supported; supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM"),
    "malformed config": (_malformed, "config.json: malformed JSON"),
    "missing shard": (_missing_shard, "model-00001-of-00002.safetensors: shard listed in model.safetensors.index.json is missing"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint(case, ckpt, tmp_path):
    damage, message = BAD_CHECKPOINTS[case]
    damage(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    result = run("compile", ckpt, "-o", tmp_path / "art", "-q")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ") and message in result.output, result.output
    assert leftovers(tmp_path, "art") == []
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # the source is untouched


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_nonfinite_weight_refused_by_the_per_tensor_prepass(value, ckpt, tmp_path, monkeypatch):
    """tensor-fp8 reads each source tensor for its amax before quantizing it: a NaN or Inf in a later
    row chunk is refused there, named with its index, before any chunk of that tensor is written."""
    name = "model.layers.2.self_attn.o_proj.weight"  # [64, 64] bf16: 7 rows per 1000-byte chunk
    row, col = random.randrange(14, 64), random.randrange(64)  # past the first two chunks

    def damage(tensors):
        tensors[name][row, col] = value

    _rewrite(ckpt, damage)
    monkeypatch.setattr(writer, "chunk_size", lambda workers: 1000)
    written, real = [], writer._run_task

    def run_task(task, *args):
        written.append(task.source)
        return real(task, *args)

    monkeypatch.setattr(writer, "_run_task", run_task)
    result = run("compile", ckpt, "-o", tmp_path / "art", "-q", "-r", "tensor-fp8")
    assert result.exit_code == 1, result.output
    expected = f"error: source tensor {name!r} holds NaN or Inf values (first at index [{row}, {col}]: {value})"
    assert expected in result.output, result.output
    assert written and name not in written  # found by the pre-pass: no chunk of it was quantized
    assert leftovers(tmp_path, "art") == []


def test_compile_tensor_fp8_recipe_by_path(tiny_moe_ckpt, tmp_path):
    """`-r recipes/tensor-fp8.yaml`: per-tensor weight scales stored [out, 1] (q, k and v rows each
    holding their own value) and a compressed-tensors config saying so."""
    from qcompile.recipe.schema import recipe_dir

    out = tmp_path / "art"
    result = run("compile", tiny_moe_ckpt, "-o", out, "-q", "-r", recipe_dir() / "tensor-fp8.yaml")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"]["quantization"]["scheme"] == "tensor-fp8"
    qkv = "model.layers.0.self_attn.qkv_proj.weight_scale"
    assert manifest["tensors"][qkv]["shape"] == [128, 1] and manifest["tensors"][qkv]["scheme"] == "tensor-fp8"
    scale = load_file(out / manifest["tensors"][qkv]["file"])[qkv][:, 0]
    assert [len(set(part.tolist())) for part in scale.split([64, 32, 32])] == [1, 1, 1]
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == group["input_activations"]["strategy"] == "tensor"
    assert run("verify", out).exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "kv_cache.layuot=hnd"], "unknown key 'kv_cache.layuot'"),
        (["--set", "quantization.scheme=int3"], "quantization.scheme 'int3' is unknown"),
        (["--recipe", "no-such-recipe"], "unknown recipe 'no-such-recipe'"),
        (["--set", "tp=3"], "'tp' must be a power of two"),
        (["--tp", "8"], "tp=8 is more than the model's num_attention_heads (4)"),
        (["--recipe", "block-fp8"], "has 64 rows, not a multiple of the 128"),
        (
            ["--set", "quantization.ignore=[lm_head, model.layers.0.mlp.down_proj]"],
            "ignore entry 'model.layers.0.mlp.down_proj' names no linear layer",
        ),
    ],
)
def test_bad_recipe(args, message, tiny_moe_ckpt, tmp_path):
    result = run("compile", tiny_moe_ckpt, "-o", tmp_path / "art", "-q", *args)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert leftovers(tmp_path, "art") == []


def test_existing_output_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run("compile", tiny_ckpt, "-o", out, "-q")
    assert result.exit_code == 1
    assert f"error: {out}: already exists; pass --force to replace it" in result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert leftovers(tmp_path, "art") == ["art"]


def test_interruption_mid_write_leaves_nothing(ckpt, tmp_path, monkeypatch):
    real = writer._run_task
    calls = []

    def interrupted(task, *args):
        calls.append(task)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(task, *args)

    monkeypatch.setattr(writer, "_run_task", interrupted)
    old = tmp_path / "art"
    old.mkdir()
    (old / "previous.txt").write_text("an older artifact")
    result = run("compile", ckpt, "-o", old, "-q", "--force", "--set", "max_shard_mb=1")
    assert result.exit_code == 130
    assert "interrupted; no partial output was left behind" in result.output
    assert len(calls) >= 6
    assert leftovers(tmp_path, "art") == ["art"]
    assert [p.name for p in old.iterdir()] == ["previous.txt"]  # --force replaces only when complete


def test_module_entry_point_error(tmp_path):
    """`python -m qcompile` in a fresh process: a user error is one line on stderr and exit 1."""
    bad = subprocess.run(
        [sys.executable, "-m", "qcompile", "compile", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and "checkpoint directory not found" in bad.stderr
    assert leftovers(tmp_path, "x") == []


def test_too_little_disk_is_refused_up_front(tiny_ckpt, tmp_path, monkeypatch):
    from qcompile.io import atomic

    class Usage:
        total, used, free = 10**12, 10**12 - 4096, 4096

    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: Usage())
    result = run("compile", tiny_ckpt, "-o", tmp_path / "art", "-q")
    assert result.exit_code == 1
    assert "the artifact needs about" in result.output and "only 4.10 kB is free" in result.output
    assert leftovers(tmp_path, "art") == []


def test_dry_run_and_help(tiny_moe_ckpt, tmp_path):
    result = run("compile", tiny_moe_ckpt, "-o", tmp_path / "art", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "fuse_moe_experts" in result.output and "dry run: checkpoint and recipe are valid" in result.output
    assert leftovers(tmp_path, "art") == []
    help_text = run("compile", "--help").output
    for word in ("--recipe", "--set", "--force", "--dry-run", "ptpc-fp8-lmhead", "only when complete"):
        assert word in help_text


def _signal_mid_compile(make_ckpt, tmp_path, signum, sigint):
    """`python -m qcompile compile` of a checkpoint big enough to take a while, started with SIGINT's
    disposition `sigint` and sent `signum` once its temp dir appears; (process, stderr, whether the
    temp dir was still there after the signal was sent, i.e. the compile was still writing)."""
    ckpt = make_ckpt(
        "tiny", hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128,
    )  # fmt: skip
    out = tmp_path / "art"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcompile", "compile", str(ckpt), "-o", str(out), "-q", "-j", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as(sigint),  # not whatever pytest's is (ignored when started by `cmd &`)
    )
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".art.") for p in tmp_path.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the compile never started writing"
        time.sleep(0.005)
    proc.send_signal(signum)
    mid_compile = any(p.name.startswith(".art.") for p in tmp_path.iterdir())
    _, stderr = proc.communicate(timeout=120)
    return proc, stderr, mid_compile


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_signal_mid_compile_leaves_nothing(make_ckpt, tmp_path, signame, code):
    """A real Ctrl-C (SIGINT) or kill (SIGTERM) to a compiling process: no artifact, no temp dir."""
    proc, stderr, _ = _signal_mid_compile(make_ckpt, tmp_path, getattr(signal, signame), signal.SIG_DFL)
    assert proc.returncode == code, stderr
    assert "interrupted; no partial output was left behind" in stderr
    assert leftovers(tmp_path, "art") == []


def test_sigint_ignored_at_start_stays_ignored_mid_compile(make_ckpt, tmp_path):
    """Started with SIGINT ignored (as a shell script's `cmd &` is), the compile keeps ignoring it, as
    Python itself does: a SIGINT mid-compile changes nothing, the artifact is complete."""
    proc, stderr, mid_compile = _signal_mid_compile(make_ckpt, tmp_path, signal.SIGINT, signal.SIG_IGN)
    assert mid_compile, "the compile ended before the signal: nothing was tested"
    assert proc.returncode == 0, stderr
    assert leftovers(tmp_path, "art") == ["art"]
    out = tmp_path / "art"
    result = run("verify", out)
    assert result.exit_code == 0 and result.output.startswith("ok: "), result.output
    tensors = json.loads((out / "manifest.json").read_text())["tensors"]
    assert {n.split(".")[2] for n in tensors if n.startswith("model.layers.")} == {str(i) for i in range(8)}
