"""AutoAWQ GEMM checkpoints (`quant_method: awq`, `version: gemm`, the Qwen/Qwen3-*-AWQ releases) read
into a StoredFormat, and their int4 layout turned into the artifact's.

Their layout, as AutoAWQ's WQLinear_GEMM stores a linear of logical [rows, cols] (out, in features):
  qweight  int32 [cols, rows / 8]        eight 4-bit codes of one input column a word, along the rows
  qzeros   int32 [cols / group, rows / 8] the zero points' codes, packed the same way
  scales   [cols / group, rows]          the model dtype (fp16 for AutoAWQ)
with AWQ's interleaved order within a word: nibble i (bits 4i) holds row 8w + AWQ_ORDER[i] of word w,
so row 8w + j sits in nibble AWQ_REVERSE_ORDER[j]. A weight is (code - zero) * scale: asymmetric int4
with unsigned codes, which is the artifact's `w4a16-zp` once transposed (`to_rows`), bit for bit.
Modules left unquantized: `modules_to_not_convert` (matched anywhere in a module name, as
transformers does), lm_head (never converted) and the MoE routers.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.quant import int4
from qcompile.source.stored_format import AWQ_GEMM, StoredFormat

METHOD = "awq"
SCHEME = "w4a16-zp"
GROUP_SIZE = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the row of a word's nibble i, less 8w
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))  # the nibble of row 8w + j
# keys transformers' AwqConfig writes that change nothing stored (kernels, fusing)
_INERT = frozenset({"backend", "do_fuse", "fuse_max_seq_len", "exllama_config", "modules_to_fuse"})
_KEYS = frozenset({"quant_method", "bits", "group_size", "version", "zero_point", "modules_to_not_convert"}) | _INERT


def read_awq(qc: dict[str, Any], where: str) -> StoredFormat:
    """The StoredFormat of a `quant_method: awq` quantization_config `qc` (`where` names it in errors)."""
    unknown = sorted(str(k) for k in qc if k not in _KEYS)
    if unknown:
        raise CheckpointError(
            f"{where}.{shown(unknown[0], 60)} is not read for quant_method 'awq' (read: {', '.join(sorted(_KEYS))})"
        )
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise CheckpointError(
            f"{where}.version is {shown(version)}; qcompile reads AutoAWQ's 'gemm' layout only (GEMV, Marlin and "
            "the exllama layouts pack the weights differently)"
        )
    if qc.get("bits", 4) != 4:
        raise CheckpointError(f"{where}.bits is {shown(qc['bits'])}; only 4-bit AWQ weights are read")
    if qc.get("group_size") != GROUP_SIZE:
        raise CheckpointError(
            f"{where}.group_size is {shown(qc.get('group_size'))}; qcompile's int4 layout runs groups of "
            f"{GROUP_SIZE} input columns (scheme {SCHEME!r})"
        )
    if qc.get("zero_point", True) is not True:
        raise CheckpointError(
            f"{where}.zero_point is {shown(qc['zero_point'])}; AWQ without zero points is not read (AutoAWQ's "
            "GEMM checkpoints have them)"
        )
    keep = qc.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(m, str) and m for m in keep):
        raise CheckpointError(f"{where}.modules_to_not_convert must be a list of module names, got {shown(keep)}")
    ignore = ("lm_head", *(f"re:.*{re.escape(m)}" for m in keep))
    return StoredFormat(
        METHOD,
        "gemm",
        SCHEME,
        ignore,
        weight_key="qweight",
        scale_key="scales",
        zero_point_key="qzeros",
        layout=AWQ_GEMM,
    )


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [n, rows / 8] -> uint8 codes [n, rows] in row order (the interleave undone)."""
    shifts = torch.tensor([4 * i for i in AWQ_REVERSE_ORDER], dtype=torch.int32, device=words.device)
    codes = (words[..., None] >> shifts) & int4.CODE_MAX  # [n, rows / 8, 8]: row 8w + j at [:, w, j]
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


def to_rows(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [start, stop) of an AWQ GEMM linear in the artifact's layout, from its whole tensors:
    (packed int32 [stop - start, cols / 8], scales [stop - start, groups], zero-point codes uint8
    [stop - start, groups]); only the words holding those rows are unpacked."""
    first, end = start // 8, -(-stop // 8)
    lo, hi = start - 8 * first, stop - 8 * first
    codes = unpack_rows(qweight[:, first:end])[:, lo:hi]  # [cols, n]
    weight = int4.pack_int4(codes.T.to(torch.int8) + int4.Q_MIN)  # [n, cols / 8]
    zeros = unpack_rows(qzeros[:, first:end])[:, lo:hi].T.contiguous()  # [n, groups]
    return weight, scales[:, start:stop].T.contiguous(), zeros
