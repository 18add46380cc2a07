"""bench/materialize_synthetic.py: a synthetic artifact with its random weights written into its
files loads from disk (no longer labelled synthetic, every file's sha256 right) and generates the
tokens the synthetic artifact generates from the same values made at load."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import qruntime
from qruntime.artifact import verify_files

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from materialize_synthetic import materialize  # noqa: E402 -- bench/ is scripts, not a package


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_written_weights_load_from_disk_as_the_synthetic_ones(tmp_path, preset):
    art = tmp_path / "art"
    write_synthetic_artifact(preset, art, load_recipe("ptpc-fp8"), progress=False)
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 12))]
    params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
    with qruntime.load(art, "cpu", num_kv_blocks=16) as synthetic:
        assert "SYNTHETIC" in synthetic.description["weights"]
        want = synthetic.generate([prompt], params)[0].token_ids

    written = materialize(art, "cpu", progress=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert "synthetic" not in manifest and verify_files(art) == []
    shards = [art / rel for rel in manifest["files"] if rel.startswith("weights/")]
    assert written > 0.9 * sum(p.stat().st_size for p in shards)
    assert all(p.stat().st_blocks * 512 >= p.stat().st_size - 4096 for p in shards)  # no hole left
    with qruntime.load(art, "cpu", num_kv_blocks=16) as loaded:
        assert "weights" not in loaded.description  # read from the files
        assert loaded.generate([prompt], params)[0].token_ids == want


def test_only_a_synthetic_artifact_is_materialized(tiny_ckpt, compiled):
    with pytest.raises(SystemExit, match="not a synthetic artifact"):
        materialize(compiled(tiny_ckpt, "ptpc-fp8"), "cpu", progress=False)
