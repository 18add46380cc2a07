"""`qcompile publish ART --to DIR` end to end: the published folder (artifact files unchanged, model
card, runtime wheel), re-publishing, refusals that leave the target untouched, the dry run, the
wheel fallback, and the bundled wheel installed into a fresh virtualenv that has no qcompile."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import qruntime
import torch
import yaml
from click.testing import CliRunner
from qruntime.artifact import sha256_file

from qcompile.cli import main
from qcompile.publish import runtime_wheel
from qcompile.recipe.schema import load_recipe

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "qwen3-stdlib"  # a small trained Qwen3
WHEEL = "runtime/qcompile_runtime-*-py3-none-any.whl"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree(root: Path) -> dict[str, bytes]:
    """relative path -> bytes of every file under root."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def beside(path: Path) -> list[str]:
    """The target and any temporary directory left beside it."""
    return sorted(p.name for p in path.parent.iterdir() if p.name == path.name or p.name.startswith(f".{path.name}."))


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The trained fixture with a model card naming its license, and a LICENSE file."""
    path = tmp_path_factory.mktemp("publish") / "qwen3-stdlib"
    shutil.copytree(FIXTURE, path)
    (path / "README.md").write_text(
        "---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# qwen3-stdlib\n", encoding="utf-8"
    )
    (path / "LICENSE").write_text(f"Apache License 2.0 ({random.getrandbits(64):x})\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def art(source) -> Path:
    """The compiled artifact (read-only: copy it before changing it)."""
    out = source.parent / "art"
    result = run("compile", source, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def eval_json(tmp_path) -> tuple[Path, dict]:
    """A `qcompile eval --json` result with fresh random numbers."""
    rng = random.Random()
    ppl_ref = rng.uniform(5, 50)
    ppl = ppl_ref * rng.uniform(1.0, 1.02)
    data = {
        "artifact": "/somewhere/art", "recipe": "ptpc-fp8", "reference": "/models/qwen3-stdlib",
        "reference_kind": "transformers", "data": "/texts/heldout.txt", "device": "cpu", "dtype": "bfloat16",
        "backend": "reference", "window": 512, "windows": rng.randint(1, 9), "tokens": rng.randint(100, 9999),
        "nll_artifact": 1.0, "nll_reference": 1.0, "ppl_artifact": ppl, "ppl_reference": ppl_ref,
        "ppl_ratio": ppl / ppl_ref, "kl": rng.uniform(1e-4, 1e-2), "top1_agreement": rng.uniform(0.9, 1.0),
    }  # fmt: skip
    path = tmp_path / "eval-heldout.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path, data


def test_publish_to_folder(art, source, tmp_path, eval_json):
    eval_path, ev = eval_json
    recipes = {
        "checkpoint": str(source), "reference": str(source), "reference_kind": "transformers", "data": "held.txt",
        "device": "cpu", "dtype": "bfloat16", "window": 512, "windows": 3, "tokens": 1234, "ppl_reference": 9.5,
        "rows": [
            {"recipe": name, "recipe_name": name, "backend": "reference", "ppl_artifact": random.uniform(9.5, 10),
             "ppl_ratio": random.uniform(1, 1.05), "kl": random.uniform(0, 1e-2), "top1_agreement": random.random()}
            for name in ("bf16", "ptpc-fp8")
        ],
    }  # fmt: skip
    recipes_path = tmp_path / "recipes.json"
    recipes_path.write_text(json.dumps(recipes), encoding="utf-8")
    out = tmp_path / "pub"
    result = run("publish", art, "--to", out, "--eval", eval_path, "--eval", recipes_path, "--no-progress")
    assert result.exit_code == 0, result.output
    assert beside(out) == ["pub"]

    manifest = json.loads((art / "manifest.json").read_text())
    published = tree(out)
    # every artifact file, byte for byte (hard links: same file system); the license came along
    for rel in manifest["files"]:
        assert published[rel] == (art / rel).read_bytes(), rel
    shard = sorted((art / "weights").glob("*.safetensors"))[0].relative_to(art)
    assert (out / shard).stat().st_ino == (art / shard).stat().st_ino
    assert manifest["source"]["license"] == "apache-2.0"
    assert published["LICENSE"] == (source / "LICENSE").read_bytes()
    assert manifest["files"]["LICENSE"]["sha256"] == hashlib.sha256(published["LICENSE"]).hexdigest()
    (wheel,) = sorted(out.glob(WHEEL))
    extra = {"README.md", wheel.relative_to(out).as_posix(), "reports/eval-heldout.json", "reports/recipes.json"}
    assert set(published) == {"manifest.json", *manifest["files"], *extra}
    assert published["reports/eval-heldout.json"] == eval_path.read_bytes()
    # the published manifest is the artifact's with the card, the wheel and the reports listed too
    ours = json.loads(published["manifest.json"])
    assert {k: v for k, v in ours.items() if k != "files"} == {k: v for k, v in manifest.items() if k != "files"}
    assert list(ours["files"])[: len(manifest["files"])] == list(manifest["files"])
    assert ours["files"] == manifest["files"] | {
        rel: {"sha256": hashlib.sha256(published[rel]).hexdigest(), "bytes": len(published[rel])}
        for rel in sorted(extra)
    }

    card = published["README.md"].decode()
    meta = front_matter(card)
    assert meta["base_model"] == "qwen3-stdlib"  # the source directory's name
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "qruntime" and meta["pipeline_tag"] == "text-generation"
    assert {"qcompile", "fp8", "ptpc-fp8", "qwen3"} <= set(meta["tags"])
    assert "`ptpc-fp8`: FP8 (e4m3) weights, one scale per output channel" in card
    assert "| ignore | `lm_head`, `re:.*mlp.gate$` |" in card
    assert "`lm_head` (tied: it reads the embedding table)" in card  # the fixture ties its embeddings
    assert "| KV cache | bf16, layout `nhd` K[blocks, block_size, kv_heads, head_dim]" in card
    # the eval tables, with the numbers of the files
    row = (
        f"| heldout.txt | {ev['tokens']} | qwen3-stdlib (transformers) | bfloat16 | {ev['ppl_artifact']:.4f} "
        f"| {ev['ppl_reference']:.4f} | {ev['ppl_ratio']:.5f} | {ev['kl']:.3e} | {100 * ev['top1_agreement']:.2f}% "
        "| `reports/eval-heldout.json` |"
    )
    assert row in card
    for r in recipes["rows"]:
        line = f"| {r['recipe']} | {r['ppl_artifact']:.4f} | {r['ppl_ratio']:.5f} | {r['kl']:.3e} | {100 * r['top1_agreement']:.2f}% |"
        assert line in card
    # the wheel's hash and every file's are in the card; the recipe block reproduces the recipe
    for rel, data in published.items():
        if rel not in ("README.md", "manifest.json"):
            assert f"| `{rel}` | {len(data)} | `{hashlib.sha256(data).hexdigest()}` |" in card, rel
    recipe_yaml = card.split("```yaml\n")[1].split("```")[0]
    (tmp_path / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
    assert load_recipe(str(tmp_path / "recipe.yaml")).to_dict() == manifest["recipe"]
    assert "qcompile compile qwen3-stdlib -o qwen3-stdlib-ptpc-fp8 --recipe recipe.yaml" in card
    assert "qcompile export qwen3-stdlib-ptpc-fp8 --format compressed-tensors" in card
    assert str(tmp_path) not in card and str(source.parent) not in card  # no local paths

    # the published folder is an artifact whose every file verifies, the card and the wheel included
    result = run("verify", out, "-q")
    assert (
        result.exit_code == 0
        and result.output == f"ok: {len(published) - 1} files verified in {out} (target nvidia-sm90)\n"
    )


def test_reports_from_real_runs(art, source, tmp_path):
    """`eval --json` put in ART/reports/ is picked up; `bench --json` given with --bench."""
    copy = shutil.copytree(art, tmp_path / "art")
    tokens = random.randint(40, 120)
    result = run(
        "eval", copy, "--reference", source, "--data", source / "heldout.txt", "--max-tokens", tokens,
        "--device", "cpu", "--json", "--no-progress",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (copy / "reports").mkdir()
    (copy / "reports" / "eval.json").write_text(result.output, encoding="utf-8")
    ev = json.loads(result.output)
    result = run("bench", copy, "--input-len", 8, "--output-len", 3, "--batch", "1,2", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    bench = json.loads(result.output)
    (tmp_path / "bench.json").write_text(result.output, encoding="utf-8")
    assert run("verify", copy, "-q").exit_code == 0  # reports/ does not break the artifact

    out = tmp_path / "pub"
    result = run("publish", copy, "--to", out, "--bench", tmp_path / "bench.json", "--no-progress")
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert f"| heldout.txt | {ev['tokens']} | qwen3-stdlib (transformers) |" in card
    assert f"| {ev['ppl_ratio']:.5f} | {ev['kl']:.3e} |" in card
    for row in bench["rows"]:
        assert f"| {row['batch']} | 8 | 3 | {row['ttft_ms']:.2f} | {row['tpot_ms']:.2f} |" in card
    assert (out / "reports" / "bench.json").read_bytes() == (tmp_path / "bench.json").read_bytes()

    # a file of the wrong kind is refused, naming it
    result = run("publish", copy, "--to", tmp_path / "pub2", "--eval", tmp_path / "bench.json")
    assert result.exit_code == 1
    assert "bench.json: not the output of `qcompile eval --json`" in result.output
    assert "looks like `qcompile bench --json`" in result.output
    assert not (tmp_path / "pub2").exists()


def test_republish_force_and_refusals(art, tmp_path):
    out = tmp_path / "pub"
    assert run("publish", art, "--to", out, "--no-progress").exit_code == 0
    first = tree(out)
    # the same artifact again: no --force needed, the same bytes
    result = run("publish", art, "--to", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "replaced the earlier publish" in result.output
    assert tree(out) == first

    # an earlier publish whose card was edited: refused, untouched
    card = out / "README.md"
    card.write_text(card.read_text() + f"\nedited {random.random()}\n")
    edited = tree(out)
    result = run("publish", art, "--to", out, "--no-progress")
    assert result.exit_code == 1
    assert "(README.md differs from what this publish writes); pass --force" in result.output
    assert tree(out) == edited

    # a folder with other content: refused without --force, replaced with it
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_bytes(os.urandom(64))
    result = run("publish", art, "--to", other, "--no-progress")
    assert result.exit_code == 1
    assert (
        f"{other}: exists and is not an earlier publish of this artifact (notes.txt is not part of it)" in result.output
    )
    assert set(tree(other)) == {"notes.txt"}
    result = run("publish", art, "--to", other, "--force", "--no-progress")
    assert result.exit_code == 0, result.output
    assert tree(other) == first
    assert beside(other) == ["other"]

    # a target that is a file, the artifact itself, or a folder inside it
    target = tmp_path / "file"
    target.write_text("x")
    assert "is not a directory" in run("publish", art, "--to", target, "--force").output
    assert "is the artifact" in run("publish", art, "--to", art).output
    assert "is the artifact" in run("publish", art, "--to", art / "pub").output
    assert "give a folder or hf://ORG/NAME" in run("publish", art, "--to", "s3://bucket/x").output


def test_tampered_artifact_is_refused(art, tmp_path):
    copy = shutil.copytree(art, tmp_path / "art")
    out = tmp_path / "pub"
    assert run("publish", copy, "--to", out, "--no-progress").exit_code == 0
    before = tree(out)
    shard = sorted((copy / "weights").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[random.randrange(len(data))] ^= 1 << random.randrange(8)
    # a new file in place of the shard (the published folder hard-links the old one: rewriting that
    # inode in place would change both)
    (copy / "tampered").write_bytes(bytes(data))
    os.replace(copy / "tampered", shard)
    for target, force in ((out, True), (tmp_path / "new", False)):
        result = run("publish", copy, "--to", target, "--no-progress", *(["--force"] if force else []))
        assert result.exit_code == 1
        assert f"{copy / 'weights' / shard.name}: sha256 does not match the manifest" in result.output
        assert "does not verify" in result.output
    assert tree(out) == before
    assert beside(out) == ["pub"] and beside(tmp_path / "new") == []


def test_dry_run_writes_nothing(art, tmp_path):
    out = tmp_path / "pub"
    result = run("publish", art, "--to", out, "--dry-run", "--no-progress")
    assert result.exit_code == 0, result.output
    assert beside(out) == []
    assert f"dry run: would write {out}" in result.output and "nothing written" in result.output
    listed = {}
    for line in result.output.splitlines():
        if line.startswith("  "):
            path, size, digest = line.split()
            listed[path] = (int(size.replace(",", "")), digest)
    manifest = json.loads((art / "manifest.json").read_text())
    for rel, info in manifest["files"].items():
        assert listed.pop(rel) == (info["bytes"], info["sha256"][:12])
    assert listed.pop("manifest.json")[0] > (art / "manifest.json").stat().st_size  # it lists the card and wheel too
    assert listed.pop("README.md")[0] > 0
    (wheel,) = listed
    assert wheel.startswith("runtime/qcompile_runtime-") and wheel.endswith("-py3-none-any.whl")

    assert run("publish", art, "--to", out, "--no-progress").exit_code == 0
    before = tree(out)
    result = run("publish", art, "--to", out, "--dry-run", "--no-progress")
    assert result.exit_code == 0 and f"dry run: would replace {out}" in result.output
    assert tree(out) == before and beside(out) == ["pub"]


def test_wheel_without_runtime_source(art, tmp_path, monkeypatch):
    """qcompile installed from a wheel: the runtime wheel comes from an earlier publish, or a clear error."""
    pub = tmp_path / "pub"
    assert run("publish", art, "--to", pub, "--no-progress").exit_code == 0
    monkeypatch.setattr(runtime_wheel, "runtime_source", lambda: None)
    result = run("publish", art, "--to", tmp_path / "pub2", "--no-progress")
    assert result.exit_code == 1
    assert "the runtime's source is not available" in result.output and "pip install -e ./runtime -e ." in result.output
    assert not (tmp_path / "pub2").exists()
    result = run("publish", pub, "--to", tmp_path / "pub3", "--no-progress")  # a published folder bundles one
    assert result.exit_code == 0, result.output
    assert "the wheel bundled in" in result.output
    assert tree(tmp_path / "pub3") == tree(pub)


def test_runtime_source_is_the_repo():
    source = runtime_wheel.runtime_source()
    assert source is not None and (source / "qruntime" / "__init__.py").resolve() == Path(qruntime.__file__).resolve()


GENERATE = """
import json, sys
import torch
torch.set_num_threads(int(sys.argv[3]))
import qruntime
assert qruntime.__file__.startswith(sys.prefix), qruntime.__file__
try:
    import qcompile
    print("qcompile is importable", file=sys.stderr)
    sys.exit(3)
except ImportError:
    pass
engine = qruntime.load(sys.argv[1], "cpu", verify=True)
out = engine.generate(json.loads(sys.argv[2]), qruntime.SamplingParams(max_tokens=8))[0]
print(json.dumps(out.token_ids))
"""


def test_bundled_wheel_runs_in_a_fresh_venv(art, source, tmp_path):
    """The published folder is all a machine without qcompile needs: pip install the bundled wheel, load, generate."""
    out = tmp_path / "pub"
    assert run("publish", art, "--to", out, "--no-progress").exit_code == 0
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # this environment's packages (torch, onnx, …) without qcompile or qruntime: a directory a .pth
    # file adds is not a site dir, so its .pth files (the editable installs' finders) are not run
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n", encoding="utf-8")
    for module in ("qcompile", "qruntime"):
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, cwd=tmp_path)
        assert probe.returncode == 1 and f"No module named '{module}'" in probe.stderr
    assert subprocess.run([python, "-c", "import torch, onnx, safetensors, tokenizers"], cwd=tmp_path).returncode == 0
    (wheel,) = sorted(out.glob(WHEEL))
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q", wheel]
    subprocess.run(install, check=True, capture_output=True, cwd=tmp_path)

    text = (source / "heldout.txt").read_text(encoding="utf-8")
    start = random.randrange(len(text) - 200)
    prompt = text[start : start + random.randint(40, 160)]
    threads = torch.get_num_threads()
    done = subprocess.run(
        [python, "-c", textwrap.dedent(GENERATE), out, json.dumps(prompt), str(threads)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)
    ours = qruntime.load(out, "cpu").generate(prompt, qruntime.SamplingParams(max_tokens=8))[0].token_ids
    assert theirs == list(ours) and len(theirs) == 8
    assert sha256_file(wheel) in (out / "README.md").read_text()


def test_card_of_an_moe_with_fp8_kv_and_no_license(compiled, tiny_moe_ckpt, tmp_path):
    art = compiled(tiny_moe_ckpt, "ptpc-fp8", "kv_cache.dtype=fp8_e4m3")
    name = f"org-{random.getrandbits(32):x}/Qwen3-Tiny"
    out = tmp_path / "pub"
    result = run("publish", art, "--to", out, "--base-model", name, "--no-progress")
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["base_model"] == name and "license" not in meta
    assert {"moe", "fp8-kv-cache"} <= set(meta["tags"])
    assert "License: not recorded" in card
    assert "`model.layers.*.mlp.gate` ×2" in card  # layer 1 is dense and "8 experts top-2" in card
    assert "fp8_e4m3, layout `nhd`" in card and "scales 1.0 for every layer (not calibrated)" in card
    assert f"hf download {name} --local-dir Qwen3-Tiny\nqcompile compile Qwen3-Tiny -o Qwen3-Tiny-ptpc-fp8" in card
