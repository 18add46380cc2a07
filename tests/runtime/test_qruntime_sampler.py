"""Sampling: frequencies follow softmax(logits / temperature) restricted to the top-k / top-p set,
greedy is argmax, and SamplingParams refuses bad values with a message naming them."""

from __future__ import annotations

import pytest
import torch
from qruntime.engine.sampler import sample
from qruntime.engine.sampling_params import SamplingParams

DRAWS = 6000


def _frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    tokens = sample(logits.expand(DRAWS, -1), [params] * DRAWS, [generator] * DRAWS)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).float() / DRAWS


def _expected(logits: torch.Tensor, temperature: float, keep: torch.Tensor) -> torch.Tensor:
    probs = (logits / temperature).softmax(-1) * keep
    return probs / probs.sum()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature):
    logits = torch.randn(12) * 2
    got = _frequencies(logits, SamplingParams(temperature=temperature))
    # 6000 draws: each frequency within ~4 standard deviations (<= 0.026) of its probability
    assert torch.allclose(got, _expected(logits, temperature, torch.ones(12)), atol=0.03)


def test_top_k_keeps_the_k_most_likely():
    logits = torch.randn(12) * 2
    keep = torch.zeros(12)
    keep[logits.topk(4).indices] = 1
    got = _frequencies(logits, SamplingParams(temperature=1.0, top_k=4))
    assert torch.all(got[keep == 0] == 0)
    assert torch.allclose(got, _expected(logits, 1.0, keep), atol=0.03)


def test_top_p_keeps_the_smallest_set_holding_p():
    logits = torch.randn(12) * 2
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    keep = torch.zeros(12)
    keep[order[mass_before < 0.6]] = 1
    got = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert torch.all(got[keep == 0] == 0) and keep.sum() < 12
    assert torch.allclose(got, _expected(logits, 1.0, keep), atol=0.03)


def test_greedy_is_argmax_and_ignores_generators():
    logits = torch.randn(5, 40)
    assert sample(logits, [SamplingParams()] * 5, [None] * 5) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": -3}, "max_tokens must be a positive integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"stop": ("",)}, "stop strings must be non-empty strings"),
        ({"stop_token_ids": (-2,)}, "stop_token_ids must be non-negative integers"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
