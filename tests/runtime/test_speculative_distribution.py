"""End to end through the engine: sampled tokens that came out of a verification have the target's
distribution. A 288-token model, top_k 8 at temperature 1; 1200 seeded requests of one prompt, each
generating 3 tokens, so the second token is verified against one draft token (accepted, or replaced
from the residual). Its empirical distribution must match P(t2) = sum_t1 p(t1) p(t2 | t1), computed
by scoring the prompt and each possible first token (chi-square, p >= 1e-6).

1200 draws still fail a broken verifier by a wide margin (measured at 1000 draws, layer-skip, fresh
prompts): accepting every draft gives p 1e-21..1e-25 or tokens outside the top-k sets; drawing the
replacement from p instead of max(p - q, 0) gives p 3e-16..1e-30; drawing it from q, or accepting
with min(1, q / p), gives tokens outside the top-k sets (in both methods). The draft-model case's
acceptance is ~1.5%, so there it mostly proves the residual draw against an unrelated q."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime import SamplingParams, SpeculativeConfig
from scipy import stats

VOCAB, TOP_K, DRAWS = 288, 8, 1200
SMALL_VOCAB = {"vocab_size": VOCAB, "bos_token_id": 260, "eos_token_id": 262}


@pytest.fixture(scope="module")
def target(make_ckpt, compiled):
    return compiled(make_ckpt("tiny", **SMALL_VOCAB), "bf16")


@pytest.fixture(scope="module")
def other_draft(make_ckpt, compiled):
    return compiled(make_ckpt("tiny", seed=5, num_hidden_layers=1, **SMALL_VOCAB), "bf16")


def _top_k(logits: torch.Tensor) -> torch.Tensor:
    """The sampling distribution [V] of fp32 logits [V] under top_k = TOP_K, temperature 1 (float64)."""
    top = logits.double().topk(TOP_K)
    p = torch.zeros(logits.shape[-1], dtype=torch.float64)
    p[top.indices] = torch.softmax(top.values, 0)
    return p


@pytest.mark.parametrize("method", ["draft-model", "layer-skip"])
def test_the_verified_token_has_the_target_distribution(target, other_draft, rng, method):
    config = (
        SpeculativeConfig("draft-model", draft_model=str(other_draft), num_tokens=2, adaptive=False)
        if method == "draft-model"
        else SpeculativeConfig("layer-skip", skip_layers=(1,), num_tokens=2, adaptive=False)
    )
    engine = qruntime.load(
        target, device="cpu", dtype=torch.float32, max_num_seqs=256, num_kv_blocks=512, speculative=config
    )
    prompt = [rng.randrange(250) for _ in range(rng.randrange(3, 12))]
    seed = rng.randrange(1 << 30)
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, seed=seed + i, ignore_eos=True) for i in range(DRAWS)
    ]
    outputs = engine.generate([prompt] * DRAWS, params)
    stats_ = engine.speculative_stats
    assert stats_.verifications >= DRAWS and stats_.drafted >= DRAWS, stats_  # every second token was verified
    first = _top_k(engine.score(prompt)[-1])
    expected = sum(first[t] * _top_k(engine.score([*prompt, t])[-1]) for t in first.nonzero().flatten().tolist())
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outputs]), minlength=VOCAB).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside every top-k set"
    p_value = stats.chisquare(counts[support], expected[support] * DRAWS).pvalue
    print(f"{method}: acceptance {stats_.acceptance_rate:.3f}, chi-square p {p_value:.3g}")
    assert p_value >= 1e-6
