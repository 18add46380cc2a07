"""The two sides of an evaluation, each a function from token ids to next-token logits.

The artifact runs on qruntime, sized to score one window. The reference is a Hugging Face checkpoint
run by transformers' AutoModelForCausalLM (an independent implementation: what `qcompile eval` uses
for a source checkpoint) or an artifact, normally the bf16 compile of that checkpoint, run by
qruntime's reference (torch) backend.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qcompile.errors import EvalError

if TYPE_CHECKING:
    from qruntime import Engine

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


class Reference(Protocol):
    """What evaluate() needs of a reference model."""

    kind: str
    path: Path
    vocab_size: int

    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(ids), V] of the next token after every prefix of ids."""
        ...


class TransformersReference:
    """A Hugging Face checkpoint run by transformers' AutoModelForCausalLM."""

    kind = "transformers"

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, progress: bool = True) -> None:
        try:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
        except ImportError as exc:
            raise EvalError(
                f"the reference {path} is a checkpoint, which transformers runs: pip install transformers "
                "(or `qcompile[reference]`), or give a bf16 artifact of it as the reference"
            ) from exc
        # transformers' loading bar follows our progress setting (restored after, it is process-wide)
        hide_bar = hf_logging.is_progress_bar_enabled() and not (progress and sys.stderr.isatty())
        if hide_bar:
            hf_logging.disable_progress_bar()
        try:
            # device_map: weights go straight to the device, with no full copy in host memory first
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise EvalError(f"the reference {path} cannot be loaded by transformers: {exc}") from exc
        finally:
            if hide_bar:
                hf_logging.enable_progress_bar()
        self.path, self.device = path, device
        self.model = model.eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device=self.device)).logits[0].float()


class RuntimeReference:
    """An artifact (normally the bf16 compile of the checkpoint) run by qruntime's reference backend."""

    kind = "qruntime"

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, window: int) -> None:
        self.path = path
        self.engine = load_engine(path, device, dtype, window, backend="reference", role="reference")
        self.vocab_size = self.engine.vocab_size

    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.engine.score(ids)


def open_reference(
    path: str | Path, device: torch.device, dtype: torch.dtype, window: int, progress: bool = True
) -> Reference:
    """A directory with manifest.json is an artifact (qruntime); otherwise a checkpoint (transformers)."""
    path = Path(path)
    if not path.is_dir():
        raise EvalError(f"the reference {path} is not a directory (a Hugging Face checkpoint or an artifact)")
    if (path / "manifest.json").is_file():
        return RuntimeReference(path, device, dtype, window)
    if not (path / "config.json").is_file():
        raise EvalError(f"the reference {path} has neither config.json (a checkpoint) nor manifest.json (an artifact)")
    return TransformersReference(path, device, dtype, progress)


def load_engine(
    path: Path, device: Any, dtype: torch.dtype, window: int, backend: str = "auto", role: str = "artifact"
) -> Engine:
    """qruntime.load sized for scoring one window: a KV cache of window + 1 tokens, no CUDA graphs.
    The window is capped by the model's context."""
    import qruntime
    from qruntime.artifact import ArtifactFormatError, read_manifest, require

    try:
        manifest = read_manifest(path)
        require(manifest, path, "spec.max_position_embeddings", "kv_cache.block_size")
        context = int(manifest["spec"]["max_position_embeddings"])
        block_size = int(manifest["kv_cache"]["block_size"])
        length = min(window, context - 1) + 1
        return qruntime.load(
            path,
            device,
            dtype,
            max_model_len=length,
            max_num_seqs=1,
            max_num_batched_tokens=max(2048, length),
            num_kv_blocks=-(-length // block_size),
            backend=backend,
            cuda_graphs=False,
        )
    except (ArtifactFormatError, ValueError) as exc:
        raise EvalError(f"the {role} {path} cannot be loaded: {exc}") from exc


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise EvalError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """cuda when available by default; a device this machine does not have is an error."""
    from qruntime.load_options import resolve_device as runtime_device

    try:
        return runtime_device(device)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
