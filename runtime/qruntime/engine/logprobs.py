"""Log-probabilities of tokens, computed on the device beside the sampler and read by the host later.

They are the model's own: log_softmax in fp32 of the raw logits the step produced, before logit_bias,
penalties, bans and the temperature (what vLLM returns by default, its "raw_logprobs": a token's
logprob does not depend on how it was sampled). A row's entry is the logprob of one token (the one
sampled, or for a prompt the prompt's next token), its rank (1 + the tokens with a higher logprob,
as vLLM counts it) and the `k` most likely tokens with theirs; the copy to the host is asynchronous (pinned memory and an event, as SampledTokens), so the step after
is launched before the host reads them, and nothing of the vocabulary's size crosses to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qruntime.engine.outputs import TokenLogprob
from qruntime.engine.transfer import device_tensor

ROW_BLOCK = 256  # rows per log_softmax: a 2,048-token prompt's fp32 vocabulary rows would be ~1.2 GB at once


class DeviceLogprobs:
    """Logprobs of rows of a logits tensor [n, V]: `chosen` [m] token ids on the device (one per
    selected row), and the top `k`. `tolist()` waits for their copy alone and returns TokenLogprobs."""

    def __init__(self, logits: torch.Tensor, rows: Sequence[int], chosen: torch.Tensor, k: int) -> None:
        device = logits.device
        pin = device.type == "cuda"
        index = device_tensor(list(rows), torch.int64, device)
        picked, ranks, top_lp, top_ids = [], [], [], []
        for start in range(0, len(rows), ROW_BLOCK):
            lp = torch.log_softmax(logits[index[start : start + ROW_BLOCK]].float(), dim=-1)
            mine = lp.gather(1, chosen[start : start + ROW_BLOCK, None])  # [rows, 1]
            picked.append(mine.squeeze(1))
            ranks.append((lp > mine).sum(-1) + 1)
            if k:
                values, ids = lp.topk(k, dim=-1)
                top_lp.append(values)
                top_ids.append(ids)
        self.k = k
        device_parts = [torch.cat(picked), chosen, torch.cat(ranks)]
        if k:
            device_parts += [torch.cat(top_lp), torch.cat(top_ids)]
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in device_parts]
        for host, part in zip(self._host, device_parts, strict=True):
            host.copy_(part, non_blocking=pin)
        self._copied = torch.cuda.Event() if pin else None
        if self._copied is not None:
            self._copied.record()

    def tolist(self) -> list[TokenLogprob]:
        if self._copied is not None:
            self._copied.synchronize()
        logprob, token, rank = (h.tolist() for h in self._host[:3])
        if not self.k:
            return [TokenLogprob(t, lp, rank=r) for t, lp, r in zip(token, logprob, rank, strict=True)]
        top_lp, top_ids = self._host[3].tolist(), self._host[4].tolist()
        return [
            TokenLogprob(t, lp, tuple(zip(ids, lps, strict=True)), r)
            for t, lp, r, ids, lps in zip(token, logprob, rank, top_ids, top_lp, strict=True)
        ]
