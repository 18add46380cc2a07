"""Verification of draft tokens against the target's logits, on the device, with no host sync.

For a request with k drafts d_1..d_k, one target step computes the logits after the last known
token and after each draft: rows 0..k. Row j - 1 gives p_j, the target's distribution of token j
(after temperature, top-k, top-p, min-p: sampler.log_weights). Speculative sampling (Leviathan et
al. 2023; Chen et al. 2023): d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), q_j being
the draft's distribution, and at the first rejection the token is drawn from the residual
max(p_j - q_j, 0), renormalised; when all k are accepted, row k gives one more token, sampled as
usual (the engine's sampler). Every emitted token then has exactly the target's distribution. A
deterministic draft (prompt lookup) is a point mass: accepted with probability p_j(d_j), the
residual is p_j without d_j. Greedy rows accept d_j while it is the argmax of row j - 1, and the
argmax of the first row that disagrees replaces it: the tokens plain greedy decoding gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qruntime.engine.sampler import exponentials, log_weights, race
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.transfer import device_tensor


@dataclass(frozen=True)
class Verdicts:
    """Per request (on the device): accepted [B] int64, how many of its drafts were accepted (0..k),
    and replacement [B] int64, the token drawn at the first rejected position (meaningless when all
    were accepted). finite [B] bool: whether every verified row's logits were finite."""

    accepted: torch.Tensor
    replacement: torch.Tensor
    finite: torch.Tensor


def uniforms(count: int, generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """U[0, 1) draws [len(generators), count], a row per entry of generators: rows that share a
    generator draw together, in row order (as sampler.exponentials)."""
    groups: dict[int, list[int]] = {}
    for row, generator in enumerate(generators):
        groups.setdefault(id(generator), []).append(row)
    out = torch.empty(len(generators), count, device=device)
    for members in groups.values():
        block = torch.rand(len(members), count, device=device, generator=generators[members[0]])
        out[device_tensor(members, torch.int64, device)] = block
    return out


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> Verdicts:
    """Verify B requests' drafts. logits [B, K, V]: row j of request b predicts its draft j (K = the
    most drafts of any request; rows past a request's own k are ignored). drafts[b]: its k_b >= 1
    tokens. params / generators: each request's (None for greedy). draft_probs [B, K, V] or None:
    the draft's distributions q_j (None: each draft a point mass)."""
    batch, width, vocab = logits.shape
    device = logits.device
    if len(drafts) != batch or any(not 1 <= len(d) <= width for d in drafts):
        raise ValueError(f"{len(drafts)} drafts of lengths {[len(d) for d in drafts]} for logits {tuple(logits.shape)}")
    if draft_probs is None and all(p.greedy for p in params):
        return _verify_greedy(logits, drafts)
    lengths = device_tensor([len(d) for d in drafts], torch.int64, device)
    tokens = device_tensor([list(d) + [0] * (width - len(d)) for d in drafts], torch.int64, device)  # [B, K]
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]  # [B, K]
    flat = logits.reshape(batch * width, vocab).float()
    best, argmax = flat.max(-1)
    finite = (torch.isfinite(best).reshape(batch, width) | ~valid).all(-1)
    argmax = argmax.reshape(batch, width)

    ok = torch.zeros(batch, width, dtype=torch.bool, device=device)
    replacement = argmax.clone()
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if len(sampled) < batch:
        greedy = device_tensor([b for b, p in enumerate(params) if p.greedy], torch.int64, device)
        ok[greedy] = argmax[greedy] == tokens[greedy]
    if sampled:
        rows = device_tensor(sampled, torch.int64, device)
        n = len(sampled)
        row_params = [params[b] for b in sampled for _ in range(width)]
        weights = log_weights(
            flat.reshape(batch, width, vocab)[rows].reshape(n * width, vocab),
            best.reshape(batch, width)[rows].reshape(-1),
            row_params,
        )
        p = weights.softmax(-1).reshape(n, width, vocab)  # the target's p_j
        picked = tokens[rows]  # [n, K]
        p_draft = p.gather(2, picked[..., None])[..., 0]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            residual = p.scatter(2, picked[..., None], 0.0)
        else:
            q = draft_probs[rows].float()
            q_draft = q.gather(2, picked[..., None])[..., 0]
            residual = (p - q).clamp_(min=0)
        gens = [generators[b] for b in sampled]
        u = uniforms(width, gens, device)  # [n, K]
        ok[rows] = u * q_draft < p_draft  # accept with probability min(1, p / q)
        # the residual's draw, by the exponential race (an all-zero residual is never used: p = q there)
        draws = exponentials((n * width, vocab), [g for g in gens for _ in range(width)], device)
        log_residual = residual.reshape(n * width, vocab).log()
        replacement[rows] = race(log_residual, draws).argmax(-1).reshape(n, width)
    run = (ok & valid).to(torch.int64).cumprod(-1)  # 1 while every draft so far was accepted
    accepted = run.sum(-1)
    at = accepted.clamp(max=width - 1)[:, None]
    return Verdicts(accepted, replacement.gather(1, at)[:, 0], finite)


def _verify_greedy(logits: torch.Tensor, drafts: Sequence[Sequence[int]]) -> Verdicts:
    """verify_drafts of greedy rows with point-mass drafts, in a third of the device ops: a draft is
    accepted while it is its row's argmax. The drafts are padded with -1, which no argmax equals, so
    a row's padding ends its run of matches and marks what the finite check ignores. Each op costs
    the host a launch whether it works on 4 rows or 4,000, and a verification waits for all of them
    (bench/spec_step_profile.py at 568c92f, H200: ~0.65 ms of host a verify_drafts call at batch 1)."""
    width = logits.shape[1]
    tokens = device_tensor([list(d) + [-1] * (width - len(d)) for d in drafts], torch.int64, logits.device)  # [B, K]
    best, argmax = logits.max(-1)  # [B, K]: the argmax of the model's dtype is the fp32 one's (same values)
    finite = (torch.isfinite(best) | (tokens < 0)).all(-1)
    accepted = (argmax == tokens).cumprod(-1).sum(-1)
    return Verdicts(accepted, argmax.gather(1, accepted.clamp(max=width - 1)[:, None])[:, 0], finite)
