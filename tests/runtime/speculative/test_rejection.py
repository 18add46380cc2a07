"""Speculative verification (engine/speculative/rejection.py, verify_step.py): the tokens a request
keeps from a verified step follow the target's distribution, whatever the draft proposed.

Each statistical test draws ROWS i.i.d. verifications of one request in a single batched call (one
shared generator), and compares the emitted tokens with the target's p_j, computed here from the
logits in float64 (softmax of logits / temperature, then top-k, then top-p), by a chi-square test at
P_FLOOR: a correct implementation fails about once in a million runs, while a real bug (accepting
with p instead of min(1, p / q), a residual that keeps q, a forgotten temperature or cut) gives
p-values far below it.
"""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.engine.sampler import sample
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.speculative.rejection import Verdicts, verify_drafts
from qruntime.engine.speculative.verify_step import VerifyStep, draft_logit_rows
from scipy.stats import binomtest, chisquare

ROWS = 20_000
P_FLOOR = 1e-6
MIN_EXPECTED = 5.0  # categories expected fewer times are pooled (the chi-square approximation needs it)


def _generator(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(1 << 62))


def _target(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's distribution of one logits row [V], float64, written out independently of the sampler."""
    probs = (logits.double() / temperature).softmax(-1)
    if 0 < top_k < len(probs):
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]  # mass of the tokens ranked above each
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[before < top_p]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _top_p_margin(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> float:
    """How far top_p is from every cumulative mass it is compared with (fp32 vs fp64 must agree)."""
    probs = _target(logits, temperature, top_k)
    ordered = probs.sort(descending=True).values
    return float(((ordered.cumsum(0) - ordered) - top_p).abs().min())


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """tokens [n] are i.i.d. draws of probs [V]: no token of probability 0, and the counts pass a
    chi-square test (categories expected fewer than MIN_EXPECTED times pooled)."""
    assert tokens.numel() > 0, what
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, (
        f"{what}: tokens of probability 0 drawn: {counts.tolist()} vs {probs.tolist()}"
    )
    expected = probs * tokens.numel()
    small = (expected < MIN_EXPECTED) & (probs > 0)
    big = expected >= MIN_EXPECTED
    obs, exp = counts[big].tolist(), expected[big].tolist()
    if small.any():
        obs.append(float(counts[small].sum()))
        exp.append(float(expected[small].sum()))
    if len(obs) < 2:
        return  # everything in one category: nothing left to test (the zero-probability check above held)
    pvalue = chisquare(obs, exp).pvalue
    assert pvalue > P_FLOOR, f"{what}: p-value {pvalue:.3g}; counts {counts.tolist()}, expected {expected.tolist()}"


def assert_rate(hits: int, trials: int, rate: float, what: str) -> None:
    pvalue = binomtest(hits, trials, rate).pvalue
    assert pvalue > P_FLOOR, f"{what}: {hits}/{trials} vs rate {rate:.4f} (p-value {pvalue:.3g})"


# the sampling parameters the statistical tests run under (top_p is chosen per test, away from the edges)
KINDS = {
    "plain": {"temperature": 1.0},
    "cold-top-k": {"temperature": 0.6, "top_k": 3},
    "hot-top-k-top-p": {"temperature": 1.8, "top_k": 5, "top_p": None},
}


def _setup(rng: random.Random, kind: str, rows_of_logits: int) -> tuple[torch.Tensor, SamplingParams, list]:
    """Fresh logits [rows, V] (V 5..8) and the kind's SamplingParams, with their target distributions."""
    vocab = rng.randint(5, 8)
    options = dict(KINDS[kind])
    while True:
        logits = torch.tensor([[rng.gauss(0, 1.5) for _ in range(vocab)] for _ in range(rows_of_logits)])
        if "top_p" in KINDS[kind]:
            options["top_p"] = round(rng.uniform(0.5, 0.9), 3)
        t, k, p = options["temperature"], options.get("top_k", 0), options.get("top_p", 1.0)
        if p == 1.0 or all(_top_p_margin(row, t, k, p) > 1e-3 for row in logits):
            break
    params = SamplingParams(**options)
    return logits, params, [_target(row, t, k, p) for row in logits]


def _random_q(rng: random.Random, p: torch.Tensor) -> torch.Tensor:
    """A draft distribution unlike the target p: mostly its own random logits (some token it never
    proposes, mass on tokens p cuts), a third p (so that later drafts are reached often enough)."""
    own = torch.tensor([rng.gauss(0, 2.0) for _ in range(len(p))]).softmax(-1)
    own[rng.randrange(len(p))] = 0.0
    return (0.35 * p + 0.65 * own.double() / own.sum()).float()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("draft", ["point-mass", "distribution"])
def test_kept_tokens_follow_the_target(rng, kind, k, draft):
    """The first token kept is p_1-distributed, the token after an accepted draft j is p_{j+1}'s
    (a replacement, the next draft, or the bonus sampled after all k), and the first draft is
    accepted with probability sum(min(p_1, q_1)) (p_1(d_1) for a point mass)."""
    logits, params, p = _setup(rng, kind, k + 1)  # rows 0..k-1 verify, row k gives the bonus
    vocab = logits.shape[1]
    gen = _generator(rng)
    if draft == "point-mass":
        # one likely token per position (so that later positions are reached often), the same in every row
        guess = [rng.choice([int(pj.argmax()), *(t for t in range(vocab) if pj[t] > 0.2)]) for pj in p[:k]]
        drafts = [guess] * ROWS
        q, accept_first = None, float(p[0][guess[0]])
    else:
        qs = [_random_q(rng, pj) for pj in p[:k]]
        drawn = torch.stack([torch.multinomial(qj, ROWS, replacement=True, generator=gen) for qj in qs], 1)
        drafts = drawn.tolist()  # each row's drafts drawn from q, as a draft model would
        q = torch.stack(qs)[None].expand(ROWS, k, vocab)
        accept_first = float(torch.minimum(p[0], qs[0].double()).sum())
    verdicts = verify_drafts(logits[:k].expand(ROWS, k, vocab), drafts, [params] * ROWS, [gen] * ROWS, q)
    bonus = sample(logits[k].expand(ROWS, vocab), [params] * ROWS, [gen] * ROWS)
    kept = VerifyStep(tuple(range(ROWS)), tuple(map(tuple, drafts)), verdicts).kept(bonus)

    accepted = verdicts.accepted.tolist()
    assert bool(verdicts.finite.all())
    for row in range(ROWS):
        assert 0 <= accepted[row] <= k and kept[row] == [*drafts[row][: accepted[row]], kept[row][-1]], row
    runs = list(kept.values())
    assert_rate(sum(a >= 1 for a in accepted), ROWS, accept_first, "first draft accepted")
    for j in range(k + 1):  # token j + 1, among the rows whose first j drafts were accepted
        tokens = torch.tensor([run[j] for run, a in zip(runs, accepted, strict=True) if a >= j], dtype=torch.int64)
        assert_follows(tokens, p[j], f"token {j + 1} kept ({kind}, {draft}, k={k})")


def _row_argmax_drafts(rng: random.Random, logits: torch.Tensor, k: int) -> tuple[list[int], int]:
    """Drafts matching logits' argmax for a random number m of positions, then not: (drafts, m)."""
    m = rng.randint(0, k)
    best = logits[:k].argmax(-1).tolist()
    drafts = best[:m] + [(b + rng.randrange(1, logits.shape[1])) % logits.shape[1] for b in best[m:]]
    return drafts, m


def test_greedy_rows_accept_while_the_argmax_matches_beside_sampled_rows(rng):
    """Greedy rows: accepted = the drafts equal to their row's argmax before the first that is not,
    replaced by that row's argmax (plain greedy decoding's tokens). Sampled rows in the same call
    keep their distribution (greedy rows shuffled among them)."""
    vocab, width = 7, 3
    greedy_count = 2000
    sampled_logits = torch.tensor([[rng.gauss(0, 1.5) for _ in range(vocab)] for _ in range(width)])
    p_first = _target(sampled_logits[0], 0.9)
    kinds = ["greedy"] * greedy_count + ["sampled"] * ROWS
    rng.shuffle(kinds)
    logits = torch.empty(len(kinds), width, vocab)
    drafts, expected, params = [], [], []
    gen = _generator(rng)
    for row, kind in enumerate(kinds):
        if kind == "greedy":
            k = rng.randint(1, width)
            logits[row] = torch.tensor([[rng.gauss(0, 3) for _ in range(vocab)] for _ in range(width)])
            d, m = _row_argmax_drafts(rng, logits[row], k)
            drafts.append(d)
            expected.append((m, int(logits[row, m].argmax()) if m < k else None))
            params.append(SamplingParams(temperature=0.0))
        else:
            logits[row] = sampled_logits
            drafts.append([int(sampled_logits[0].argmax())])
            expected.append(None)
            params.append(SamplingParams(temperature=0.9))
    gens = [None if p.greedy else gen for p in params]
    verdicts = verify_drafts(logits, drafts, params, gens)
    accepted, replacement = verdicts.accepted.tolist(), verdicts.replacement.tolist()
    first = []
    for row, want in enumerate(expected):
        if want is None:  # sampled: its first kept token
            first.append(drafts[row][0] if accepted[row] else replacement[row])
            continue
        m, token = want
        assert accepted[row] == m, (row, drafts[row], logits[row].argmax(-1).tolist())
        if token is not None:
            assert replacement[row] == token, row
    assert_follows(torch.tensor(first), p_first, "sampled rows among greedy ones")
    hits = sum(a for a, want in zip(accepted, expected, strict=True) if want is None)
    assert_rate(hits, ROWS, float(p_first.max()), "sampled rows' drafts accepted")


def test_rows_of_different_k_ignore_their_padding(rng):
    """Requests with 1 and 3 drafts in one call: the padded rows (garbage logits, NaN included, that
    would accept the padded draft token 0) never count; each request's tokens keep p_j."""
    width = 3
    logits_row, params, p = _setup(rng, "cold-top-k", width)
    gen = _generator(rng)
    ks = [rng.choice([1, width]) for _ in range(ROWS)]
    guess = [int(pj.argmax()) for pj in p]
    vocab = logits_row.shape[1]
    garbage = torch.full((vocab,), -30.0)
    garbage[0] = 30.0  # the padded "draft" is token 0, certain under these logits
    logits = logits_row[None].repeat(ROWS, 1, 1)
    short = torch.tensor([k == 1 for k in ks])
    logits[short, 1] = garbage
    logits[short, 2] = float("nan")
    drafts = [guess[:k] for k in ks]
    verdicts = verify_drafts(logits, drafts, [params] * ROWS, [gen] * ROWS)
    assert bool(verdicts.finite.all())
    accepted, replacement = verdicts.accepted.tolist(), verdicts.replacement.tolist()
    assert all(a <= k for a, k in zip(accepted, ks, strict=True))
    for k in (1, width):
        mine = [r for r in range(ROWS) if ks[r] == k]
        first = [guess[0] if accepted[r] else replacement[r] for r in mine]
        assert_follows(torch.tensor(first), p[0], f"first token, k={k}")
        assert_rate(sum(accepted[r] >= 1 for r in mine), len(mine), float(p[0][guess[0]]), f"accepted, k={k}")
    # with greedy rows too: a short row whose padding would match the argmax accepts only its own drafts
    greedy = [SamplingParams()] * 4
    g_logits = torch.randn(4, width, vocab, generator=gen)
    g_drafts = [[int(g_logits[b, 0].argmax())] for b in range(4)]
    g_logits[:, 1:, :] = garbage  # argmax 0 = the padding token
    assert verify_drafts(g_logits, g_drafts, greedy, [None] * 4).accepted.tolist() == [1] * 4


def test_non_finite_verified_rows_are_flagged_and_kept_is_none(rng):
    vocab, width = 6, 2
    gen = _generator(rng)
    logits = torch.randn(7, width, vocab, generator=gen)
    logits[1, 0, 3] = float("nan")
    logits[2, 1, 0] = float("inf")
    logits[3, 1] = float("-inf")  # nothing left to choose from
    logits[4, 0, 2] = float("-inf")  # a masked token beside finite ones is fine
    logits[5, 1] = float("nan")  # padding of a one-draft request: ignored
    logits[6, 0, 5] = float("nan")  # a greedy row
    drafts = [[1, 2], [1, 2], [1, 2], [1, 2], [1, 2], [4], [1, 2]]
    params = [SamplingParams(temperature=1.0)] * 6 + [SamplingParams()]
    verdicts = verify_drafts(logits, drafts, params, [gen] * 6 + [None])
    assert verdicts.finite.tolist() == [True, False, False, False, True, True, False]
    kept = VerifyStep(tuple(range(7)), tuple(map(tuple, drafts)), verdicts).kept([9] * 7)
    assert [kept[r] is None for r in range(7)] == [False, True, True, True, False, False, True]


def test_bad_drafts_are_refused():
    logits = torch.randn(2, 3, 5)
    params, gens = [SamplingParams()] * 2, [None] * 2
    for drafts in ([[1, 2, 3, 4], [1]], [[1]], [[1], [2], [3]], [[], [1]]):
        with pytest.raises(ValueError, match="drafts of lengths"):
            verify_drafts(logits, drafts, params, gens)


def test_draft_logit_rows_point_at_the_token_before_each_draft(rng):
    """In a random step of chunks laid end to end (prefills without drafts among them), the row
    draft_logit_rows gives for draft j of a request is the position of the token just before it;
    the padding repeats the request's last such row."""
    for _ in range(200):
        flat: list[tuple[str, int]] = []  # (what, index) of every position of the step
        ends, drafts = [], []
        for b in range(rng.randint(1, 6)):
            for i in range(rng.randint(0, 5)):
                flat.append(("prefill", i))
            k = rng.randint(1, 5)
            flat.append((f"last {b}", 0))
            for j in range(1, k + 1):
                flat.append((f"draft {b}", j))
            ends.append(len(flat))
            drafts.append([rng.randrange(100) for _ in range(k)])
        rows = draft_logit_rows(ends, drafts)
        width = max(len(d) for d in drafts)
        assert all(len(r) == width for r in rows)
        for b, (r, d) in enumerate(zip(rows, drafts, strict=True)):
            for j in range(width):
                want = (f"last {b}", 0) if min(j, len(d) - 1) == 0 else (f"draft {b}", min(j, len(d) - 1))
                assert flat[r[j]] == want, (b, j, ends, drafts)
    assert draft_logit_rows([4, 6], [[7, 8, 9], [5]]) == [[0, 1, 2], [4, 4, 4]]


def _verdicts(accepted: list[int], replacement: list[int], finite: list[bool]) -> Verdicts:
    return Verdicts(torch.tensor(accepted), torch.tensor(replacement), torch.tensor(finite))


def test_kept_is_accepted_drafts_then_the_replacement_or_the_bonus():
    step = VerifyStep(
        rows=(1, 3, 4, 6, 7),
        drafts=((10, 11, 12), (20, 21), (30,), (40, 41), (50,)),
        verdicts=_verdicts([3, 1, 0, 2, 1], [99, 98, 97, 96, 95], [True, True, True, False, True]),
    )
    bonus = [0, 101, 0, 103, 104, 0, 106, None]
    assert step.kept(bonus) == {
        1: [10, 11, 12, 101],  # all accepted: the step's own token of that row
        3: [20, 98],  # the first rejected draft replaced
        4: [97],
        6: None,  # a verified row was not finite
        7: None,  # the row's own token was not finite
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_calls_accept_the_leading_argmax_matches(rng, dtype):
    """A call of greedy rows alone (its own path, fewer device ops): accepted = the drafts equal to
    their row's argmax before the first that is not, the replacement that row's argmax, ties going to
    the first index as torch's argmax; padding rows (any logits, NaN included) never count and a
    verified row's non-finite logits are flagged. Checked against a per-row Python reading."""
    gen = _generator(rng)
    vocab, width, batch = 9, 4, 64
    logits = torch.randn(batch, width, vocab, generator=gen).to(dtype)
    logits[rng.randrange(batch), rng.randrange(width), :3] = 5.0  # a three-way tie at the top
    drafts, flagged = [], []
    for b in range(batch):
        k = rng.randint(1, width)
        d, _ = _row_argmax_drafts(rng, logits[b].float(), k)
        drafts.append(d)
        if rng.random() < 0.2:  # padding past k: never read
            logits[b, k:] = float("nan")
        bad = rng.random() < 0.1
        if bad:
            logits[b, rng.randrange(k), rng.randrange(vocab)] = rng.choice([float("nan"), float("inf")])
        flagged.append(bad)
    verdicts = verify_drafts(logits, drafts, [SamplingParams()] * batch, [None] * batch)
    accepted, replacement = verdicts.accepted.tolist(), verdicts.replacement.tolist()
    for b, d in enumerate(drafts):
        best = [int(torch.argmax(logits[b, j].float())) for j in range(len(d))]
        m = next((j for j, (t, a) in enumerate(zip(d, best, strict=True)) if t != a), len(d))
        assert accepted[b] == m, (b, d, best)
        if m < len(d):
            assert replacement[b] == best[m], b
    assert verdicts.finite.tolist() == [not bad for bad in flagged]
