"""How to pick each next token and when to stop."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from qruntime.engine.structured import StructuredOutput
from qruntime.shown import shown

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): dividing by them only rounds to argmax
SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes seeds below this (a larger one fails mid-request)


@dataclass(frozen=True)
class FieldProblem:
    """One invalid SamplingParams value: the field, the offending value (for a sequence field, its
    bad item, at `index`) and the rule it breaks, phrased to follow the field's name ("must be ≥ 1").
    The CLI puts its flag where the API puts the field, so both show the same rule."""

    field: str
    value: object
    rule: str
    index: int | None = None

    def __str__(self) -> str:
        where = self.field if self.index is None else f"{self.field}[{self.index}]"
        return f"{where} {self.rule} (got {shown(self.value)})"


class InvalidSamplingParams(ValueError):
    """SamplingParams refused its values; `problems` names each field at fault."""

    def __init__(self, problems: Sequence[FieldProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid SamplingParams: " + "; ".join(map(str, self.problems)))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    temperature 0 (or anything below SAMPLING_EPS) is greedy (top_k / top_p / min_p / seed are then
    unused). top_k 0 means no top-k cut, top_p 1.0 no nucleus cut, min_p 0 no cut of the tokens less
    likely than min_p times the likeliest (after the temperature, before top-k / top-p, as vLLM).
    `seed` makes a sampled generation reproducible (whatever else runs in the same batch).
    `logit_bias` ((token id, bias) pairs; a {token id: bias} mapping is taken too) adds each bias to
    that token's logit before anything else, greedy included (OpenAI's: -100 bans a token, 100 all
    but forces it). Generation stops at the first of: max_tokens new tokens; a stop token id; an EOS
    id of the model (unless ignore_eos); a stop string (not part of the text); the model's context
    length. Before `min_tokens` new tokens, the stop token ids and the EOS ids cannot be sampled, and
    stop strings are looked for only in the text of the tokens after the first min_tokens (as vLLM).

    Penalties, as OpenAI's and vLLM's: presence_penalty is subtracted from the logit of every token
    already generated, frequency_penalty times the number of times it was; repetition_penalty (HF's,
    over the prompt and the output) divides a positive logit of a token seen and multiplies a
    negative one. They come after logit_bias, before the temperature, on the model's logits.

    `logprobs` k (0 to MAX_LOGPROBS): each generated token's logprob and the k likeliest tokens at its
    position; `prompt_logprobs` k: the same for every prompt token after the first (such a request
    computes its whole prompt: the prefix cache would skip the positions). Both are the model's raw
    log-softmax, before logit_bias, penalties and the temperature (engine/logprobs.py).

    `max_thinking_tokens` caps a reasoning model's thinking: once that many tokens have been
    generated inside an open <think> block (opened by the prompt's end or by a generated <think>),
    the next token is </think>, whatever the model would pick (needs both tokens in the vocabulary).

    `structured` (engine/structured.StructuredOutput) constrains the output to a JSON schema, any
    JSON object, a regex, a choice of strings or a Lark grammar; it ends when the constraint is
    complete (finish_reason "stop").
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_thinking_tokens: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(
            self, "logit_bias", tuple(tuple(pair) if isinstance(pair, Sequence) else pair for pair in bias)
        )
        problems = _problems(self)
        if problems:
            raise InvalidSamplingParams(problems)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes this request's logits (their history is needed to sample it)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1


def as_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (a single one is shared)."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
    return params


# --- the checks: the one place the valid ranges are written down (the CLIs map fields to flags) ---
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problems(p: SamplingParams) -> list[FieldProblem]:
    return [
        *_max_tokens(p.max_tokens),
        *_temperature(p.temperature),
        *_top_k(p.top_k),
        *_top_p(p.top_p),
        *_seed(p.seed),
        *_stop(p.stop),
        *_stop_token_ids(p.stop_token_ids),
        *_min_p(p.min_p),
        *_min_tokens(p.min_tokens, p.max_tokens),
        *_logit_bias(p.logit_bias),
        *_penalty("presence_penalty", p.presence_penalty),
        *_penalty("frequency_penalty", p.frequency_penalty),
        *_repetition_penalty(p.repetition_penalty),
        *_logprobs("logprobs", p.logprobs),
        *_logprobs("prompt_logprobs", p.prompt_logprobs),
        *_max_thinking_tokens(p.max_thinking_tokens),
        *_structured(p.structured),
    ]


def _max_tokens(value: object) -> Iterator[FieldProblem]:
    if not _is_int(value):
        yield FieldProblem("max_tokens", value, "must be an integer")
    elif value < 1:
        yield FieldProblem("max_tokens", value, "must be ≥ 1")


def _temperature(value: object) -> Iterator[FieldProblem]:
    if not isinstance(value, int | float):
        yield FieldProblem("temperature", value, "must be a number")
    elif not 0 <= value < math.inf:  # NaN fails this too; a huge int is compared, not converted
        yield FieldProblem("temperature", value, "must be finite and ≥ 0")


def _top_k(value: object) -> Iterator[FieldProblem]:
    if not isinstance(value, int):
        yield FieldProblem("top_k", value, "must be an integer")
    elif value < 0:
        yield FieldProblem("top_k", value, "must be ≥ 0")


def _top_p(value: object) -> Iterator[FieldProblem]:
    if not isinstance(value, int | float):
        yield FieldProblem("top_p", value, "must be a number")
    elif not 0 < value <= 1:  # NaN fails this too
        yield FieldProblem("top_p", value, "must be in (0, 1]")


def _seed(value: object) -> Iterator[FieldProblem]:
    if value is None:
        return
    if not isinstance(value, int):
        yield FieldProblem("seed", value, "must be an integer")
    elif not 0 <= value < SEED_LIMIT:
        yield FieldProblem("seed", value, "must be ≥ 0 and < 2**64")


def _stop(values: tuple[object, ...]) -> Iterator[FieldProblem]:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            yield FieldProblem("stop", value, "must be a string", i)
        elif not value:
            yield FieldProblem("stop", value, "must be a non-empty string", i)


def _stop_token_ids(values: tuple[object, ...]) -> Iterator[FieldProblem]:
    for i, value in enumerate(values):
        if not isinstance(value, int):
            yield FieldProblem("stop_token_ids", value, "must be an integer", i)
        elif value < 0:
            yield FieldProblem("stop_token_ids", value, "must be ≥ 0", i)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]


def _min_p(value: object) -> Iterator[FieldProblem]:
    if not isinstance(value, int | float) or isinstance(value, bool):
        yield FieldProblem("min_p", value, "must be a number")
    elif not 0 <= value <= 1:  # NaN fails this too
        yield FieldProblem("min_p", value, "must be in [0, 1]")


def _min_tokens(value: object, max_tokens: object) -> Iterator[FieldProblem]:
    if not _is_int(value):
        yield FieldProblem("min_tokens", value, "must be an integer")
    elif value < 0:
        yield FieldProblem("min_tokens", value, "must be ≥ 0")
    elif _is_int(max_tokens) and max_tokens >= 1 and value > max_tokens:
        yield FieldProblem("min_tokens", value, f"must be ≤ max tokens ({max_tokens})")


def _logit_bias(pairs: tuple[object, ...]) -> Iterator[FieldProblem]:
    seen = set()
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            yield FieldProblem("logit_bias", pair, "must hold (token id, bias) pairs", i)
            continue
        token, bias = pair
        if not _is_int(token) or token < 0:
            yield FieldProblem("logit_bias", token, "must name tokens by id ≥ 0", i)
        elif token in seen:
            yield FieldProblem("logit_bias", token, "names this token twice", i)
        elif (
            not isinstance(bias, int | float) or isinstance(bias, bool) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        ):
            yield FieldProblem("logit_bias", bias, f"must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", i)
        seen.add(token)


MAX_PENALTY = 2.0  # OpenAI's range for presence / frequency penalties: [-2, 2]


def _penalty(field: str, value: object) -> Iterator[FieldProblem]:
    if not isinstance(value, int | float) or isinstance(value, bool):
        yield FieldProblem(field, value, "must be a number")
    elif not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails this too
        yield FieldProblem(field, value, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")


def _repetition_penalty(value: object) -> Iterator[FieldProblem]:
    if not isinstance(value, int | float) or isinstance(value, bool):
        yield FieldProblem("repetition_penalty", value, "must be a number")
    elif not 0 < value < math.inf:
        yield FieldProblem("repetition_penalty", value, "must be finite and > 0")


MAX_LOGPROBS = 20  # OpenAI's top_logprobs range: 0 to 20


def _logprobs(field: str, value: object) -> Iterator[FieldProblem]:
    if value is None:
        return
    if not _is_int(value):
        yield FieldProblem(field, value, "must be an integer")
    elif not 0 <= value <= MAX_LOGPROBS:
        yield FieldProblem(field, value, f"must be in [0, {MAX_LOGPROBS}]")


def _max_thinking_tokens(value: object) -> Iterator[FieldProblem]:
    if value is None:
        return
    if not _is_int(value):
        yield FieldProblem("max_thinking_tokens", value, "must be an integer")
    elif value < 0:
        yield FieldProblem("max_thinking_tokens", value, "must be ≥ 0")


def _structured(value: object) -> Iterator[FieldProblem]:
    if value is not None and not isinstance(value, StructuredOutput):
        yield FieldProblem("structured", value, "must be a StructuredOutput")
