"""What of the GPU fast path can be checked without a GPU: tuned-config tables, the decode bandwidth
floor's byte count, backend selection errors, and the tune / bench commands on a CPU machine."""

from __future__ import annotations

import json
import math

import pytest
import qruntime
import torch
from click.testing import CliRunner
from qruntime.artifact import read_manifest
from qruntime.benchmark import DTYPE_BYTES, decode_step_bytes
from qruntime.kernel_configs import KernelTable, device_file, load_kernel_table
from qruntime.load_options import resolve_backend

from qcompile.cli import main as qcompile_main


def gemm(block_m: int) -> dict:
    """A valid Triton PTPCLinear config (the tuner's record) with this block_m."""
    return {
        "backend": "triton",
        "block_m": block_m,
        "block_n": 64,
        "block_k": 128,
        "split_k": 1,
        "num_warps": 4,
        "num_stages": 3,
    }


def test_kernel_table_picks_the_smallest_bucket_at_or_above_the_tokens():
    table = KernelTable.from_dict(
        {
            "device": "GPU X",
            "entries": {"PTPCLinear:8x4": {"1": gemm(16), "16": gemm(32), "256": {"backend": "cublaslt"}}},
        },
        "t.json",
    )
    picks = {m: table.lookup("PTPCLinear:8x4", m).get("block_m", "cublaslt") for m in (1, 2, 16, 17, 256, 9000)}
    assert picks == {1: 16, 2: 32, 16: 32, 17: "cublaslt", 256: "cublaslt", 9000: "cublaslt"}
    assert table.lookup("PTPCLinear:9x9", 4) is None
    with pytest.raises(ValueError, match="t.json: not a kernel-config table"):
        KernelTable.from_dict({"entries": {}}, "t.json")


def test_a_table_of_another_gpu_is_refused(tmp_path):
    name = "NVIDIA H100 80GB HBM3"
    assert device_file(name) == "NVIDIA_H100_80GB_HBM3.json"
    assert load_kernel_table(tmp_path, name) is None
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / device_file(name)).write_text(json.dumps({"device": "NVIDIA H200", "entries": {}}))
    with pytest.raises(ValueError, match="tuned for 'NVIDIA H200', not for this GPU"):
        load_kernel_table(tmp_path, name)


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_tied_ckpt"])
def test_decode_step_bytes_counts_each_weight_once(request, fixture, compiled):
    manifest = read_manifest(compiled(request.getfixturevalue(fixture), "ptpc-fp8"))
    tensors = manifest["tensors"]
    everything = sum(math.prod(t["shape"]) * DTYPE_BYTES[t["dtype"]] for t in tensors.values())
    embed = tensors["model.embed_tokens.weight"]
    row = embed["shape"][1] * DTYPE_BYTES[embed["dtype"]]
    table = embed["shape"][0] * row
    kv = manifest["kv_cache"]
    per_token_kv = 2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_dim"] * 2
    # an untied (or fp8-lm_head) model reads 3 embedding rows for 3 sequences; a bf16 tied lm_head reads the table
    reads_table = manifest["spec"]["tie_word_embeddings"] and "lm_head.weight" not in tensors
    expected = everything - (0 if reads_table else table - 3 * row) + 3 * 100 * per_token_kv
    assert decode_step_bytes(manifest, batch=3, context_len=100) == expected


def test_backend_choices_are_checked(tiny_ckpt, compiled):
    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    with pytest.raises(ValueError, match="backend 'triton' runs on a CUDA device"):
        qruntime.load(artifact, device="cpu", backend="triton")
    with pytest.raises(ValueError, match="backend 'fast' is not one of"):
        qruntime.load(artifact, device="cpu", backend="fast")
    with pytest.raises(ValueError, match="cuda_graphs=True but some ops of this graph cannot be captured"):
        qruntime.load(artifact, device="cpu", cuda_graphs=True, num_kv_blocks=16)
    assert qruntime.load(artifact, device="cpu", num_kv_blocks=16).description["backend"] == "reference"


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("cuda", torch.bfloat16, "triton"),
        ("cuda", torch.float16, "triton"),
        ("cuda", torch.float32, "reference"),
        ("cpu", torch.bfloat16, "reference"),
        ("cpu", torch.float32, "reference"),
    ],
)
def test_auto_backend_is_triton_only_where_its_kernels_compute(device, dtype, expected):
    assert resolve_backend("auto", torch.device(device), dtype) == expected


def test_triton_backend_refuses_fp32():
    with pytest.raises(ValueError, match="computes in bf16 or fp16, not torch.float32"):
        resolve_backend("triton", torch.device("cuda"), torch.float32)
    assert resolve_backend("triton", torch.device("cuda"), torch.bfloat16) == "triton"


def test_bench_command_reports_each_batch(tiny_ckpt, compiled):
    result = CliRunner().invoke(
        qcompile_main,
        [
            "bench",
            str(compiled(tiny_ckpt, "ptpc-fp8")),
            "--input-len",
            "9",
            "--output-len",
            "4",
            "--batch",
            "1,3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["output_tokens_per_s"] > 0 for r in rows)
    assert rows[1]["decode_tokens_per_s"] == pytest.approx(3 / (rows[1]["tpot_ms"] / 1e3))


def test_tune_needs_a_gpu_and_compile_tune_writes_nothing_without_one(tiny_ckpt, compiled, tmp_path):
    runner = CliRunner()
    result = runner.invoke(qcompile_main, ["tune", str(compiled(tiny_ckpt, "ptpc-fp8"))])
    assert result.exit_code == 1 and "tuning needs a CUDA GPU" in result.output
    out = tmp_path / "art"
    result = runner.invoke(qcompile_main, ["compile", str(tiny_ckpt), "-o", str(out), "--tune", "-q"])
    assert result.exit_code == 1 and "--tune needs a CUDA GPU" in result.output
    assert not out.exists()
