"""`qcompile synth` end to end through click: success, refusals, and an interruption leaving nothing."""

from __future__ import annotations

import json

from click.testing import CliRunner

from qcompile.cli import main
from qcompile.synth import weights


def test_synth_writes_a_checkpoint(tmp_path, tiny_ckpt):
    out = tmp_path / "tiny"
    result = CliRunner().invoke(main, ["synth", "tiny", "-o", str(out), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert f"wrote tiny: 143.74K parameters, 287.49 kB in 1 file (seed 0) at {out}" in result.output
    assert (out / "model.safetensors").read_bytes() == (tiny_ckpt / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_synth_shards_with_max_shard_mb(tmp_path):
    out = tmp_path / "moe"
    result = CliRunner().invoke(main, ["synth", "tiny-moe", "--output", str(out), "--max-shard-mb", "0.1"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 5
    assert "in 5 shards" in result.output


def test_existing_output_is_refused_without_force(tmp_path):
    out = tmp_path / "tiny"
    out.mkdir()
    result = CliRunner().invoke(main, ["synth", "tiny", "-o", str(out)])
    assert result.exit_code == 1
    assert f"error: {out}: already exists; pass --force to replace it" in result.output
    assert list(out.iterdir()) == []
    result = CliRunner().invoke(main, ["synth", "tiny", "-o", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file()


def test_unknown_preset_lists_presets(tmp_path):
    result = CliRunner().invoke(main, ["synth", "qwen3-9b", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "unknown preset 'qwen3-9b'" in result.output
    assert "qwen3-0.6b" in result.output and "tiny-moe" in result.output
    assert list(tmp_path.iterdir()) == []


def test_help_lists_presets_with_sizes():
    result = CliRunner().invoke(main, ["synth", "--help"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip().startswith(("qwen3", "tiny"))}
    assert "8.19B" in lines["qwen3-8b"] and "16.38 GB" in lines["qwen3-8b"]
    assert "235.09B" in lines["qwen3-235b-a22b"] and "MoE" in lines["qwen3-235b-a22b"]
    assert "8.77B" in lines["qwen3-vl-8b"] and "dense" in lines["qwen3-vl-8b"]
    assert "235.67B" in lines["qwen3-vl-235b-a22b"] and "235B-A22B-Instruct" in lines["qwen3-vl-235b-a22b"]
    assert len(lines) == 20


def test_interruption_leaves_nothing(tmp_path, monkeypatch):
    real_write = weights.StreamingWriter.write
    calls = []

    def interrupted_write(self, name, byte_offset, data):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        real_write(self, name, byte_offset, data)

    monkeypatch.setattr(weights.StreamingWriter, "write", interrupted_write)
    out = tmp_path / "tiny-moe"
    result = CliRunner().invoke(main, ["synth", "tiny-moe", "-o", str(out), "--max-shard-mb", "0.05"])
    assert result.exit_code == 130
    assert "error: interrupted; no partial output was left behind" in result.output
    assert len(calls) >= 5
    assert list(tmp_path.iterdir()) == []  # neither the output nor a .tiny-moe.*.tmp directory
