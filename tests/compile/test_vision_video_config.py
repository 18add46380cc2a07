"""A Qwen3-VL checkpoint's video_preprocessor_config.json: recorded in the artifact's manifest
(vision.video_preprocessor) as the checkpoint holds it, exported back beside preprocessor_config.json
and shown by inspect, absent when the checkpoint has none (inspect shows the defaults then); refused before anything is written when it is malformed or its
patch layout is not the tower's, naming the file and the key."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner
from qruntime.vision.video import VideoPreprocessConfig

from qcompile.cli import main
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.errors import CheckpointError
from qcompile.recipe.schema import load_recipe
from qcompile.synth import write_checkpoint


def _video_config(rng: random.Random) -> dict:
    """The tiny-vl tower's patch layout (4, 2, 2) with random sampling and pixel bounds."""
    low = rng.randrange(64, 512)
    return {
        "size": {"shortest_edge": low, "longest_edge": low * rng.randrange(4, 64)},
        "patch_size": 4,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "fps": rng.choice([1, 2, 3.5]),
        "min_frames": rng.randrange(1, 5),
        "max_frames": rng.randrange(8, 64),
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    seed = random.randrange(1 << 30)
    print(f"synth seed {seed}")
    path = tmp_path_factory.mktemp("vl") / "tiny-vl"
    write_checkpoint("tiny-vl", path, seed=seed)
    return path


def test_the_video_config_is_recorded_and_exported(ckpt, tmp_path, rng):
    video = _video_config(rng)
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(video))
    try:
        art = tmp_path / "art"
        compile_checkpoint(prepare(ckpt, load_recipe("bf16")), art, workers=1, progress=False)
    finally:
        (ckpt / "video_preprocessor_config.json").unlink()
    entry = json.loads((art / "manifest.json").read_text())["vision"]
    assert entry["video_preprocessor"] == video
    assert VideoPreprocessConfig.from_dict(entry["video_preprocessor"]).max_pixels == video["size"]["longest_edge"]
    out = tmp_path / "export"
    result = CliRunner().invoke(main, ["export", str(art), "--format", "compressed-tensors", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "video_preprocessor_config.json").read_text()) == video

    shown = CliRunner().invoke(main, ["inspect", str(art), "--json"])
    assert shown.exit_code == 0, shown.output
    low, high = video["size"]["shortest_edge"], video["size"]["longest_edge"]
    want = {"source": "video_preprocessor_config.json", "pixels": [low, high], "fps": video["fps"]}
    assert json.loads(shown.output)["vision"]["video"] == want | {"frames": [video["min_frames"], video["max_frames"]]}
    assert f"{low}..{high} pixels a video" in CliRunner().invoke(main, ["inspect", str(art)]).output

    plain = tmp_path / "plain"  # without the file: no entry, inspect shows the defaults
    compile_checkpoint(prepare(ckpt, load_recipe("bf16")), plain, workers=1, progress=False)
    assert "video_preprocessor" not in json.loads((plain / "manifest.json").read_text())["vision"]
    shown = CliRunner().invoke(main, ["inspect", str(plain), "--json"])
    assert json.loads(shown.output)["vision"]["video"]["source"] == "defaults"

    manifest = json.loads((art / "manifest.json").read_text())  # a hostile value: a clear error, no traceback
    manifest["vision"]["video_preprocessor"]["fps"] = -1
    (art / "manifest.json").write_text(json.dumps(manifest))
    shown = CliRunner().invoke(main, ["inspect", str(art)])
    assert shown.exit_code != 0 and "vision.video_preprocessor: video preprocessor config: fps" in shown.output


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"patch_size": 16}, "patch_size 16 is not the vision tower's (4"),
        ({"merge_size": 1}, "merge_size 1 is not the vision tower's (2"),
        ({"max_frames": 0}, "max_frames must be a positive integer"),
        ({"fps": "fast"}, "fps must be a positive number"),
        ({"do_pad": True}, "do_pad is not supported"),
    ],
)
def test_a_bad_video_config_stops_the_compile_naming_file_and_key(ckpt, tmp_path, rng, change, message):
    path = ckpt / "video_preprocessor_config.json"
    path.write_text(json.dumps(_video_config(rng) | change))
    try:
        with pytest.raises(CheckpointError) as caught:
            compile_checkpoint(prepare(ckpt, load_recipe("bf16")), tmp_path / "art", workers=1, progress=False)
    finally:
        path.unlink()
    assert str(path) in str(caught.value) and message in str(caught.value)
    assert not list(tmp_path.iterdir())  # nothing written
