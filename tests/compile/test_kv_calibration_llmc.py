"""Calibrated FP8 KV-cache scales cross-checked against llm-compressor's `kv_cache_scheme`.

Both calibrate the trained fixture (bf16) on the same [N, 128] token windows of its heldout.txt:
ours with `kv_scales`, llm-compressor with `oneshot(dataset=DataLoader(those windows, in order))`.

What llm-compressor 0.14 / compressed-tensors 0.19 do (read from their source):
- Every attention module gets a `QuantizedKVCache` passed as its `past_key_values`; the key and
  value hooks on it observe what `Qwen3Attention` hands to `cache.update`: keys after k_norm and
  RoPE, values as projected. That is what our calibration takes from the cache, so layer 0 (whose
  inputs involve no attention) comes out equal.
- The scheme names no observer, so `initialize_observer` picks "minmax": a moving average over
  batches, `min = 0.99 * min + 0.01 * batch_min` (max alike), in the observed dtype (bf16).
  "static_minmax" keeps the running min and max instead: our global amax.
- scale = max(|min|, |max|) / 448, computed in bf16 and stored as `k_scale` / `v_scale` of shape
  [1] in the attention's parameter dtype (bf16); ours is float32.
- Calibration runs layer by layer (sequential pipeline) with fake quantization disabled, so each
  layer sees unquantized inputs as in ours, but under eager attention (`calibration_forward_context`)
  where ours uses sdpa.

Tolerance, in bf16 steps of the scale (our float32 scale rounded to bf16 first, which alone is
up to 0.2% off): 0 for layer 0, whose K/V come from the same ops on the same inputs on both sides.
Later layers' inputs went through eager vs sdpa attention, which round the attention output
differently in bf16; that moved a layer's bf16 amax by at most 2 steps over all 18 batches of 8
heldout windows, and dividing by 448 (= 1.75 * 2**8) and rounding again turns 2 steps of the amax
into at most 3 of the scale: ATTN_ULPS. Measured here: 0 or 1 step with one batch, up to 2
(-1.06%, layer 1's k_scale) with static_minmax over four batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from llmc_reference import ATTN_ULPS, bf16_ulps
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, DynamicCache

from qcompile.compile.calibrate import calibration_ids, kv_scales
from qcompile.compile.kvcache import KVScales
from qcompile.source.checkpoint import Checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3-stdlib"
DATA = FIXTURE / "heldout.txt"
SEQ_LEN = 128
AVERAGING_CONSTANT = 0.01  # llm-compressor's "minmax" observer default

Scales = dict[str, list[float]]  # "k" / "v" -> per layer


def _ours(windows: int, batch: int) -> tuple[torch.Tensor, KVScales]:
    checkpoint = Checkpoint.open(FIXTURE)
    ids = calibration_ids(checkpoint, DATA, SEQ_LEN, windows)  # [windows, SEQ_LEN]
    assert ids.shape == (windows, SEQ_LEN)
    return ids, kv_scales(checkpoint, DATA, seq_len=SEQ_LEN, max_sequences=windows, batch=batch)


def _llm_compressor(ids: torch.Tensor, batch: int, observer: str | None = None) -> Scales:
    """k_scale / v_scale per layer after oneshot with a static per-tensor FP8 kv_cache_scheme."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16)
    loader = DataLoader([{"input_ids": row} for row in ids], batch_size=batch)  # in order, unshuffled
    extra = {} if observer is None else {"observer": observer}
    scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True, **extra)
    oneshot(model=model, dataset=loader, recipe=QuantizationModifier(targets=[], kv_cache_scheme=scheme))
    scales: Scales = {"k": [], "v": []}
    for layer in model.model.layers:
        for kind in scales:
            scale = getattr(layer.self_attn, f"{kind}_scale")
            assert scale.dtype == torch.bfloat16 and scale.shape == (1,)  # stored in the model dtype
            scales[kind].append(float(scale))
    return scales


def _assert_close(theirs: Scales, ours: KVScales) -> None:
    mine = {"k": ours.k_scale, "v": ours.v_scale}
    for kind in ("k", "v"):
        assert len(theirs[kind]) == len(mine[kind])
        for layer, (a, b) in enumerate(zip(theirs[kind], mine[kind], strict=True)):
            limit = 0 if layer == 0 else ATTN_ULPS
            assert bf16_ulps(a, b) <= limit, f"{kind}_scale layer {layer}: llm-compressor {a}, ours {b}"


def test_one_batch_matches_to_the_bf16_rounding_of_the_scale():
    """One batch: the moving average has a single term, so both take the amax of the same keys."""
    ids, ours = _ours(windows=8, batch=8)
    _assert_close(_llm_compressor(ids, batch=8), ours)


@pytest.fixture(scope="module")
def four_batches() -> tuple[torch.Tensor, KVScales]:
    return _ours(windows=16, batch=4)


def test_static_minmax_over_batches_is_our_global_amax(four_batches):
    ids, ours = four_batches
    _assert_close(_llm_compressor(ids, batch=4, observer="static_minmax"), ours)


def _moving_average_scales(ids: torch.Tensor, batch: int) -> Scales:
    """The "minmax" observer replayed on each batch's signed K/V min and max (transformers' model,
    bf16), then the symmetric scale, in bf16 as llm-compressor computes them."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16).eval()
    stats: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    with torch.inference_mode():
        for chunk in ids.split(batch):
            cache = DynamicCache()
            model(chunk, past_key_values=cache, use_cache=True)
            for layer, entry in enumerate(cache.layers):
                for kind, x in (("k", entry.keys), ("v", entry.values)):
                    stats.setdefault((kind, layer), []).append((x.min(), x.max()))
    scales: Scales = {"k": [], "v": []}
    for (kind, _), batches in stats.items():
        low, high = batches[0]
        for batch_low, batch_high in batches[1:]:
            low = low * (1 - AVERAGING_CONSTANT) + batch_low * AVERAGING_CONSTANT
            high = high * (1 - AVERAGING_CONSTANT) + batch_high * AVERAGING_CONSTANT
        scales[kind].append(float(torch.maximum(low.abs(), high.abs()) / 448))
    return scales


def test_default_minmax_is_a_moving_average_at_most_our_global_amax(four_batches):
    """llm-compressor's default observer weighs the first batch's range by 0.99 ** (batches - 1):
    each term is at most the global amax, so its scale never exceeds ours (beyond the attention
    ulps), and it reads low wherever a later batch holds the largest value (here up to ~11%)."""
    ids, ours = four_batches
    theirs = _llm_compressor(ids, batch=4)
    replayed = _moving_average_scales(ids, batch=4)
    mine = {"k": ours.k_scale, "v": ours.v_scale}
    below = []
    for kind in ("k", "v"):
        for layer, (a, b, r) in enumerate(zip(theirs[kind], mine[kind], replayed[kind], strict=True)):
            where = f"{kind}_scale layer {layer}: llm-compressor {a}, ours {b}, replayed {r}"
            assert bf16_ulps(a, r) <= (0 if layer == 0 else ATTN_ULPS), where
            assert a <= b or bf16_ulps(a, b) <= ATTN_ULPS, where
            if bf16_ulps(a, b) > ATTN_ULPS:
                below.append(where)
    assert below  # on these batches the moving average really differs from a global amax
