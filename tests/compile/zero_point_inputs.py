"""Helpers of the asymmetric int4 input tests (test_prequantized_w4a16_zp.py): AutoAWQ GEMM checkpoints
written from their published layout, and the weights each format's own dequantization gives.

AutoAWQ's WQLinear_GEMM, as its repository documents and packs it (awq/modules/linear/gemm.py,
awq/utils/packing_utils.py), stores a linear of [out, in] features as `qweight` int32 [in, out / 8],
`qzeros` int32 [in / group, out / 8] and `scales` [in / group, out]; each word holds eight output
channels' unsigned 4-bit codes, nibble i (bits 4i) holding channel AWQ_PACK_ORDER[i] of its eight;
a weight is (code - zero) * scale. Written here with loops over that order, apart from the
compiler's vectorised unpacking (qcompile.source.awq), so the two are independent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output channel (of eight) in nibble i


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned codes [rows, cols] (cols a multiple of 8) -> AWQ words int32 [rows, cols / 8]."""
    rows, cols = codes.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for w in range(cols // 8):
        for i, channel in enumerate(AWQ_PACK_ORDER):
            words[:, w] |= codes[:, 8 * w + channel].to(torch.int64) << (4 * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ words int32 [rows, cols / 8] -> unsigned codes [rows, cols] (int64)."""
    rows, n = words.shape
    codes = torch.zeros(rows, n * 8, dtype=torch.int64)
    for w in range(n):
        for i, channel in enumerate(AWQ_PACK_ORDER):
            codes[:, 8 * w + channel] = (words[:, w].to(torch.int64) >> (4 * i)) & 0xF
    return codes


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AutoAWQ's weight [out, in] in the scales' dtype: (code - zero) * scale."""
    codes, zeros = awq_unpack(qweight), awq_unpack(qzeros).repeat_interleave(group, 0)  # [in, out]
    return ((codes - zeros).to(scales.dtype) * scales.repeat_interleave(group, 0)).T


def unpack_ct(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """compressed-tensors pack-quantized int32 [rows, cols / 8] -> unsigned codes [rows, cols] (int64):
    column j in bits 4 (j mod 8) of word j // 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((packed.to(torch.int64)[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1)[:, :cols]


def compressed_tensors_to_awq(src: Path, dst: Path, dtype: torch.dtype | None = None) -> Path:
    """A compressed-tensors asymmetric W4A16 checkpoint `src` rewritten as AutoAWQ GEMM at `dst`: the
    same codes, zero points and scales (so the same weights), AWQ's tensors and config. `dtype`: the
    model dtype to store everything floating in (float16 as AutoAWQ writes it; exact for these scales)."""
    dst.mkdir(parents=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.is_file() and file.name != "config.json":
            (dst / file.name).write_bytes(file.read_bytes())
    for file in sorted(src.glob("*.safetensors")):
        tensors = load_file(file)
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            module, _, key = name.rpartition(".")
            if key in ("weight_scale", "weight_zero_point", "weight_shape"):
                continue
            if key != "weight_packed":
                out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                continue
            rows, cols = (int(v) for v in tensors[f"{module}.weight_shape"])
            scale = tensors[f"{module}.weight_scale"]  # [rows, groups]
            zp_words = tensors[f"{module}.weight_zero_point"]  # [ceil(rows / 8), groups], rows packed
            zeros = unpack_ct(zp_words.T.contiguous(), rows).T  # [rows, groups], unsigned codes
            out[f"{module}.qweight"] = awq_pack(unpack_ct(t, cols).T.contiguous())  # [cols, rows / 8]
            out[f"{module}.qzeros"] = awq_pack(zeros.T.contiguous())  # [groups, rows / 8]
            out[f"{module}.scales"] = (scale.to(dtype) if dtype is not None else scale).T.contiguous()
        save_file(out, dst / file.name, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": None,
    }
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        config.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if (dst / "model.safetensors.index.json").exists():  # the index names the tensors it maps
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f.name for f in sorted(dst.glob("*.safetensors")) for n in load_file(f)}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def write_dequantized(bf16: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A copy of the unquantized checkpoint `bf16` at `dst` whose linears are `weights` (dequantized)."""
    dst.mkdir(parents=True)
    for file in bf16.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    for file in sorted(bf16.glob("*.safetensors")):
        tensors = load_file(file)
        for name in tensors:
            if name in weights:
                assert weights[name].shape == tensors[name].shape, name
                tensors[name] = weights[name].to(tensors[name].dtype).contiguous()
        save_file(tensors, dst / file.name, metadata={"format": "pt"})
    return dst
