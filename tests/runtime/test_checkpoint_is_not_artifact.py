"""A Hugging Face checkpoint given where an artifact belongs (`qcompile run CKPT`, `qruntime run`,
`qcompile verify`, `qruntime.load`) is named as one, with the command that compiles it, instead of
`manifest.json: not found`; and the command shown works. (`qcompile inspect CKPT` takes checkpoints
too: it describes one, tests/compile/test_prequantized_fp8.py.)"""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
import qruntime
from cli_child import run_in_child
from click.testing import CliRunner
from qruntime.artifact import ArtifactFormatError

from qcompile.cli import main as qcompile_main


def hint(path) -> str:
    return (
        f"{path}: a Hugging Face checkpoint, not a compiled artifact (it has config.json and safetensors weights "
        f"but no manifest.json); compile it first: qcompile compile {shlex.quote(str(path))} -o ART"
    )


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path, rng):
    """A copy of the tiny checkpoint under a fresh name with a space in it (the command shown quotes it)."""
    path = tmp_path / f"my ckpt-{rng.randrange(1 << 30)}"
    shutil.copytree(tiny_ckpt, path)
    return path


def test_every_entry_point_says_checkpoint_and_how_to_compile(ckpt):
    calls = [
        ("qcompile", ["run", ckpt, "hi"]),
        ("qruntime", ["run", ckpt, "hi"]),
        ("qcompile", ["verify", ckpt]),
    ]
    for (cli, args), outcome in zip(calls, run_in_child(calls), strict=True):
        assert outcome.code == 1 and outcome.out == "", (cli, args, outcome)
        assert outcome.err == f"error: {hint(ckpt)}\n", (cli, args, outcome)
        assert not outcome.torch, (cli, args)  # found before the engine is imported
    with pytest.raises(ArtifactFormatError) as caught:
        qruntime.load(ckpt, "cpu")
    assert str(caught.value) == hint(ckpt)


def test_a_sharded_checkpoint_is_recognised_by_its_index(ckpt, tmp_path):
    """config.json and model.safetensors.index.json, the shards elsewhere: still a checkpoint."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(ckpt / "config.json", sharded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ArtifactFormatError) as caught:
        qruntime.load(sharded, "cpu")
    assert str(caught.value) == hint(sharded)


@pytest.mark.parametrize("keep", [["config.json"], ["model.safetensors"], []])
def test_half_a_checkpoint_is_not_called_one(ckpt, tmp_path, keep):
    """Without both config.json and weights, nothing says it is a checkpoint: the plain message."""
    folder = tmp_path / "partial"
    folder.mkdir()
    for name in keep:
        shutil.copy(ckpt / name, folder)
    with pytest.raises(ArtifactFormatError) as caught:
        qruntime.load(folder, "cpu")
    assert str(caught.value) == f"{folder / 'manifest.json'}: not found; is {folder} a qcompile artifact?"


def test_the_command_shown_compiles_it(ckpt, tmp_path):
    result = CliRunner().invoke(qcompile_main, ["run", str(ckpt), "hi"])
    assert result.exit_code == 1
    command = shlex.split(result.stderr.rsplit("compile it first: ", 1)[1])
    assert command[:2] == ["qcompile", "compile"] and command[-2:] == ["-o", "ART"]
    art = tmp_path / "art"
    compiled = CliRunner().invoke(qcompile_main, [*command[1:-1], str(art), "-q"])
    assert compiled.exit_code == 0, compiled.output
    ran = CliRunner().invoke(qcompile_main, ["run", str(art), "hi", "--max-tokens", "2", "--ignore-eos", "--json"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["output_tokens"] == 2
