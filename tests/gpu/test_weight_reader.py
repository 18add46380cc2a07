"""qruntime.weight_reader on the GPU: pinned buffers, copies on a side stream overlapped with the
reads, buffers handed back on CUDA events. Every tensor equals safetensors' read of it, with a ring
small enough that buffers are reused many times over, and the engine's weights loaded through it
equal the file's bytes."""

from __future__ import annotations

import json

import pytest
import torch
from qruntime.weight_reader import read_extents
from weight_shards import extents_of, write_shard

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk_bytes, readers, buffers", [(4093, 3, 2), (65536, 4, 8)])
def test_every_tensor_lands_on_the_gpu_as_written(tmp_path, rng, cuda, chunk_bytes, readers, buffers):
    path = tmp_path / "model.safetensors"
    want = write_shard(path, rng, 150)
    extents = extents_of(path)
    dst = {e.key: torch.full_like(want[e.key], 0, device=cuda) for e in extents}
    assert read_extents(extents, dst, chunk_bytes=chunk_bytes, readers=readers, buffers=buffers) == sum(
        e.length for e in extents
    )
    for name, tensor in want.items():  # the reader's stream is joined to the current one: no sync needed
        assert torch.equal(dst[name].view(torch.uint8).cpu(), tensor.view(torch.uint8)), name


def test_engine_weights_equal_the_files(gpu_artifact, cuda):
    import onnx
    from qruntime.weights import load_initializers

    graph = onnx.load(str(gpu_artifact / "graph.onnx"), load_external_data=False).graph
    listed = json.loads((gpu_artifact / "manifest.json").read_text())["files"]
    weights = load_initializers(gpu_artifact, graph, cuda, torch.bfloat16, listed=listed)
    on_cpu = load_initializers(gpu_artifact, graph, torch.device("cpu"), torch.bfloat16, listed=listed)
    assert weights.keys() == on_cpu.keys()
    for name, tensor in weights.items():
        assert tensor.device.type == "cuda" and tensor.dtype == on_cpu[name].dtype
        assert tensor.data_ptr() % 256 == 0  # its own allocation: the alignment the kernels were recorded with
        assert torch.equal(tensor.cpu().view(torch.uint8), on_cpu[name].contiguous().view(torch.uint8)), name
