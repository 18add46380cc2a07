"""EleutherAI's lm-evaluation-harness on an artifact: the model "qruntime" for `lm_eval`.

    python -m qruntime.harness --model_args artifact=ART[,device=cpu,dtype=float32,...] --tasks hellaswag
    lm_eval.simple_evaluate(model=QRuntimeLM(artifact=ART), tasks=[...])            (from Python)

`python -m qruntime.harness ...` takes lm_eval's own arguments (`lm_eval --help`) and adds
`--model qruntime`: lm_eval finds models by name in its own registry, which this module fills when
it is imported. model_args are qruntime.load's keywords (artifact= the artifact's path, device,
dtype, tp, max_model_len, max_num_seqs, ...) plus `batch_size` (requests a generate_until batch
holds, default 64).

The three request types:
  - loglikelihood (context, continuation): the continuation's tokens are those the tokenizer gives
    the whole string past the context's own tokens (the harness's convention: a space at the join
    belongs to the continuation); its summed log-probability and whether every token was the argmax,
    from one forward pass (Engine.score) of context + continuation, left-truncated to the model's
    length. Log-probabilities are log_softmax of the raw logits, in fp32 (no temperature).
  - loglikelihood_rolling (text): the text's tokens after a BOS-like prefix token (the tokenizer's
    EOS, as lm_eval's HF model does), in disjoint windows of max_model_len tokens, each scored with
    the context the window allows.
  - generate_until (context, {until, max_gen_toks, temperature, do_sample, ...}): batched through
    Engine.generate, stopped at the `until` strings (not part of the text), greedy unless do_sample.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import qruntime
from qruntime.engine.sampling_params import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256
LOAD_INTS = ("tp", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory")
LOAD_BOOLS = ("verify", "cuda_graphs", "prefix_cache", "custom_all_reduce", "sharded_sampling", "pdl")


def _load_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """qruntime.load's keywords from lm_eval's model_args strings (which it may already have typed)."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        if key in LOAD_INTS:
            out[key] = int(value)
        elif key in LOAD_BOOLS:
            out[key] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        elif key in ("device", "dtype", "backend"):
            out[key] = str(value)
        else:
            raise ValueError(
                f"model_args: {key!r} is not a qruntime.load keyword (artifact, {', '.join(LOAD_INTS + LOAD_BOOLS)}, device, dtype, backend, batch_size)"
            )
    return out


@register_model("qruntime")
class QRuntimeLM(LM):
    """lm_eval's LM over a qruntime Engine (see the module doc)."""

    def __init__(self, artifact: str | None = None, batch_size: int | str = 64, **load_args: Any) -> None:
        super().__init__()
        if not artifact:
            raise ValueError("model_args must name the artifact: --model_args artifact=PATH")
        self.engine = qruntime.load(artifact, **_load_kwargs(load_args))
        self.tokenizer = self.engine.tokenizer
        self.batch = max(1, int(batch_size)) if str(batch_size).isdigit() else 64
        self.max_length = self.engine.max_model_len
        eos = self.tokenizer.eos_token_ids  # the rolling windows' first token, as lm_eval's HF model uses EOS
        if not eos:
            raise ValueError(f"{artifact}: its tokenizer names no EOS token, which loglikelihood_rolling starts from")
        self.prefix_token = min(eos)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> QRuntimeLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> QRuntimeLM:
        """model_args first; the command line's --batch_size / --device where model_args do not say."""
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is not None and key in ("batch_size", "device"):
                args.setdefault(key, value)
        return cls(**args)

    # --- log-likelihoods ---------------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:  # the harness's convention: the join's whitespace goes with the continuation
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
        context_ids = self.tokenizer.encode(context, add_special_tokens=False)
        return whole[: len(context_ids)], whole[len(context_ids) :]

    def _score(self, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> tuple[float, bool]:
        """log P(continuation | context) and whether each continuation token was the argmax."""
        if not continuation_ids:
            return 0.0, True
        ids = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1) :]
        if len(ids) == len(continuation_ids):  # no context left (or none given): condition on the prefix token
            ids = [self.prefix_token, *ids][-(self.max_length + 1) :]
        logits = self.engine.score(ids[:-1])  # [L - 1, V]: the next token after each prefix
        n = min(len(continuation_ids), len(ids) - 1)
        logprobs = torch.log_softmax(logits[-n:].float(), dim=-1)
        targets = torch.tensor(ids[-n:], device=logprobs.device)
        picked = logprobs.gather(1, targets[:, None]).squeeze(1)
        return float(picked.sum()), bool((logprobs.argmax(-1) == targets).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            if context:
                context_ids, continuation_ids = self._encode_pair(context, continuation)
            else:
                context_ids, continuation_ids = [], self.tokenizer.encode(continuation, add_special_tokens=False)
            out.append(self._score(context_ids, continuation_ids))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            windows = get_rolling_token_windows(ids, self.prefix_token, self.max_length - 1, 1)
            total = 0.0
            for context, target in map(make_disjoint_window, windows):
                total += self._score(context, target)[0]
            out.append(total)
        return out

    # --- generation ----------------------------------------------------------------------------------
    def _params(self, kwargs: dict[str, Any]) -> SamplingParams:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        sample = bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
        return SamplingParams(
            max_tokens=int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
            temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
            top_p=float(kwargs.get("top_p", 1.0)) if sample else 1.0,
            stop=tuple(s for s in until if s),
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str] = []
        for start in range(0, len(requests), self.batch):
            batch = requests[start : start + self.batch]
            prompts, params = [], []
            for request in batch:
                context, kwargs = request.args
                p = self._params(dict(kwargs))
                ids = self.tokenizer.encode(context, add_special_tokens=False)
                keep = max(self.max_length - p.max_tokens, 1)  # room for the answer: the context's end is kept
                prompts.append(ids[-keep:])
                params.append(p)
            out.extend(o.text for o in self.engine.generate(prompts, params))
        return out


def main(argv: Sequence[str] | None = None) -> None:
    """lm_eval's command line (`lm-eval run ...`) with `--model qruntime` (this module registered it
    on import)."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if "--model" in args:
        raise SystemExit("python -m qruntime.harness sets --model qruntime itself; give --model_args artifact=PATH")
    sys.argv = ["lm-eval", "run", "--model", "qruntime", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
