"""decode_drafts (engine/speculative/draft.py), the loop every model draft runs: each step after the
first feeds the tokens the step before drew as pending ids read on the device, the host reads the
drawn tokens once after the last step, and a request's draft ends before a token drawn from
non-finite logits while the others' go on."""

from __future__ import annotations

import torch
from qruntime.engine import sampled_tokens
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.speculative.draft import DraftFor, decode_drafts
from qruntime.engine.step_chunk import StepChunk

VOCAB = 50


class Model:
    """A model whose next token after token t is (t * 7 + position) % VOCAB, read from the chunk's
    resolved ids (pending ones from `sampled`), with non-finite logits for the rows in `broken` at
    the given step; it logs each step's chunks."""

    def __init__(self, broken: dict[int, set[int]] | None = None) -> None:
        self.steps: list[tuple[list[StepChunk], torch.Tensor | None]] = []
        self.broken = broken or {}
        self.log: list[str] = []

    def __call__(self, chunks, rows, sampled):
        self.log.append("forward")
        self.steps.append((list(chunks), sampled))
        last = torch.tensor([c.token_ids[-1] for c in chunks])
        if sampled is not None:
            last = resolve_pending(last, sampled)
        positions = torch.tensor([c.start + c.num_tokens - 1 for c in chunks])
        logits = torch.randn(len(chunks), VOCAB)
        logits[torch.arange(len(chunks)), (last * 7 + positions) % VOCAB] = 100.0
        for row, i in enumerate(rows):
            if i in self.broken.get(len(self.steps) - 1, set()):
                logits[row] = float("nan")
        return logits


def _expected(token: int, position: int, k: int) -> list[int]:
    out = []
    for _ in range(k):
        token = (token * 7 + position) % VOCAB
        out.append(token)
        position += 1
    return out


def _requests(n: int) -> list[DraftFor]:
    return [DraftFor(f"r{i}", SamplingParams(), None) for i in range(n)]


def test_steps_feed_the_drawn_tokens_as_pending_ids_and_the_host_reads_them_once(monkeypatch):
    model = Model()
    original = sampled_tokens.SampledTokens.tolist

    def spy(self):
        model.log.append("read")
        return original(self)

    monkeypatch.setattr(sampled_tokens.SampledTokens, "tolist", spy)
    chunks = [StepChunk((3, 4, 9), 10, (0,)), StepChunk((11,), 5, (1,)), StepChunk((2, 8), 0, (2,))]
    ks = [4, 2, 3]
    drafts = decode_drafts(model, chunks, ks, _requests(3))
    assert [list(d.tokens) for d in drafts] == [_expected(9, 12, 4), _expected(11, 5, 2), _expected(8, 1, 3)]
    assert model.log == ["forward"] * 4 + ["read"] * 4  # every step queued before the first read
    assert model.steps[0][1] is None  # the first step's chunks are the given ones, real ids
    for chunks_after, sampled in model.steps[1:]:
        assert sampled is not None and all(t < 0 for c in chunks_after for t in c.token_ids)
        assert all(c.num_tokens == 1 for c in chunks_after)
    assert [len(step) for step, _ in model.steps] == [3, 3, 2, 1]  # requests leave once they have their k
    assert [c.start for c in model.steps[3][0]] == [15]  # request 0: its 3 tokens from 10, then 13, 14, 15


def test_a_draft_ends_before_a_token_from_non_finite_logits_and_the_others_go_on():
    model = Model(broken={1: {0}, 0: {2}})  # request 0's second token, request 2's first
    chunks = [StepChunk((5,), 3, (0,)), StepChunk((6,), 3, (1,)), StepChunk((7,), 3, (2,))]
    drafts = decode_drafts(model, chunks, [4, 4, 4], _requests(3))
    assert list(drafts[0].tokens) == _expected(5, 3, 1)
    assert list(drafts[1].tokens) == _expected(6, 3, 4)
    assert drafts[2].tokens == ()
    assert [len(step) for step, _ in model.steps] == [3, 3, 3, 3]  # the device ran on; the host dropped them


def test_sampled_requests_keep_the_distributions_of_their_tokens(rng):
    seed = rng.randrange(1 << 30)
    print("seed", seed)
    generator = torch.Generator().manual_seed(seed)
    requests = [DraftFor("g", SamplingParams(), None), DraftFor("s", SamplingParams(temperature=0.7), generator)]
    drafts = decode_drafts(Model(), [StepChunk((1,), 0, (0,)), StepChunk((2,), 0, (1,))], [3, 3], requests)
    assert drafts[0].probs is None and drafts[1].probs.shape == (3, VOCAB)
    for row, token in enumerate(drafts[1].tokens):
        assert drafts[1].probs[row, token] > 0.99  # the logit of 100 holds nearly all the mass
        assert torch.allclose(drafts[1].probs[row].sum(), torch.tensor(1.0))


class Chain:
    """A chain (decode_chains.DecodeChains.run's contract) of the Model's greedy rule, logging its calls,
    with a NaN peak at each (step, row) of `broken`; `refuse`: it gives None (cannot run them)."""

    def __init__(self, broken: set[tuple[int, int]] = frozenset(), refuse: bool = False) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []
        self.broken, self.refuse = broken, refuse

    def __call__(self, chunks, remaining, sampled):
        self.calls.append(([c.start for c in chunks], list(remaining)))
        if self.refuse:
            return None
        assert all(c.num_tokens == 1 for c in chunks) and min(remaining) >= 1
        last = resolve_pending(torch.tensor([c.token_ids[0] for c in chunks]), sampled)
        positions = torch.tensor([c.start for c in chunks])
        ids, peaks = [], []
        for step in range(max(remaining)):
            last = (last * 7 + positions) % VOCAB
            peak = torch.full((len(chunks),), 100.0)
            for row in (r for s, r in self.broken if s == step):
                peak[row] = float("nan")
            ids.append(last)
            peaks.append(peak)
            positions = positions + 1
        return torch.stack(ids), torch.stack(peaks)


def test_greedy_steps_after_the_first_are_one_chain_of_the_requests_still_drafting():
    model, chain = Model(), Chain()
    chunks = [StepChunk((3, 4, 9), 10, (0,)), StepChunk((11,), 5, (1,)), StepChunk((2, 8), 0, (2,))]
    drafts = decode_drafts(model, chunks, [4, 1, 3], _requests(3), chain)
    assert [list(d.tokens) for d in drafts] == [_expected(9, 12, 4), _expected(11, 5, 1), _expected(8, 1, 3)]
    assert len(model.steps) == 1  # the first step (what the draft's cache lacks), then the chain
    assert chain.calls == [([13, 2], [3, 2])]  # request 1 has its one token


def test_a_chained_draft_ends_before_a_non_finite_step_and_the_others_go_on():
    chain = Chain(broken={(1, 0)})  # request 0's third token
    chunks = [StepChunk((5,), 3, (0,)), StepChunk((6,), 3, (1,))]
    drafts = decode_drafts(Model(), chunks, [4, 4], _requests(2), chain)
    assert list(drafts[0].tokens) == _expected(5, 3, 2)
    assert list(drafts[1].tokens) == _expected(6, 3, 4)


def test_steps_are_not_chained_for_sampled_or_biased_requests_or_where_the_chain_cannot_run(rng):
    chunks = [StepChunk((1,), 0, (0,)), StepChunk((2,), 0, (1,))]
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    sampled = [DraftFor("g", SamplingParams(), None), DraftFor("s", SamplingParams(temperature=0.7), generator)]
    biased = [DraftFor("g", SamplingParams(), None), DraftFor("b", SamplingParams(logit_bias=((3, 1.0),)), None)]
    for requests in (sampled, biased):
        model, chain = Model(), Chain()
        decode_drafts(model, chunks, [3, 3], requests, chain)
        assert len(model.steps) == 3 and chain.calls == []
    model, chain = Model(), Chain(refuse=True)
    drafts = decode_drafts(model, chunks, [3, 2], _requests(2), chain)
    assert [list(d.tokens) for d in drafts] == [_expected(1, 0, 3), _expected(2, 0, 2)]
    assert len(model.steps) == 3 and len(chain.calls) == 2  # asked before each step after the first; stepped
