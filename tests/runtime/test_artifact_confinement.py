"""qruntime.artifact's confinement check (artifact_path, find_links), the manifest schema's agreement
with the compiler's names, bounded JSON on read, and kernel-table values checked at load. Random
layouts and junk values are fresh each run (the seed is printed)."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
from qruntime.artifact import (
    ArtifactFormatError,
    artifact_path,
    find_links,
    optional_artifact_path,
    read_manifest,
    verify_files,
)
from qruntime.kernel_configs import POW2_KEYS, STAGE_KEYS, STAGES, KernelTable, device_file, load_kernel_table
from qruntime.manifest_schema import DTYPE_SIZES, ROLES, SCHEMES

from qcompile.compile.jobs import ROLES as COMPILER_ROLES
from qcompile.io.safetensors_stream import DTYPES
from qcompile.quant.schemes import SCHEMES as COMPILER_SCHEMES


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    return random.Random(seed)


def nested(rng: random.Random) -> list[str]:
    return [f"d{rng.randrange(100)}" for _ in range(rng.randint(1, 3))]


def test_a_regular_file_inside_is_its_path(tmp_path, rng):
    parts = nested(rng)
    (tmp_path.joinpath(*parts)).mkdir(parents=True)
    rel = "/".join([*parts, "f.bin"])
    (tmp_path / rel).write_bytes(rng.randbytes(8))
    assert artifact_path(tmp_path, rel) == tmp_path / rel
    assert artifact_path(tmp_path, rel, listed={rel: {}}) == tmp_path / rel


def test_a_link_at_any_depth_is_refused_naming_it(tmp_path, rng):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.bin").write_bytes(b"secret")
    art = tmp_path / "art"
    parts = nested(rng)
    depth = rng.randrange(len(parts) + 1)  # which component is the link: a directory, or the file itself
    real = art.joinpath(*parts[:depth])
    real.mkdir(parents=True)
    if depth < len(parts):
        (real / parts[depth]).symlink_to(outside, target_is_directory=True)
        outside.joinpath(*parts[depth + 1 :]).mkdir(parents=True, exist_ok=True)
        outside.joinpath(*parts[depth + 1 :], "f.bin").write_bytes(b"secret")
        link = "/".join(parts[: depth + 1])
    else:
        (real / "f.bin").symlink_to(outside / "f.bin")
        link = "/".join([*parts, "f.bin"])
    rel = "/".join([*parts, "f.bin"])
    with pytest.raises(ArtifactFormatError, match=rf"{art / link}: is a symbolic link"):
        artifact_path(art, rel)
    assert find_links(art) == [link]


def test_what_is_not_a_regular_file_or_not_listed(tmp_path):
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "f").write_text("x")
    for rel in ("dir", "fifo"):
        with pytest.raises(ArtifactFormatError, match=rf"{rel}: not a regular file"):
            artifact_path(tmp_path, rel)
    with pytest.raises(ArtifactFormatError, match="f: not a directory"):
        artifact_path(tmp_path, "f/g")
    with pytest.raises(ArtifactFormatError, match="not listed in manifest.json"):
        artifact_path(tmp_path, "f", listed={})
    with pytest.raises(ArtifactFormatError, match=r"missing \(manifest.json lists it\)"):
        artifact_path(tmp_path, "gone", listed={"gone": {}})
    assert optional_artifact_path(tmp_path, "gone", listed={}) is None
    with pytest.raises(ArtifactFormatError, match="missing"):
        artifact_path(tmp_path, "gone")


def test_a_hard_link_is_allowed_and_vouched_for_by_its_hash(tmp_path, rng):
    """Publish hard-links the artifact's files; a hard link names a file its maker could already read,
    and the manifest's sha256 still decides whether its bytes are the artifact's."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(payload := rng.randbytes(64))
    art = tmp_path / "art"
    art.mkdir()
    os.link(outside, art / "w.bin")
    assert artifact_path(art, "w.bin") == art / "w.bin"
    entry = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (art / "manifest.json").write_text(json.dumps({"format_version": "1.0", "files": {"w.bin": entry}}))
    assert verify_files(art, read_manifest(art)) == []
    outside.write_bytes(rng.randbytes(64))  # the same inode: the artifact's file changed, and verify says so
    assert [p.reason for p in verify_files(art, read_manifest(art))] == ["sha256 does not match the manifest"]


def test_a_hugging_face_snapshot_may_link_to_its_blobs_only(tmp_path, rng):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / f"{rng.getrandbits(160):040x}"
    (snapshot / "weights").mkdir(parents=True)
    blob = repo / "blobs" / f"{rng.getrandbits(256):064x}"
    blob.write_bytes(rng.randbytes(32))
    (snapshot / "weights" / "a.bin").symlink_to(os.path.relpath(blob, snapshot / "weights"))
    assert artifact_path(snapshot, "weights/a.bin") == snapshot / "weights" / "a.bin"
    assert find_links(snapshot) == []
    (tmp_path / "secret").write_text("secret")
    (snapshot / "b.bin").symlink_to(tmp_path / "secret")  # out of the blobs: refused even here
    with pytest.raises(ArtifactFormatError, match="b.bin: is a symbolic link"):
        artifact_path(snapshot, "b.bin")
    assert find_links(snapshot) == ["b.bin"]
    fake = tmp_path / "not-a-cache" / "snapshots" / "rev"  # the layout without the models--* folder
    fake.mkdir(parents=True)
    (fake.parent.parent / "blobs").mkdir()
    (fake.parent.parent / "blobs" / "x").write_text("x")
    (fake / "a.bin").symlink_to(fake.parent.parent / "blobs" / "x")
    with pytest.raises(ArtifactFormatError, match="a.bin: is a symbolic link"):
        artifact_path(fake, "a.bin")


def test_the_schema_names_what_the_compiler_writes():
    assert set(SCHEMES) == set(COMPILER_SCHEMES)
    assert set(ROLES) == {*COMPILER_ROLES, "scale", "zero_point"}  # the last two: compile/manifest.py's quant params
    assert {name: dtype.itemsize for name, dtype in DTYPES.items()} == DTYPE_SIZES


@pytest.mark.parametrize("junk", ["deep", "surrogate", "not an object", "huge tp"])
def test_manifest_json_is_bounded(tmp_path, junk):
    raw = {
        "deep": '{"format_version": "1.0", "files": {}, "x": ' + "[" * 5000 + "]" * 5000 + "}",
        "surrogate": '{"format_version": "1.0", "files": {"a\\ud800": {"sha256": "0", "bytes": 1}}}',
        "not an object": "[1, 2]",
        "huge tp": '{"format_version": "1.0", "files": {}, "tp": 1099511627776}',
    }[junk]
    (tmp_path / "manifest.json").write_text(raw)
    expected = {"deep": "nested more than", "surrogate": "lone surrogate", "not an object": "JSON object"}
    with pytest.raises(ArtifactFormatError, match=expected.get(junk, "tp must be a power of two in 1..64")):
        read_manifest(tmp_path)


# --- kernel tables ---------------------------------------------------------------------------------
def valid_config(op: str, rng: random.Random) -> dict:
    config = {"backend": "triton", "us": rng.uniform(1, 99)}  # the tuner's timing rides along, unread
    for name, (least, most) in POW2_KEYS[op].items():
        config[name] = 2 ** rng.randint(least.bit_length() - 1, most.bit_length() - 1)
    for name in STAGE_KEYS[op]:
        config[name] = rng.randint(*STAGES)
    return config


KEYS = {"PTPCLinear": "PTPCLinear:512x256", "MoE": "MoE:8x64x32:top2"}
JUNK = ("8", 8.0, True, None, [16], 0, -16, 24, 3, 1 << 20)


def test_kernel_table_values_are_checked_at_load(rng):
    op = rng.choice(sorted(KEYS))
    key, bucket = KEYS[op], str(rng.choice([1, 16, 256]))
    config = valid_config(op, rng)
    table = KernelTable.from_dict({"device": "GPU X", "entries": {key: {bucket: config}}}, "t.json")
    assert table.lookup(key, int(bucket)) == config
    for _ in range(8):
        name = rng.choice([*POW2_KEYS[op], *STAGE_KEYS[op], "backend"])
        value = rng.choice(("cuda", "", 7) if name == "backend" else JUNK)
        if (
            name in STAGE_KEYS[op]
            and isinstance(value, int)
            and not isinstance(value, bool)
            and STAGES[0] <= value <= STAGES[1]
        ):
            continue  # a valid stage count
        print(f"{op} {name} = {value!r}")
        broken = {"device": "GPU X", "entries": {key: {bucket: config | {name: value}}}}
        with pytest.raises(ValueError, match=rf"t\.json: entries\['{key}'\]\['{bucket}'\]\.{name} must be"):
            KernelTable.from_dict(broken, "t.json")
    for entries, message in [
        ({key: {"0": config}}, "is not a token count"),
        ({key: {"x": config}}, "is not a token count"),
        ({key: []}, "must be an object from token counts"),
        ({key: {bucket: "fast"}}, "must be an object"),
        ({"MoE:1x2x3:top1": {bucket: {"backend": "cublaslt"}}}, "cublaslt runs PTPCLinear only"),
    ]:
        with pytest.raises(ValueError, match=message):
            KernelTable.from_dict({"device": "GPU X", "entries": entries}, "t.json")


def test_a_kernel_table_is_read_only_when_listed_and_not_a_link(tmp_path, rng):
    name = "NVIDIA H100 80GB HBM3"
    rel = f"kernels/{device_file(name)}"
    (tmp_path / "kernels").mkdir()
    table = {"device": name, "entries": {KEYS["PTPCLinear"]: {"16": valid_config("PTPCLinear", rng)}}}
    (tmp_path / rel).write_text(json.dumps(table))
    assert load_kernel_table(tmp_path, name, {rel: {}}).device == name
    with pytest.raises(ValueError, match="not listed in manifest.json"):
        load_kernel_table(tmp_path, name, {})
    (tmp_path / "real.json").write_text(json.dumps(table))
    (tmp_path / rel).unlink()
    (tmp_path / rel).symlink_to(tmp_path / "real.json")
    with pytest.raises(ValueError, match="is a symbolic link"):
        load_kernel_table(tmp_path, name, {rel: {}})
    (tmp_path / rel).unlink()
    (tmp_path / rel).write_text('{"device": "' + name + '", "entries": ' + "[" * 200 + "]" * 200 + "}")
    with pytest.raises(ValueError, match="nested more than"):
        load_kernel_table(tmp_path, name, {rel: {}})


def test_paths_resolve_to_the_artifact(tmp_path):
    """The lexical check still runs first: nothing outside is even looked at."""
    for bad in ("../x", "/etc/passwd", "a/../../x", "./a", "a//b", "a\\b", ""):
        with pytest.raises(ArtifactFormatError, match="not a normalised path inside the artifact"):
            artifact_path(tmp_path, bad)


def test_an_all_reduce_entry_is_checked_at_load(rng):
    key = f"AllReduce:tp{rng.choice([2, 4, 8])}"
    good = {"max_one_shot_bytes": rng.randrange(0, 1 << 26), "max_two_shot_bytes": rng.randrange(0, 1 << 26)}
    good["timings_us"] = [{"bytes": 4096, "nccl_us": 20.0}]
    table = KernelTable.from_dict({"device": "GPU X", "entries": {key: {"1": good}}}, "t.json")
    assert table.lookup(key, 1)["max_one_shot_bytes"] == good["max_one_shot_bytes"]
    for field in ("max_one_shot_bytes", "max_two_shot_bytes"):
        for value in ("8", 8.0, True, None, -1, (1 << 26) + 1):  # a region of 2x this is mapped on every rank
            broken = {"device": "GPU X", "entries": {key: {"1": good | {field: value}}}}
            with pytest.raises(ValueError, match=rf"entries\['{key}'\]\['1'\]\.{field} must be an integer"):
                KernelTable.from_dict(broken, "t.json")
    # the LL kernel's limit: optional (tables tuned before it), whole 4-byte words, at most 1 MiB
    ll = rng.randrange(0, 1 << 18) * 4
    table = KernelTable.from_dict({"device": "GPU X", "entries": {key: {"1": good | {"max_ll_bytes": ll}}}}, "t.json")
    assert table.lookup(key, 1)["max_ll_bytes"] == ll
    for value in ("8", 8.0, True, None, -4, 6, (1 << 20) + 4):
        broken = {"device": "GPU X", "entries": {key: {"1": good | {"max_ll_bytes": value}}}}
        with pytest.raises(ValueError, match=rf"entries\['{key}'\]\['1'\]\.max_ll_bytes must be a multiple of 4"):
            KernelTable.from_dict(broken, "t.json")
