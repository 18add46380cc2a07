"""Sampling: frequencies follow softmax(logits / temperature) restricted to the top-k / top-p set,
greedy is argmax, and SamplingParams refuses bad values with a message naming them."""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.engine.sampler import sample
from qruntime.engine.sampling_params import SAMPLING_EPS, InvalidSamplingParams, SamplingParams

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
        ({"max_tokens": 0}, "max_tokens must be ≥ 1 (got 0)"),
        ({"max_tokens": -3}, "max_tokens must be ≥ 1 (got -3)"),
        ({"max_tokens": True}, "max_tokens must be an integer (got True)"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer (got 2.5)"),
        ({"temperature": -0.1}, "temperature must be finite and ≥ 0 (got -0.1)"),
        ({"temperature": float("inf")}, "temperature must be finite and ≥ 0 (got inf)"),
        ({"temperature": float("nan")}, "temperature must be finite and ≥ 0 (got nan)"),
        ({"temperature": "0.5"}, "temperature must be a number (got '0.5')"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1] (got nan)"),
        ({"top_k": -1}, "top_k must be ≥ 0 (got -1)"),
        ({"top_k": 1.0}, "top_k must be an integer (got 1.0)"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (got 0.0)"),
        ({"top_p": 1.5}, "top_p must be in (0, 1] (got 1.5)"),
        ({"seed": -1}, "seed must be ≥ 0 and < 2**64 (got -1)"),
        ({"seed": 1 << 64}, f"seed must be ≥ 0 and < 2**64 (got {1 << 64})"),  # torch.Generator's limit
        ({"seed": "7"}, "seed must be an integer (got '7')"),
        ({"stop": ("",)}, "stop[0] must be a non-empty string (got '')"),
        ({"stop": ("ok", 3)}, "stop[1] must be a string (got 3)"),
        ({"stop_token_ids": (-2,)}, "stop_token_ids[0] must be ≥ 0 (got -2)"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, message):
    with pytest.raises(InvalidSamplingParams) as caught:  # a ValueError, as before
        SamplingParams(**kwargs)
    assert isinstance(caught.value, ValueError) and str(caught.value) == f"invalid SamplingParams: {message}"
    assert [p.field for p in caught.value.problems] == list(kwargs)


def test_every_bad_field_is_named_at_once():
    with pytest.raises(InvalidSamplingParams) as caught:
        SamplingParams(max_tokens=0, top_p=2.0, seed=-1)
    assert [p.field for p in caught.value.problems] == ["max_tokens", "top_p", "seed"]
    assert str(caught.value).count(";") == 2


def test_edges_of_the_ranges_are_accepted():
    SamplingParams(max_tokens=1, temperature=0, top_k=0, top_p=1.0, seed=0)
    SamplingParams(seed=(1 << 64) - 1, top_p=1e-9, temperature=1e9, stop=("x",), stop_token_ids=(0,))


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)


# every value the server's validator accepts, at its extremes: tiny and huge temperatures, top_p far
# below fp32's smallest number, logits spread as wide as bf16 holds
EXTREME_TEMPERATURES = (5e-324, 1e-300, 1e-38, SAMPLING_EPS / 2, SAMPLING_EPS, 1e-4, 1e-2, 1e30, 1.7e308)
EXTREME_TOP_P = (5e-324, 1e-300, 1e-46, 1e-8, 0.5, 1.0)
# the sampler runs where the logits are: on a GPU machine these tests run there too
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _wide_logits(rng: random.Random, rows: int, vocab: int, device: str) -> torch.Tensor:
    scale = rng.choice([1.0, 1e3, 1e4, 3e38])  # 3e38: near the largest bf16 / fp32 values
    logits = (torch.rand(rows, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 2 - 1) * scale
    return logits.to(device, rng.choice([torch.float32, torch.bfloat16]))


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_sampling_values_never_fail_and_tiny_ones_are_greedy(device):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(40):
        logits = _wide_logits(rng, 3, rng.randrange(2, 300), device)
        params = [
            SamplingParams(
                temperature=rng.choice(EXTREME_TEMPERATURES),
                top_p=rng.choice(EXTREME_TOP_P),
                top_k=rng.choice([0, 1, 2, 10**9]),
            )
            for _ in range(3)
        ]
        gens = [torch.Generator(device).manual_seed(rng.randrange(1 << 30)) for _ in range(3)]
        tokens = sample(logits, params, gens)
        argmax = logits.float().argmax(-1).tolist()
        for token, p, best, row in zip(tokens, params, argmax, logits.float(), strict=True):
            assert token is not None and 0 <= token < logits.shape[1], (p, token)
            if p.temperature < SAMPLING_EPS or p.top_k == 1 or p.top_p < 1e-8:
                assert row[token] == row[best], (p, token, best)  # greedy: the best token (or one tied with it)


@pytest.mark.parametrize("device", DEVICES)
def test_a_top_p_that_rounds_to_zero_keeps_the_best_token(device):
    logits = torch.randn(4, 50, device=device)
    gens = [torch.Generator(device).manual_seed(i) for i in range(4)]
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-300)] * 4, gens) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_row_is_none_and_the_others_are_sampled(device):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    torch.manual_seed(seed)
    logits = torch.randn(6, 30).to(device)
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    logits[4, 0] = float("-inf")  # a masked token is fine
    logits[5] = float("-inf")  # nothing left to choose from
    params = [SamplingParams(temperature=t) for t in (0.0, 0.8, 0.0, 1.0, 0.9, 0.0)]
    gens = [None if p.greedy else torch.Generator(device).manual_seed(i) for i, p in enumerate(params)]
    tokens = sample(logits, params, gens)
    assert tokens[1] is None and tokens[3] is None and tokens[5] is None
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[4] is not None and tokens[4] != 0


def test_a_mixed_batch_samples_each_row_from_its_own_distribution(rng):
    """Greedy rows and rows of different temperature / top_k / top_p in one batch (the sampler's
    batched path): each row's frequencies follow its own params."""
    vocab, draws = 12, 3000
    logits = torch.tensor([rng.gauss(0, 2) for _ in range(vocab)])
    kinds = [
        (SamplingParams(), None),
        (SamplingParams(temperature=0.7), torch.ones(vocab)),
        (SamplingParams(temperature=1.0, top_k=3), None),
        (SamplingParams(temperature=1.0, top_p=0.5), None),
        (SamplingParams(temperature=2.0), torch.ones(vocab)),
        (SamplingParams(temperature=1.0, top_k=6), None),
    ]
    order = [i for i in range(len(kinds)) for _ in range(draws)]
    rng.shuffle(order)  # the rows of each kind spread over the batch
    gens = [torch.Generator().manual_seed(rng.randrange(1 << 30)) for _ in kinds]
    params = [kinds[i][0] for i in order]
    tokens = torch.tensor(sample(logits.expand(len(order), -1), params, [gens[i] for i in order]))
    kind_of = torch.tensor(order)
    probs = logits.softmax(-1)
    ranked = probs.argsort(descending=True)
    top3 = torch.zeros(vocab)
    top3[ranked[:3]] = 1
    top6 = torch.zeros(vocab)
    top6[ranked[:6]] = 1
    nucleus = torch.zeros(vocab)
    nucleus[ranked[(probs[ranked].cumsum(0) - probs[ranked]) < 0.5]] = 1
    for i, (p, _) in enumerate(kinds):
        got = torch.bincount(tokens[kind_of == i], minlength=vocab).float() / draws
        if p.greedy:
            assert got[int(logits.argmax())] == 1.0
            continue
        keep = {2: top3, 3: nucleus, 5: top6}.get(i, torch.ones(vocab))
        assert torch.all(got[keep == 0] == 0), i
        assert torch.allclose(got, _expected(logits, p.temperature, keep), atol=0.04), i


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch(device, rng):
    vocab = rng.randrange(20, 400)
    for _ in range(30):
        n = rng.randrange(2, 9)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).to(device)
        params = [
            SamplingParams(
                temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8])
            )
            for _ in range(n)
        ]
        seeds = [rng.randrange(1 << 30) for _ in range(n)]
        batch = sample(logits, params, [torch.Generator(device).manual_seed(s) for s in seeds])
        alone = [
            sample(logits[i : i + 1], [params[i]], [torch.Generator(device).manual_seed(seeds[i])])[0] for i in range(n)
        ]
        assert batch == alone


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_min_p_keeps_the_tokens_within_min_p_of_the_likeliest(temperature):
    logits = torch.randn(12) * 2
    probs = (logits / temperature).softmax(-1)
    min_p = float(torch.empty(()).uniform_(0.05, 0.4))
    keep = (probs >= min_p * probs.max()).float()
    assert 1 <= keep.sum() < 12 or min_p * probs.max() <= probs.min()
    got = _frequencies(logits, SamplingParams(temperature=temperature, min_p=min_p))
    assert torch.all(got[keep == 0] == 0)
    assert torch.allclose(got, _expected(logits, temperature, keep), atol=0.03)


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = torch.randn(3, 40)
    best, second = logits.topk(2, dim=-1).indices.unbind(-1)
    favoured = [int((b + 1 + torch.randint(0, 38, ())) % 40) for b in best]  # any token but the best
    params = [
        SamplingParams(logit_bias={favoured[0]: float(logits[0].max() - logits[0, favoured[0]]) + 0.5}),
        SamplingParams(logit_bias={int(best[1]): -100.0}),
        SamplingParams(logit_bias={int(best[2]): -0.0}),
    ]
    before = logits.clone()
    assert sample(logits, params, [None] * 3) == [favoured[0], int(second[1]), int(best[2])]
    assert torch.equal(logits, before)  # biased on a copy: the caller's logits (a graph's output) stay
    bias = torch.randn(12)
    row = torch.randn(12) * 2
    got = _frequencies(row, SamplingParams(temperature=1.0, logit_bias={i: float(b) for i, b in enumerate(bias)}))
    assert torch.allclose(got, _expected(row + bias, 1.0, torch.ones(12)), atol=0.03)


def test_banned_tokens_are_never_sampled():
    logits = torch.randn(4, 30)
    best = logits.argmax(-1).tolist()
    banned = [[best[0]], [], [best[2], 5], list(range(29))]
    params = [SamplingParams()] * 3 + [SamplingParams(temperature=1.0)]
    got = sample(logits, params, [None] * 3 + [torch.Generator().manual_seed(1)], banned)
    masked = logits.clone()
    for r, tokens in enumerate(banned[:3]):
        masked[r, tokens] = float("-inf")
    assert got[:3] == masked[:3].argmax(-1).tolist() and got[3] == 29
    row = torch.randn(12) * 2
    generator = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    drawn = sample(row.expand(DRAWS, -1), [SamplingParams(temperature=1.0)] * DRAWS, [generator] * DRAWS, [[3, 7]] * DRAWS)
    keep = torch.ones(12)
    keep[[3, 7]] = 0
    got = torch.bincount(torch.tensor(drawn), minlength=12).float() / DRAWS
    assert got[3] == got[7] == 0 and torch.allclose(got, _expected(row, 1.0, keep), atol=0.03)


def _penalized_reference(logits, params, histories, in_flight):
    """Row by row, in plain Python over the vocabulary: OpenAI's presence / frequency and HF's repetition penalty."""
    out = logits.clone()
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        if h is None:
            continue
        outputs = list(h.outputs) + ([int(in_flight[h.in_flight_row])] if h.in_flight_row is not None else [])
        for token in range(logits.shape[1]):
            value = float(logits[row, token])
            if token in outputs or token in h.prompt:
                if p.repetition_penalty != 1:
                    value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = outputs.count(token)
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            out[row, token] = value
    return out


def test_penalties_follow_their_definitions_with_outputs_in_flight(rng):
    from qruntime.engine.sampler import History, penalized

    vocab, n = 30, 6
    logits = torch.randn(n, vocab) * 3
    in_flight = torch.randint(0, vocab, (4,))
    params, histories = [], []
    for row in range(n):
        if row == 0:
            params.append(SamplingParams())  # no penalty: left as it is
            histories.append(None)
            continue
        params.append(
            SamplingParams(
                presence_penalty=rng.uniform(-2, 2) if rng.random() < 0.7 else 0.0,
                frequency_penalty=rng.uniform(-2, 2) if rng.random() < 0.7 else 0.0,
                repetition_penalty=rng.uniform(0.5, 3) if rng.random() < 0.7 else 1.0,
            )
        )
        histories.append(
            History(
                [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))],
                [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))],
                rng.choice([None, rng.randrange(4)]),
            )
        )
    expected = _penalized_reference(logits, params, histories, in_flight)
    got = penalized(logits.clone(), params, histories, in_flight)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-6)
    assert torch.equal(got[0], logits[0])
    greedy = sample(logits, [SamplingParams(**{**p.__dict__, "temperature": 0.0}) for p in params], [None] * n,
                    histories=histories, in_flight=in_flight)  # fmt: skip
    assert greedy == expected.argmax(-1).tolist()
