"""AWQ's scale search (qcompile.quant.awq) on a constructed linear group whose answer is known: a few
input channels carry activations ~50x the others. The search must return the grid point of least
loss (checked against an independent sweep of the grid), beat round to nearest by a clear margin
there, and never lose to it."""

from __future__ import annotations

import random

import pytest
import torch

from qcompile.quant.awq import AwqConfig, candidate_scales, fake_quantize, search_scales, weight_means
from qcompile.quant.int4 import dequantize, quantize_int4

BF16 = torch.bfloat16


def _outlier_case(rng: random.Random, outliers: int = 4):
    """x [T, K] with `outliers` loud channels, and two linears [N, K] (bf16 values) reading it."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k, t = 256, 512
    x = torch.randn(t, k, generator=gen)
    loud = torch.randperm(k, generator=gen)[:outliers]
    x[:, loud] *= 50
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(BF16).float() for n in (192, 64)]
    return x, weights


def _loss(x: torch.Tensor, weights: list[torch.Tensor]):
    reference = [x @ w.T for w in weights]

    def run(trial):
        return sum(float((x @ w.T - r).double().pow(2).sum()) for w, r in zip(trial, reference, strict=True)) / sum(
            r.numel() for r in reference
        )

    return run


def test_search_finds_the_grid_point_of_least_error_and_beats_rtn(rng):
    x, weights = _outlier_case(rng)
    run = _loss(x, weights)
    config = AwqConfig()
    x_mean = x.abs().mean(0)
    result = search_scales(x_mean, weights, [True, True], run, config, BF16)

    # the same sweep, independently: scale, round to nearest as the compile stores it, unscale
    w_mean = weight_means(weights, 128)
    sweep = {}
    for alpha, duo in config.grid():
        s = candidate_scales(x_mean, w_mean, alpha, duo)
        trial = []
        for w in weights:
            packed, scale = quantize_int4((w * s).to(BF16), 128)
            trial.append(dequantize(packed, scale, 128).float() / s)
        sweep[(alpha, duo)] = run(trial)
    best = min(sweep, key=sweep.get)
    assert (result.alpha, result.duo) == best
    assert result.error == pytest.approx(sweep[best], rel=1e-9)
    assert result.rtn_error == pytest.approx(sweep[(0.0, False)], rel=1e-9)
    assert result.alpha > 0
    assert result.error < 0.7 * result.rtn_error, (result.error, result.rtn_error)  # loud channels protected
    assert torch.isfinite(result.scales).all() and (result.scales > 0).all()


def test_search_never_does_worse_than_rtn_and_rtn_is_the_identity(rng):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(256, 128, generator=gen)  # no outliers: little to gain
    weights = [(torch.randn(96, 128, generator=gen) * 0.05).to(BF16).float()]
    run = _loss(x, weights)
    result = search_scales(x.abs().mean(0), weights, [True], run, AwqConfig(n_grid=5), BF16)
    assert result.error <= result.rtn_error
    identity = candidate_scales(x.abs().mean(0), None, 0.0, False)
    assert torch.equal(identity, torch.ones(128))
    packed, scale = quantize_int4(weights[0].to(BF16), 128)
    assert torch.equal(fake_quantize(weights[0], identity, BF16, 128), dequantize(packed, scale, 128).float())


def test_an_unquantized_linear_of_the_group_is_scaled_not_rounded(rng):
    x, weights = _outlier_case(rng)
    seen = []

    def run(trial):
        seen.append(trial[1])
        return _loss(x, weights)(trial)

    search_scales(x.abs().mean(0), weights, [True, False], run, AwqConfig(n_grid=3, duo_scaling=False), BF16)
    assert all(torch.equal(t, weights[1]) for t in seen)


def test_grid_needs_two_points():
    with pytest.raises(ValueError, match="n_grid"):
        AwqConfig(n_grid=1, duo_scaling=False)
    with pytest.raises(ValueError, match="n_grid"):
        AwqConfig(n_grid=2)  # the identity and a single duo point: no alpha spacing


def test_grid_is_awq_modifiers_default():
    """duo_scaling: the identity, then n_grid - 1 duo points spanning [0, 1] (llm-compressor's
    AWQModifier with duo_scaling=True); no plain point besides the identity."""
    grid = AwqConfig(n_grid=20).grid()
    assert len(grid) == 20 and grid[0] == (0.0, False)
    assert all(duo for _, duo in grid[1:])
    assert [a for a, _ in grid[1:]] == pytest.approx([i / 18 for i in range(19)])
    plain = AwqConfig(n_grid=5, duo_scaling=False).grid()
    assert plain == [(i / 4, False) for i in range(5)]


def test_an_unquantized_linear_leaves_the_search_of_the_others_alone(rng):
    """A MoE router in its experts' group (AWQModifier's Qwen3-MoE mapping: post_attention_layernorm
    -> router, every expert's gate/up): unquantized, it is left out of the duo form's weight means
    and never rounded, so its output is unchanged and the search picks what it picks without it."""
    x, weights = _outlier_case(rng)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    router = (torch.randn(8, x.shape[1], generator=gen) * 3).to(BF16).float()  # far larger than the experts'
    config = AwqConfig(n_grid=6)
    alone = search_scales(x.abs().mean(0), weights, [True, True], _loss(x, weights), config, BF16)
    grouped = _loss(x, [router, *weights])
    both = search_scales(x.abs().mean(0), [router, *weights], [False, True, True], grouped, config, BF16)
    assert (both.alpha, both.duo) == (alone.alpha, alone.duo)
    assert torch.equal(both.scales, alone.scales)
