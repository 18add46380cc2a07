"""qruntime.early_prebuild: which calls start the kernel builds right after torch's import (one-rank
local artifacts on the Triton backend of a CUDA device, as the loader decides it, kernels built ahead),
the rank taking a build over only for its own artifact and device (else cancelling it), and
qruntime.load cancelling one that a failed load never took. No GPU here: torch.cuda's queries and
start_prebuild are replaced; tests/runtime/test_kernel_builds.py builds real kernels, and
tests/gpu/test_kernel_prebuild.py checks a real load takes its early build over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import qruntime
import qruntime.early_prebuild as early_prebuild
import qruntime.kernel_prebuild as kernel_prebuild
import qruntime.rank as rank
import torch
from qruntime.early_prebuild import EarlyPrebuild, start_early


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


class FakeBuild:
    """Stands for a Prebuild: what was asked of it."""

    def __init__(self) -> None:
        self.adopted = self.cancelled = 0

    def adopt(self) -> FakeBuild:
        self.adopted += 1
        return self

    def cancel(self) -> None:
        self.cancelled += 1


@pytest.fixture
def gpus(monkeypatch):
    """Two H200s as far as torch.cuda's queries go, the current one cuda:0; start_prebuild records
    its calls and returns a FakeBuild."""
    calls = []

    def start(root, listed, name, capability, jobs=None, warm=True):
        calls.append({"root": root, "listed": listed, "name": name, "capability": capability, "warm": warm})
        return FakeBuild()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(kernel_prebuild, "start_prebuild", start)
    monkeypatch.setattr(rank, "start_prebuild", start)
    return calls


def test_a_default_call_starts_the_build_for_the_current_gpu_without_its_key_thread(art, gpus):
    early = start_early(art, (), {})
    listed = frozenset(json.loads((art / "manifest.json").read_text())["files"])
    assert early is not None and early.root == Path(art) and early.device == torch.device("cuda", 0)
    (call,) = gpus
    assert call == {"root": Path(art), "listed": listed, "name": "NVIDIA H200", "capability": (9, 0), "warm": False}
    assert start_early(art, ("cuda:1",), {}).device == torch.device("cuda", 1)
    assert start_early(str(art), (), {"device": torch.device("cuda", 1), "dtype": torch.bfloat16}) is not None


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("cpu",), {}),
        (("cuda:7",), {}),  # no such GPU: the load says so
        (("tpu",), {}),
        ((None, torch.float32), {}),
        ((), {"dtype": "float32"}),
        ((), {"backend": "reference"}),
        ((), {"prebuild_kernels": False}),
        ((), {"tp": 2}),
        ((), {"backend": "triton", "dtype": "float32"}),  # the loader refuses it
        ((), {"dtype": "int8"}),
    ],
)
def test_a_call_that_asks_for_no_kernels_on_a_gpu_starts_nothing(art, gpus, args, kwargs):
    assert start_early(art, args, kwargs) is None and gpus == []


def test_nothing_starts_without_cuda_for_a_hub_url_a_sharded_or_an_unreadable_artifact(
    art, gpus, tmp_path, monkeypatch
):
    assert start_early("hf://org/model", (), {}) is None
    assert start_early(tmp_path / "missing", (), {}) is None
    sharded = tmp_path / "sharded"
    shutil.copytree(art, sharded)
    manifest = json.loads((sharded / "manifest.json").read_text())
    (sharded / "manifest.json").write_text(json.dumps(manifest | {"tp": 2}))
    fp32 = tmp_path / "fp32"  # a model whose own dtype runs on the reference path
    shutil.copytree(art, fp32)
    (fp32 / "manifest.json").write_text(json.dumps(manifest | {"spec": manifest["spec"] | {"dtype": "float32"}}))
    assert start_early(fp32, (), {}) is None

    def untouched(*args):
        raise AssertionError("CUDA initialised for a load that builds nothing early")

    with monkeypatch.context() as m:  # decided from the call and the manifest before CUDA is touched
        for name in ("is_available", "current_device", "device_count", "get_device_name"):
            m.setattr(torch.cuda, name, untouched)
        assert start_early(sharded, (), {}) is None and start_early(art, ("cpu",), {}) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert start_early(art, (), {}) is None
    assert gpus == []


def _config(root, backend="triton", prebuild_kernels=True):
    return SimpleNamespace(
        root=Path(root), listed=frozenset(), backend=backend, prebuild_kernels=prebuild_kernels, tp=1
    )


def test_the_rank_takes_over_a_build_started_for_its_artifact_and_device(art, gpus):
    build = FakeBuild()
    early = EarlyPrebuild(Path(art), torch.device("cuda", 0), build)
    assert rank._start_prebuild(_config(art), torch.device("cuda"), early) is build
    assert (build.adopted, build.cancelled, gpus) == (1, 0, [])
    # one that found no list for this GPU: the rank does not look again
    assert (
        rank._start_prebuild(_config(art), torch.device("cuda", 0), EarlyPrebuild(Path(art), early.device, None))
        is None
    )
    assert gpus == []


@pytest.mark.parametrize("other", ["device", "root"])
def test_a_build_for_another_device_or_artifact_is_cancelled_and_the_rank_starts_its_own(art, gpus, tmp_path, other):
    build = FakeBuild()
    root, device = (Path(art), torch.device("cuda", 1)) if other == "device" else (tmp_path, torch.device("cuda", 0))
    own = rank._start_prebuild(_config(art), torch.device("cuda", 0), EarlyPrebuild(root, device, build))
    assert isinstance(own, FakeBuild) and own is not build
    assert (build.adopted, build.cancelled) == (0, 1) and len(gpus) == 1 and gpus[0]["warm"] is True


@pytest.mark.parametrize("config", [{"backend": "reference"}, {"prebuild_kernels": False}])
def test_a_rank_that_builds_nothing_ahead_cancels_the_build(art, gpus, config):
    build = FakeBuild()
    early = EarlyPrebuild(Path(art), torch.device("cuda", 0), build)
    assert rank._start_prebuild(_config(art, **config), torch.device("cuda", 0), early) is None
    assert (build.adopted, build.cancelled, gpus) == (0, 1, [])


def test_load_hands_its_build_to_the_loader_and_cancels_one_a_failed_load_never_took(art, monkeypatch):
    builds = []

    def start(path, args, kwargs, manifest=None):
        builds.append(FakeBuild())
        return EarlyPrebuild(Path(path), torch.device("cuda", 0), builds[-1])

    monkeypatch.setattr(early_prebuild, "start_early", start)
    with pytest.raises(ValueError, match="max_model_len"):
        qruntime.load(art, device="cpu", max_model_len=1)
    assert builds[-1].cancelled == 1 and builds[-1].adopted == 0
    # a CPU load builds no kernels: its rank cancels the build it was handed
    engine = qruntime.load(art, device="cpu", dtype=torch.float32, num_kv_blocks=8)
    assert builds[-1].cancelled >= 1 and builds[-1].adopted == 0
    assert "kernel_prebuild" not in engine.description
    engine.close()


def test_a_manifest_given_is_not_read_again(art, gpus, monkeypatch):
    """qruntime.load reads the manifest once and hands it to start_early, which then reads none."""
    import qruntime.artifact

    manifest = qruntime.artifact.read_manifest(art)
    monkeypatch.setattr(qruntime.artifact, "read_manifest", lambda root: pytest.fail(f"{root}: read again"))
    assert start_early(art, (), {}, manifest) is not None
    assert gpus[-1]["listed"] == frozenset(manifest["files"])
