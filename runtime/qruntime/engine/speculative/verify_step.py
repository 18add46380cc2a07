"""The engine's side of a verification step: which logits rows verify which drafts, and which tokens
each request keeps once the verdicts are read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qruntime.engine.speculative.rejection import Verdicts


def draft_logit_rows(ends: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """[B, K] rows of a step's logits: request b's chunk ends at row ends[b] (exclusive) and holds its
    last known token then its k_b drafts, so rows ends[b] - 1 - k_b .. ends[b] - 2 predict drafts
    1..k_b (the chunk's last row predicts the token after them). Padded to K = max k_b by repeating
    the request's last such row (verify_drafts ignores rows past k_b)."""
    width = max(len(d) for d in drafts)
    out = []
    for end, draft in zip(ends, drafts, strict=True):
        first = end - 1 - len(draft)
        out.append([first + min(j, len(draft) - 1) for j in range(width)])
    return out


def draft_probs(
    drafts: Sequence[Sequence[int]], probs: Sequence[torch.Tensor | None], logits: torch.Tensor
) -> torch.Tensor | None:
    """[B, K, V] distributions the drafts were drawn from, for rejection.verify_drafts; None when no
    request has any (every draft a point mass). A request without its own (prompt lookup, greedy)
    gets point masses on its drafts; rows past its k are zero."""
    if all(p is None for p in probs):
        return None
    batch, width, vocab = logits.shape
    out = torch.zeros(batch, width, vocab, device=logits.device)
    for b, (draft, p) in enumerate(zip(drafts, probs, strict=True)):
        if p is not None:
            out[b, : len(draft)] = p[: len(draft)].float()
        else:
            out[b, torch.arange(len(draft)), torch.tensor(draft)] = 1.0
    return out


@dataclass(frozen=True)
class VerifyStep:
    """A launched step's verifications: rows (its sampling rows that carried drafts), their drafts,
    and the verdicts on the device."""

    rows: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]
    verdicts: Verdicts

    def kept(self, bonus: Sequence[int | None]) -> dict[int, list[int] | None]:
        """Row -> the tokens its request keeps: its accepted drafts, then the replacement drawn at the
        first rejection, or, when all were accepted, the step's own token of that row (bonus[row],
        sampled from the chunk's last logits). None: some verified row's logits were not finite."""
        v = self.verdicts
        accepted, replacement, finite = torch.stack([v.accepted, v.replacement, v.finite.long()]).tolist()
        out: dict[int, list[int] | None] = {}
        for row, draft, n, token, ok in zip(self.rows, self.drafts, accepted, replacement, finite, strict=True):
            if bonus[row] is None or not ok:
                out[row] = None
            else:
                out[row] = [*draft[:n], token if n < len(draft) else bonus[row]]
        return out
