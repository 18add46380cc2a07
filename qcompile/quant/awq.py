"""AWQ's scale search (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023): the math, for
one group of linears that read the same input.

Scaling input channel j of the linears by s_j and their input by 1 / s_j leaves the product
unchanged, but int4 round-to-nearest of W * s protects the channels with large activations (their
weights get more of each group's 16 levels). The scales are searched on a grid of exponents alpha:

    plain: s = mean|x|^alpha
    duo:   s = mean|x|^alpha / (mean_w^(1 - alpha) + 1e-4)   (mean_w: each column's |w| normalised
                                                              by its group's amax, averaged over rows)

each normalised by sqrt(max(s) * min(s)), and the one whose quantized linears, W_q = Q(W * s) / s,
give the output closest (mean squared error) to the unquantized one on the calibration inputs wins.
alpha = 0 (plain) is s = 1: round to nearest itself, so the search never does worse than RTN on
its own loss. The grid is llm-compressor's AWQModifier's default (duo_scaling True): the identity,
then the duo family only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qcompile.quant.int4 import dequantize, quantize_int4


@dataclass(frozen=True)
class AwqConfig:
    """The search: `n_grid` grid points (grid()), duo (with the identity) if `duo_scaling`, else plain;
    int4 groups of `group_size`."""

    n_grid: int = 20
    duo_scaling: bool = True
    group_size: int = 128

    def __post_init__(self) -> None:
        least = 3 if self.duo_scaling else 2
        if self.n_grid < least:
            raise ValueError(f"AWQ n_grid must be at least {least}, got {self.n_grid}")

    def grid(self) -> list[tuple[float, bool]]:
        """(alpha, duo) candidates, n_grid of them; the first, (0.0, False), is the identity (RTN).
        With duo_scaling, the rest are duo at alpha = i / (n_grid - 2) (AWQModifier's default grid;
        searching the plain family as well, 20 points each, gave worse held-out perplexity and KL
        on the trained fixture); without, plain at alpha = i / (n_grid - 1)."""
        if self.duo_scaling:
            return [(0.0, False)] + [(i / (self.n_grid - 2), True) for i in range(self.n_grid - 1)]
        return [(i / (self.n_grid - 1), False) for i in range(self.n_grid)]


@dataclass(frozen=True)
class SearchResult:
    """The chosen scales [K] and how they were found."""

    scales: torch.Tensor
    alpha: float
    duo: bool
    rtn_error: float  # the loss at s = 1 (round to nearest)
    error: float  # the loss at the chosen scales

    def to_dict(self) -> dict:
        return {
            "alpha": round(self.alpha, 6),
            "duo": self.duo,
            "rtn_error": self.rtn_error,
            "error": self.error,
        }


def weight_means(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """Each input column's |w| / (its group's amax + 1e-6), averaged over the rows of all `weights` [K]."""
    total, rows = None, 0
    for w in weights:
        g = w.float().abs().reshape(w.shape[0], -1, group_size)
        g = (g / (g.amax(-1, keepdim=True) + 1e-6)).reshape(w.shape)
        total = g.sum(0) if total is None else total + g.sum(0)
        rows += w.shape[0]
    assert total is not None
    return total / rows


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float, duo: bool) -> torch.Tensor:
    """The scales [K] of one grid point (module docstring), fp32, finite and positive."""
    if duo:
        assert w_mean is not None
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(alpha).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def fake_quantize(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Q(W * s) / s in fp32: W * s rounded to `dtype` (what the artifact's source then holds), quantized
    to int4 exactly as the compile does it, dequantized, then divided by s."""
    scaled = (w.float() * scales).to(dtype)
    packed, group_scales = quantize_int4(scaled, group_size)
    return dequantize(packed, group_scales, group_size).float() / scales


def search_scales(
    x_mean: torch.Tensor,
    weights: Sequence[torch.Tensor],
    quantized: Sequence[bool],
    run: Callable[[Sequence[torch.Tensor]], float],
    config: AwqConfig,
    dtype: torch.dtype,
) -> SearchResult:
    """The grid point whose fake-quantized `weights` minimise `run(weights) -> loss`.

    x_mean [K]: mean |x| of the linears' common input per channel. weights: their [N_i, K] weights
    (the model's); quantized[i] False: a linear the recipe leaves unquantized (the MoE router):
    never rounded, and left out of the duo form's weight means, as AWQModifier leaves out a layer
    with no quantization scheme.
    run: the loss of the parent module with these weights in place of the linears'."""
    w_mean = weight_means([w for w, q in zip(weights, quantized, strict=True) if q], config.group_size)
    best: SearchResult | None = None
    rtn_error = float("nan")
    for alpha, duo in config.grid():
        s = candidate_scales(x_mean.float(), w_mean, alpha, duo)
        trial = [
            fake_quantize(w, s, dtype, config.group_size) if q else w.float()
            for w, q in zip(weights, quantized, strict=True)
        ]
        loss = run(trial)
        if alpha == 0 and not duo:
            rtn_error = loss
        if loss == loss and (best is None or loss < best.error):  # NaN losses never win
            best = SearchResult(s, alpha, duo, rtn_error, loss)
    if best is None:
        raise ValueError("every AWQ grid point gave a NaN loss")
    return SearchResult(best.scales, best.alpha, best.duo, rtn_error, best.error)
