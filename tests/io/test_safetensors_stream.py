"""Streaming safetensors IO against the reference library, and the header checks."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from qcompile.errors import CheckpointError
from qcompile.io.safetensors_stream import OutputTensor, StreamingWriter, read_header


def test_reader_matches_library(tmp_path):
    tensors = {
        "a": torch.randn(7, 5).to(torch.bfloat16),
        "b": torch.randn(3).to(torch.float32),
        "c": (torch.randn(4, 6) * 10).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    entries, meta = read_header(path)
    assert meta == {"format": "pt"}
    for name, ref in tensors.items():
        assert torch.equal(entries[name].read().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(entries["a"].read_rows(2, 6), tensors["a"][2:6])


def test_writer_out_of_order_chunks_load_in_library(tmp_path):
    a = torch.randn(10, 4).to(torch.bfloat16)
    c = (torch.randn(6, 8)).to(torch.float8_e4m3fn)
    path = tmp_path / "y.safetensors"
    with StreamingWriter(path, [OutputTensor("a", a.dtype, (10, 4)), OutputTensor("c", c.dtype, (6, 8))]) as w:
        w.write("c", 3 * 8, c[3:])
        w.write("a", 0, a[:5])
        w.write("c", 0, c[:3])
        w.write("a", 5 * 4 * 2, a[5:])
        with pytest.raises(TypeError):
            w.write("a", 0, c)
        with pytest.raises(ValueError, match="past the end"):
            w.write("a", 8 * 4 * 2, a[:3])
    loaded = load_file(path)
    assert torch.equal(loaded["a"], a)
    assert torch.equal(loaded["c"].view(torch.uint8), c.view(torch.uint8))


def test_truncated_file_is_named(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(64, 64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"t\.safetensors: truncated file: tensor 'w'"):
        read_header(path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(path)


def test_bad_headers(tmp_path):
    path = tmp_path / "h.safetensors"
    raw = b"{not json"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(path)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 6]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="needs 8"):
        read_header(path)
    header = json.dumps({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 2)
    with pytest.raises(CheckpointError, match="unknown dtype 'Q4'"):
        read_header(path)
