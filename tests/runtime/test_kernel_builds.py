"""Kernel build lists (qruntime.kernel_builds) and building them ahead (qruntime.kernel_prebuild).

Triton compiles for an NVIDIA target without a GPU (ptxas ships with it), so these build real
kernels of the runtime for sm_90 into a fresh Triton cache per test: the records' checks and the
trust rule, the cache's keying, a torn cache entry built again, a record that fails to build named
with its config, the helper's deadline, and a build list of another GPU or Triton ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qruntime.kernel_builds import (
    MAX_KERNELS,
    BuildList,
    KernelBuild,
    builds_file,
    read_build_list,
)

PROBES = Path(__file__).with_name("kernel_build_probes.py")

SM90 = ("cuda", 90, 32)
KERNEL = "qruntime.kernels.dynamic_quant:_dynamic_quant_kernel"
SIGNATURE = {
    "x_ptr": "*bf16",
    "q_ptr": "*u8",
    "s_ptr": "*fp32",
    "K": "i32",
    "stride_x": "i32",
    "BLOCK": "constexpr",
    "NUM_CHUNKS": "constexpr",
    "HW": "constexpr",
    "PDL": "constexpr",
    "FNUZ": "constexpr",
}


def quant_record(block: int = 256, warps: int = 4, **options) -> dict:
    """A record of dynamic_quant's kernel as the runtime launches it (one row chunk, hardware casts)."""
    return {
        "kernel": KERNEL,
        "signature": dict(SIGNATURE),
        "constants": [[[5], block], [[6], 1], [[7], True], [[8], False], [[9], False]],
        "attrs": [[[0], [["tt.divisibility", 16]]], [[1], [["tt.divisibility", 16]]], [[2], [["tt.divisibility", 16]]]],
        "options": {"num_warps": warps, **options},
    }


@pytest.fixture(autouse=True)
def triton_cache(tmp_path, monkeypatch) -> Path:
    """A fresh Triton cache for the test and the helper processes it starts."""
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return cache


def build(data: dict) -> KernelBuild:
    return KernelBuild.from_dict(data, "test")


def probe(name: str, *args):
    """kernel_build_probes.NAME(*args) in a process where the kernels are Triton's JITFunctions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(PROBES), name, json.dumps(args)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_record_round_trips_and_names_its_choices():
    record = build(quant_record(block=512, warps=8))
    assert build(json.loads(json.dumps(record.to_dict()))) == record
    assert (
        record.describe()
        == "_dynamic_quant_kernel[num_warps=8, BLOCK=512, NUM_CHUNKS=1, HW=True, PDL=False, FNUZ=False]"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kernel": "os:system"}, r"test\.kernel: not a kernel of this runtime"),
        ({"kernel": "qruntime.kernels.pdl"}, r"test\.kernel: not a kernel of this runtime"),
        (
            {"signature": {"x_ptr": "*bf16; rm -rf"}},
            r"test\.signature\['x_ptr'\]: not a parameter and a Triton type \('\*bf16; rm -rf'\)",
        ),
        ({"signature": {}}, r"test\.signature: an object of 1 to 256"),
        ({"constants": [[[5], [1, 2]]]}, r"test\.constants\[0\]: a constant is a number"),
        ({"constants": [[[5], "import os"]]}, r"test\.constants\[0\]: a constant is a number"),
        ({"constants": [[[-1], 4]]}, r"test\.constants\[0\]: an argument path"),
        ({"attrs": [[[0], [["tt.pointer_range", 32]]]]}, r"test\.attrs\[0\]: a hint is one of tt\.divisibility"),
        ({"attrs": [[[0], [[[1], 16]]]]}, r"test\.attrs\[0\]: a hint is one of tt\.divisibility"),
        ({"constants": [[[5], 4], [[5], "bf16"]]}, r"test\.constants\[1\]: argument path \[5\] given twice"),
        ({"options": {"num_warps": 3}}, r"test\.options\.num_warps: 3 is out of range"),
        ({"options": {"num_warps": 64}}, r"test\.options\.num_warps: 64 is out of range"),
        ({"options": {"num_stages": "3"}}, r"test\.options\.num_stages"),
        ({"options": {"launch_pdl": 1}}, r"test\.options\.launch_pdl"),
    ],
)
def test_records_are_checked_field_by_field(change, message):
    with pytest.raises(ValueError, match=message):
        build(quant_record() | change)


def test_a_record_resolves_only_to_a_kernel_of_ours():
    kernels = {
        KERNEL: "ok: _dynamic_quant_kernel",
        "qruntime.kernels.fp8_gemm:torch": "not a @triton.jit kernel defined in qruntime.kernels.fp8_gemm",
        "qruntime.kernels.dynamic_quant:wait_for_inputs": "not a @triton.jit kernel defined in",  # pdl.py's
        "qruntime.kernels.no_such_module:k": "no such kernel module",
        "qruntime.kernels.dynamic_quant:fp8_scale": "parameters are not the kernel's",
    }
    got = probe("resolve", [quant_record() | {"kernel": k} for k in kernels])
    for (kernel, want), message in zip(kernels.items(), got, strict=True):
        assert want in message, (kernel, message)


def test_options_other_than_the_launch_options_never_reach_triton(tmp_path):
    """ir_override (a file Triton would compile instead of our source), extern_libs, ptx_options:
    dropped from the record, so the build is of our source with Triton's defaults."""
    garbage = tmp_path / "evil.ptx"
    garbage.write_text("this is not PTX")
    hostile = build(quant_record(ir_override=str(garbage), extern_libs={"libdevice": str(garbage)}, ptx_options="-O0"))
    assert hostile == build(quant_record())
    assert dict(hostile.options) == {"num_warps": 4}
    assert probe("build", hostile.to_dict())["status"] == "built"


def test_string_constants_must_name_a_dtype():
    """Triton keys a constant by its text: "torch.bfloat16" as a string would share the key of the dtype."""
    got = probe("source", quant_record() | {"constants": [[[5], 256], [[6], 1], [[7], "torch.bfloat16"]]})
    assert "'torch.bfloat16' is not a Triton dtype's name" in got["error"]


def test_decoded_constants_are_tritons_own_types():
    got = probe("source", quant_record() | {"constants": [[[5], 256], [[6], {"constexpr": 2}], [[7], "bf16"]]})
    assert got["constants"] == {"5": ["int", "256"], "6": ["constexpr", "constexpr[2]"], "7": ["dtype", "bf16"]}


def test_the_list_holds_at_most_max_kernels():
    data = {"device": "G", "capability": [9, 0], "triton": "3.6.0", "kernels": [quant_record()] * (MAX_KERNELS + 1)}
    with pytest.raises(ValueError, match=rf"where\.kernels: a list of up to {MAX_KERNELS}"):
        BuildList.from_dict(data, "where")


def test_the_recorder_keeps_what_triton_reports_once_and_restores_the_hook():
    got = probe("record_hook", quant_record(block=1024, warps=8))
    assert got["swapped"] and got["restored"]
    assert got["calls"] == ["_dynamic_quant_kernel", "_dynamic_quant_kernel", "other"]  # chained, every call
    (recorded,) = [build(r) for r in got["recorded"]]
    want = build(quant_record(block=1024, warps=8))
    assert (recorded.kernel, recorded.signature, recorded.constants, recorded.attrs) == (
        want.kernel,
        want.signature,
        want.constants,
        want.attrs,
    )
    assert ("num_warps", 8) in recorded.options  # with Triton's defaults of the other launch options
    assert got["skipped"] == []
    assert got["same_entry"]  # what was recorded keys Triton's cache as the compile it saw


def test_the_cache_key_changes_with_config_constants_target_and_source(tmp_path):
    record = quant_record()
    first = probe("build", record)
    assert first["status"] == "built"
    entry = Path(first["entry"])
    assert any(entry.glob("__grp__*.json")), "cache_entry must name the folder triton.compile wrote"
    assert probe("build", record)["status"] == "cached"
    keys = probe("keys", record, str(tmp_path))
    assert keys["entry"] == first["entry"]
    assert keys["copy0"] != keys["copy1"]  # one statement of the kernel's source changed
    for what in ("num_warps", "constant", "target", "copy1"):
        assert keys[what] != keys["entry"], what
        other = Path(keys[what])
        assert not other.exists() or not any(other.glob("__grp__*")), what


def test_a_torn_cache_entry_is_built_again_with_a_warning():
    record = quant_record()
    first = probe("build", record)
    assert first["status"] == "built"
    metadata = Path(first["entry"]) / "_dynamic_quant_kernel.json"
    metadata.write_text('{"hash": "')  # torn mid-write: Triton finds the entry, then fails to read it
    report = probe("prebuild", [record], SM90, 1, 120)
    assert (report["rebuilt"], report["failed"]) == (1, [])
    assert any(
        w.startswith("unreadable Triton cache entries built again: _dynamic_quant_kernel[") for w in report["warnings"]
    )
    json.loads(metadata.read_text())
    assert probe("build", record)["status"] == "cached"


def test_records_build_in_parallel_and_a_failing_one_is_named_with_its_config():
    records = [quant_record(block=b, warps=w) for b, w in ((256, 4), (512, 4), (100, 4), (1024, 8))]
    report = probe("prebuild", records, SM90, 2, 300)
    print(report["summary"])
    assert (report["total"], report["built"], report["cached"], report["unfinished"]) == (4, 3, 0, 0)
    assert report["workers"] == 2 and not report["workers_alive"] and not report["leader_alive"]
    assert not report["keys_alive"]  # wait() joined the thread that hashes the kernels' sources
    (failed,) = report["failed"]
    assert failed.startswith("_dynamic_quant_kernel[num_warps=4, BLOCK=100, NUM_CHUNKS=1")
    assert "arange's range must be a power of 2" in failed
    (warning,) = [w for w in report["warnings"] if "recorded kernel" in w]  # Triton has warnings of its own
    assert warning.startswith("1 recorded kernel(s) did not build ahead") and "BLOCK=100" in warning
    # the next load finds the three in the cache without starting a worker for them
    again = probe("prebuild", records, SM90, 2, 300)
    assert (again["built"], again["cached"], len(again["failed"]), again["workers"]) == (0, 3, 1, 1)


def test_tune_lists_the_records_longest_compile_first_timed_in_a_cache_of_its_own():
    """longest_first builds every record in an empty cache of its own (this process's stays empty),
    times each and orders them longest first; the one that fails to build comes last, untimed."""
    records = [quant_record(block=b, warps=w) for b, w in ((256, 4), (100, 4), (1024, 8), (512, 2))]
    got = probe("timed", records, SM90, 2)
    print(got)
    assert sorted(got["order"]) == [0, 1, 2, 3] and got["order"][-1] == 1 and got["seconds"][-1] is None
    seconds = got["seconds"][:-1]
    assert all(s > 0 for s in seconds) and seconds == sorted(seconds, reverse=True)
    assert got["cache_entries"] == []


def test_the_loads_thread_hashes_each_kernels_sources_past_a_bad_record():
    """warm_keys computes what the JIT's first launch would (here after a record whose constants
    Triton cannot take): each kernel's key is there before any launch."""
    bad = quant_record() | {"constants": [[[5], 256], [[6], 1], [[7], "torch.bfloat16"]]}
    got = probe("warm", [bad, quant_record()], SM90)
    # and the modules the first launch imports (this Triton has both) are imported here instead
    assert got == {"before": [False, False], "after": [True, True], "imported": [[False, False], [True, True]]}
    halted = probe("warm", [quant_record()], SM90, True)  # a cancelled load's: no record hashed
    assert halted["before"] == halted["after"] == [False]


def test_a_build_started_before_the_load_hashes_keys_only_once_taken_over():
    """qruntime.early_prebuild starts the build before the load imports its kernels (warm=False):
    the key thread starts at adopt, and the report says the build started early; one never taken
    over is cancelled with nothing left running."""
    taken = probe("early", [quant_record()], SM90, True)
    assert taken["keys_before_adopt"] is False and taken["early"] is True and taken["hashed"] == [True]
    assert "1 built" in taken["summary"] and taken["summary"].endswith("started at the load's call)")
    assert not taken["keys_alive"] and not taken["leader_alive"]
    dropped = probe("early", [quant_record()], SM90, False)
    assert dropped["keys_before_adopt"] is False and dropped["hashed"] == [False]
    assert not dropped["keys_alive"] and not dropped["leader_alive"]


def test_the_workers_are_killed_at_the_deadline():
    records = [quant_record(block=1 << b, warps=w) for b in range(5, 12) for w in (1, 2, 4, 8)]
    report = probe("prebuild", records, SM90, 1, 1.0, True)  # 1 s after the worker starts
    assert report["elapsed"] < 30 and report["workers"] == 1 and not report["workers_alive"]
    assert not report["leader_alive"]
    assert report["unfinished"] > 0 and report["unfinished"] + report["built"] == len(records)
    assert "cut off by the deadline" in report["summary"]


@pytest.mark.parametrize("at_once", [False, True])
def test_a_failed_load_cancels_the_build_at_once(at_once):
    """Cancelled while its workers compile, or while its build process still looks records up (or
    has not made its process group yet): nothing lives on."""
    records = [quant_record(block=1 << b, warps=w) for b in range(5, 12) for w in (1, 2, 4, 8)]
    got = probe("cancel", records, SM90, 2, at_once)
    assert got["workers"] == (0 if at_once else 2) and not got["alive"] and got["seconds"] < 10
    # nor the key thread: an interpreter that exits while it is inside Triton's C++ aborts (CI, once)
    assert not got["keys_alive"]


def test_a_target_nobody_builds_for_fails_every_record_by_name():
    report = probe("prebuild", [quant_record(), quant_record(block=512)], ("no-such-backend", 90, 32), 1, 120)
    assert report["built"] == 0 and len(report["failed"]) == 2 and report["workers"] == 0
    assert all(f.startswith("_dynamic_quant_kernel[") and "no-such-backend" in f for f in report["failed"])
    assert any(w.startswith("2 recorded kernel(s) did not build ahead") for w in report["warnings"])


def _artifact_with_list(tmp_path, data, listed=True) -> tuple[Path, set]:
    root = tmp_path / "art"
    rel = builds_file("NVIDIA H200")
    (root / rel).parent.mkdir(parents=True)
    (root / rel).write_text(data if isinstance(data, str) else json.dumps(data))
    return root, {rel} if listed else set()


def test_a_list_of_another_gpu_or_triton_is_ignored_with_a_warning(tmp_path):
    good = {"device": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0", "kernels": [quant_record()]}
    root, listed = _artifact_with_list(tmp_path, good)
    builds = read_build_list(root, "NVIDIA H200", (9, 0), "3.6.0", listed)
    assert builds.kernels == (build(quant_record()),)
    for name, capability, version, why in [
        ("NVIDIA H200", (9, 0), "3.9.0", "with Triton 3.6.0, not"),
        ("NVIDIA H200", (10, 0), "3.6.0", r"\(sm 90\).*\(sm 100\)"),
    ]:
        with pytest.warns(UserWarning, match=why):
            assert read_build_list(root, name, capability, version, listed) is None
    assert read_build_list(tmp_path / "none", "NVIDIA H200", (9, 0), "3.6.0", set()) is None  # no list: quiet


@pytest.mark.parametrize(
    "data, listed, why",
    [
        ('{"device": "NVIDIA H200", "kernels": [', True, "kernel build list ignored"),
        (
            {"device": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0", "kernels": [{"kernel": "os:system"}]},
            True,
            r"kernels\[0\]\.kernel: not a kernel of this runtime",
        ),
        ({"device": "NVIDIA H200", "capability": [9], "triton": "3.6.0", "kernels": []}, True, r"\.capability"),
        ({"device": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0", "kernels": []}, False, "not listed"),
    ],
)
def test_a_corrupt_or_foreign_list_is_ignored_with_a_warning(tmp_path, data, listed, why):
    root, files = _artifact_with_list(tmp_path, data, listed)
    with pytest.warns(UserWarning, match=why):
        assert read_build_list(root, "NVIDIA H200", (9, 0), "3.6.0", files) is None


def _junk(rng, depth: int = 0):
    """A random JSON value: what a hostile list could hold anywhere."""
    kinds = ["int", "float", "str", "bool", "none"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 16, 1 << 70, rng.randrange(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.5, -2.0, 1e308])
    if kind == "str":
        return rng.choice(["", "bf16", "x" * 300, "constexpr", "*fp8e4nv", "a b"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["constexpr", "k", "num_warps"]): _junk(rng, depth + 1) for _ in range(rng.randrange(3))}


def test_any_record_is_taken_or_refused_with_a_value_error(rng):
    """Each field of a good record replaced by random JSON, 2000 times: from_dict never fails but
    with a ValueError (no TypeError from comparing or hashing what it was given)."""
    refused = 0
    for _ in range(2000):
        data = quant_record()
        for field in rng.sample(["kernel", "signature", "constants", "attrs", "options"], rng.randrange(1, 3)):
            data[field] = _junk(rng)
        if rng.random() < 0.3:  # or one pair inside a list
            data["constants"] = [*quant_record()["constants"], [_junk(rng), _junk(rng)]]
        if rng.random() < 0.3:  # or one hint
            data["attrs"] = [[[rng.randrange(3)], [[_junk(rng), _junk(rng)]]]]
        try:
            build(data)
        except ValueError:
            refused += 1
    assert refused > 1000
