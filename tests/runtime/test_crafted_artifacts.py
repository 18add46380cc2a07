"""Crafted artifacts (issue 14) against every verb that reads one: `qcompile verify`, `inspect`, `run`,
`export`, `publish` (to a folder) and `qruntime.load`.

Each case breaks a copy of a compiled tiny artifact the way a hostile artifact would — links (to a
file outside, a linked directory, a link inside pointing out, the manifest itself), paths outside,
junk manifest fields generated from the manifest's schema, overflowing shapes, a huge tp, a planted
runtime wheel — and every verb must either refuse it with a clear error naming the file or field, or
(where the verb never reads what was broken) succeed; never a traceback (AttributeError, KeyError,
TypeError ...), never a byte of the outside file in what it prints or writes. The random choices
(which file, which field, which junk value) are fresh each run; the seed is printed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import re
import shutil
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import pytest
import qruntime
from click.testing import CliRunner
from qruntime.artifact import COMPILED_FIELDS, ArtifactFormatError
from qruntime.manifest_schema import (
    MANIFEST_SCHEMA,
    Map,
    Node,
    Obj,
    Opt,
    SchemaError,
    key_path,
)
from qruntime.manifest_schema import List as ListNode
from qruntime.manifest_schema import Tuple as TupleNode

# tests/runtime is on sys.path (rootdir conftest): the load tests' manifest helpers
from test_qruntime_load import SMALL_CACHE, edit_manifest, refresh_entry

from qcompile.cli import main
from qcompile.publish import runtime_wheel

VERBS = ("verify", "inspect", "load", "run", "export", "publish")
# what each verb reads: a case breaking only what a verb does not read may leave that verb working
READS_FILES = ("verify", "load", "run", "export", "publish")  # every listed file (size or sha256)
CHECKS_LINKS = ("verify", "export", "publish")  # every link anywhere in the artifact


@pytest.fixture(scope="module")
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"crafted-artifact seed {seed}")
    return random.Random(seed)


@pytest.fixture(scope="module")
def pristine(compiled, tiny_ckpt) -> Path:
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture
def art(pristine, tmp_path) -> Path:
    """A private copy of the compiled artifact to break."""
    return Path(shutil.copytree(pristine, tmp_path / "art"))


@pytest.fixture
def outside(tmp_path, rng) -> Path:
    """A directory beside the artifact holding a secret: a marker no verb may ever print or write."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret").write_text(f"SECRET-{rng.getrandbits(64):016x}\n")
    return path


@pytest.fixture
def out(tmp_path) -> Path:
    """Where export and publish write (apart from the artifact and the outside directory)."""
    path = tmp_path / "out"
    path.mkdir()
    return path


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str


def attempt(verb: str, art: Path, out: Path) -> Outcome:
    """Run `verb` on `art`; an exception that is not the verb's clean user error fails the test."""
    if verb == "load":
        try:
            with qruntime.load(art, "cpu", **SMALL_CACHE):
                return Outcome(True, "")
        except (ArtifactFormatError, ValueError) as exc:
            return Outcome(False, str(exc))
    args = {
        "verify": ["verify", art, "-q"],
        "inspect": ["inspect", art],
        "run": ["run", art, "hi", "--device", "cpu", "--max-tokens", "2", "--no-stream"],
        "export": ["export", art, "-o", out / "ct", "--no-progress"],
        "publish": ["publish", art, "--to", out / "pub", "--no-progress"],
    }[verb]
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        trace = "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"{verb}: {type(result.exception).__name__} instead of a clean error:\n{trace}")
    return Outcome(result.exit_code == 0, result.output)


def check(art: Path, out: Path, *, names: tuple[str, ...], refuse: tuple[str, ...], verbs=VERBS, secret=None) -> None:
    """Every verb in `verbs`: those in `refuse` must fail naming each of `names`; the others may succeed
    or fail the same way. Nothing may show the secret, nor write it, nor leave a link in what it wrote."""
    for verb in verbs:
        outcome = attempt(verb, art, out)
        assert "Traceback" not in outcome.message, (verb, outcome.message)
        if verb in refuse:
            assert not outcome.ok, f"{verb} accepted the crafted artifact"
        if not outcome.ok:
            for name in names:
                assert name in outcome.message, f"{verb}: {name!r} not named in: {outcome.message}"
        if secret is not None:
            assert secret not in outcome.message, verb
        for path in out.rglob("*") if out.exists() else ():
            assert not path.is_symlink(), f"{verb} wrote a link: {path}"
            if secret is not None and path.is_file():
                assert secret.encode() not in path.read_bytes(), f"{verb} copied the secret into {path}"
        for name in ("ct", "pub"):
            if (out / name).exists():
                shutil.rmtree(out / name)


def listed(art: Path) -> dict[str, Any]:
    return json.loads((art / "manifest.json").read_text())["files"]


def move_out(art: Path, rel: str, outside: Path) -> Path:
    """Move `rel` outside and leave a link to it (same bytes: the manifest's sha256 still matches)."""
    target = outside / rel.replace("/", "_")
    shutil.move(art / rel, target)
    (art / rel).symlink_to(target)
    return target


# --- links ----------------------------------------------------------------------------------------
def test_a_listed_file_linked_to_an_identical_copy_outside(art, outside, out, rng):
    rel = rng.choice(sorted(listed(art)))
    move_out(art, rel, outside)
    print(f"linked {rel}")
    check(art, out, names=(rel.split("/")[-1], "symbolic link"), refuse=READS_FILES)


def test_a_linked_directory(art, outside, out):
    move_out(art, "weights", outside)
    check(art, out, names=("weights", "symbolic link"), refuse=READS_FILES)


def test_the_manifest_itself_linked(art, outside, out):
    move_out(art, "manifest.json", outside)
    check(art, out, names=("manifest.json", "symbolic link"), refuse=VERBS)


def test_an_unlisted_link_inside_pointing_out(art, outside, out, rng):
    secret = (outside / "secret").read_text().strip()
    place = rng.choice(["notes.txt", "weights/extra.safetensors", "reports/eval.json", "kernels/GPU.json"])
    (art / place).parent.mkdir(exist_ok=True)
    (art / place).symlink_to(rng.choice([outside / "secret", outside]))
    print(f"planted link {place}")
    check(art, out, names=(place,), refuse=CHECKS_LINKS, secret=secret)


def test_a_file_load_would_read_but_the_manifest_does_not_list(art, out, rng):
    name = rng.choice(["chat_template.jinja", "special_tokens_map.json", "generation_config.json"])
    if name in listed(art):
        edit_manifest(art, lambda m: m["files"].pop(name))
    else:
        (art / name).write_text("{{ messages }}" if name.endswith("jinja") else "{}")
    check(art, out, names=(name, "not listed"), refuse=("load", "run"), verbs=("load", "run", "verify"))


@pytest.mark.parametrize("source", [True, False], ids=["runtime-source", "no-runtime-source"])
def test_a_planted_runtime_wheel_is_not_published(art, out, rng, monkeypatch, source):
    """Unlisted: refused, whether publish could build its own wheel or would fall back to the bundled one."""
    if not source:
        monkeypatch.setattr(runtime_wheel, "runtime_source", lambda: None)
    wheel = f"runtime/qcompile_runtime-{rng.randint(1, 99)}.0-py3-none-any.whl"
    (art / "runtime").mkdir()
    (art / wheel).write_bytes(rng.randbytes(512))
    check(art, out, names=(wheel, "not listed"), refuse=("publish",), verbs=("publish",))
    assert not (out / "pub").exists()


def test_a_listed_runtime_wheel_is_bundled_as_listed(art, out, rng, monkeypatch):
    """The fallback publish keeps: no runtime source, and the wheel the manifest lists with its sha256."""
    monkeypatch.setattr(runtime_wheel, "runtime_source", lambda: None)
    wheel = f"runtime/qcompile_runtime-{rng.randint(1, 99)}.0-py3-none-any.whl"
    (art / "runtime").mkdir()
    (art / wheel).write_bytes(payload := rng.randbytes(512))
    refresh_entry(art, wheel)
    outcome = attempt("publish", art, out)
    assert outcome.ok, outcome.message
    assert (out / "pub" / wheel).read_bytes() == payload
    (art / wheel).write_bytes(rng.randbytes(512))  # listed, but not those bytes
    check(art, out, names=(wheel, "sha256"), refuse=("publish", "verify"), verbs=("publish", "verify"))


def test_a_junk_report_is_a_clear_publish_error(art, out, rng):
    """reports/*.json are read by publish (listed or not): bounded JSON, a shape it knows, numbers where numbers go."""
    depth = rng.randint(100, 5000)
    junk = rng.choice(["[" * depth + "]" * depth, '{"rows": "\\ud800"}', '{"ppl_artifact": "x"}', "{"])
    (art / "reports").mkdir()
    (art / "reports" / "eval.json").write_text(junk)
    print(f"report {junk[:40]!r}")
    check(art, out, names=("reports/eval.json",), refuse=("publish",), verbs=("publish",))


# --- paths outside --------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["files", "graph.file", "tensors.file"])
def test_paths_outside_the_artifact(art, outside, out, rng, field):
    bad = rng.choice(["../outside/secret", str(outside / "secret"), "weights/../../outside/secret", "./graph.onnx"])

    def change(m):
        if field == "files":
            m["files"][bad] = {"sha256": "0" * 64, "bytes": 1}
        elif field == "graph.file":
            m["graph"]["file"] = bad
        else:
            m["tensors"][rng.choice(sorted(m["tensors"]))]["file"] = bad

    edit_manifest(art, change)
    names = ("not a normalised path",) if field == "files" else (field.split(".")[0], "listed in files")
    check(art, out, names=names, refuse=VERBS)


def test_onnx_external_data_outside_or_unlisted(art, outside, out, rng):
    shutil.copyfile(art / "weights" / "model-00001-of-00001.safetensors", outside / "w.safetensors")
    shutil.copyfile(art / "weights" / "model-00001-of-00001.safetensors", art / "weights" / "unlisted.safetensors")
    location = rng.choice(["../outside/w.safetensors", str(outside / "w.safetensors"), "weights/unlisted.safetensors"])
    model = onnx.load(str(art / "graph.onnx"), load_external_data=False)
    init = rng.choice([i for i in model.graph.initializer if i.external_data])
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, str(art / "graph.onnx"))
    refresh_entry(art, "graph.onnx")
    print(f"initializer {init.name} at {location}")
    check(art, out, names=(location,), refuse=("load", "run"), verbs=("load", "run", "verify"))


# --- junk manifest fields, generated from the schema ----------------------------------------------
JUNK: tuple[Any, ...] = (None, True, -1, 2**70, 0.5, float("nan"), "x", "", [], [1, "a"], {}, {"k": [None]})


def fields(node: Node, value: Any, where: str) -> Iterator[tuple[str, tuple[Any, ...], Node]]:
    """(error name, path of keys, schema node) of every field present in `value`, depth first."""
    yield where, (), node  # junk is drawn against the node as declared: an Opt accepts null
    if isinstance(node, Opt) and value is not None:
        node = node.node
    if isinstance(node, Obj) and isinstance(value, dict):
        for name, child in node.fields.items():
            if name in value:
                for w, path, n in fields(child, value[name], f"{where}.{name}" if where else name):
                    yield w, (name, *path), n
    elif isinstance(node, Map) and isinstance(value, dict):
        for key, item in value.items():
            for w, path, n in fields(node.value, item, key_path(where, key)):
                yield w, (key, *path), n
    elif isinstance(node, ListNode | TupleNode) and isinstance(value, list):
        children = [node.item] * len(value) if isinstance(node, ListNode) else node.items
        for index, (child, item) in enumerate(zip(children, value, strict=False)):
            for w, path, n in fields(child, item, f"{where}[{index}]"):
                yield w, (index, *path), n


def junk_cases(manifest: dict, rng: random.Random, count: int) -> list[tuple[str, tuple[Any, ...], Any]]:
    """Up to `count` fields, each with a junk value its schema node refuses: one field per kind (a map's
    keys are one kind: tensors["a"].shape and tensors["b"].shape), the kinds, places and values drawn
    at random."""
    kinds: dict[str, list[tuple[str, tuple[Any, ...], Node]]] = {}
    for where, path, node in fields(MANIFEST_SCHEMA, manifest, ""):
        if path:  # tensors["a"].parts[0][1] and tensors["b"].parts[2][0] are one kind, tensors[*].parts[*][*]
            kind = re.sub(r"\[(\d+|\"(?:[^\"\\]|\\.)*\")\]", "[*]", where)
            kinds.setdefault(kind, []).append((where, path, node))
    cases = []
    for kind in rng.sample(sorted(kinds), min(count, len(kinds))):
        where, path, node = rng.choice(kinds[kind])
        refused = []
        for value in JUNK:
            try:
                node.check(value, where)
            except SchemaError:
                refused.append(value)
        cases.append((where, path, rng.choice(refused)))
    return cases


def test_junk_manifest_fields_are_named(art, out, rng):
    manifest = json.loads((art / "manifest.json").read_text())
    cases = junk_cases(manifest, rng, 1000)  # every kind of field, each at a random place with a random junk value
    assert len(cases) > 40
    for where, path, value in cases:
        print(f"{where} = {value!r}")
        broken = json.loads(json.dumps(manifest))
        parent = broken
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        (art / "manifest.json").write_text(json.dumps(broken))
        check(art, out, names=(where,), refuse=VERBS)


def test_missing_fields_are_named(art, out, rng):
    original = (art / "manifest.json").read_text()
    whole = sorted({field.split(".")[0] for field in COMPILED_FIELDS})  # spec, recipe, source ... at once
    for field in rng.sample(COMPILED_FIELDS, 4) + whole:
        print(f"without {field}")
        broken = json.loads(original)
        *parents, last = field.split(".")
        parent = broken
        for key in parents:
            parent = parent[key]
        del parent[last]
        (art / "manifest.json").write_text(json.dumps(broken))
        check(art, out, names=(field,), refuse=("inspect", "export", "publish"))
    (art / "manifest.json").write_text(original)


# --- sizes ----------------------------------------------------------------------------------------
def test_a_tensor_larger_than_its_file(art, out, rng):
    manifest = json.loads((art / "manifest.json").read_text())
    name = rng.choice(sorted(manifest["tensors"]))
    shape = [2 ** rng.randint(20, 40) for _ in range(rng.randint(2, 4))]
    edit_manifest(art, lambda m: m["tensors"][name].update(shape=shape))
    check(art, out, names=(key_path("tensors", name) + ".shape", "bytes"), refuse=VERBS)


def test_an_initializer_shape_that_overflows(art, out, rng):
    model = onnx.load(str(art / "graph.onnx"), load_external_data=False)
    init = rng.choice([i for i in model.graph.initializer if i.external_data])
    dims = [2**32, 2**32] if rng.random() < 0.5 else [2**62, 4]  # element count x size wraps int64 to 0
    del init.dims[:]
    init.dims.extend(dims)
    for entry in init.external_data:
        if entry.key == "length":
            entry.value = "0"
    onnx.save(model, str(art / "graph.onnx"))
    refresh_entry(art, "graph.onnx")
    check(art, out, names=(init.name,), refuse=("load", "run"), verbs=("load", "run"))


def test_a_huge_tp(art, out, rng):
    tp = rng.choice([2 ** rng.randint(7, 60), 3, 0, -2])
    edit_manifest(art, lambda m: m.update(tp=tp))
    check(art, out, names=("tp",), refuse=VERBS)


def test_a_well_formed_tp_beyond_the_cpu_cap_spawns_nothing(art, out, rng):
    tp = rng.choice([16, 32, 64])

    def shard(m):
        m.update(tp=tp, graph=m["graph"] | {"files": ["graph.onnx"] * tp})
        for info in m["tensors"].values():
            info.update(axis=None, ranks=[{"file": info.pop("file"), "shape": info["shape"]}] * tp)

    edit_manifest(art, shard)
    check(art, out, names=(f"tp={tp}",), refuse=("load", "run", "export"), verbs=("load", "run", "export"))
    assert multiprocessing.active_children() == []


def test_hashes_of_the_battery_inputs_are_what_the_manifest_says(pristine):
    """The cases above break one thing each: the pristine copy verifies (so a refusal is the case's)."""
    for rel, info in listed(pristine).items():
        assert hashlib.sha256((pristine / rel).read_bytes()).hexdigest() == info["sha256"], rel
    assert not any(p.is_symlink() for p in pristine.rglob("*"))
    assert os.path.isfile(pristine / "manifest.json")
