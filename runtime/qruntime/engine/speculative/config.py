"""SpeculativeConfig: which draft method an engine speculates with, and how far."""

from __future__ import annotations

from dataclasses import dataclass, fields

from qruntime.engine.speculative.proposers import PROPOSERS

MAX_DRAFT_TOKENS = 16  # a verify chunk computes k + 1 positions; more drafts than this never pay
# num_tokens when not given. Prompt lookup's drafts cost no model step, only verified rows, and where
# it finds a match most of it is right: on the bench's trained 104M target (H200, ac7551a,
# bench/results/spec_bench_trained_pl_k_ac7551a_h200.json) k = 4 / 8 / 12 gave 1.47 / 1.94 / 1.98x
# plain decoding on the edit task at batch 1, 1.18 / 1.47 / 1.58x on free generation, and at batch 8
# 0.69-0.78 / 0.75-0.82 / 0.80-0.91x. A draft model's k tokens cost k of its steps: 4, as before.
DEFAULT_NUM_TOKENS = {"prompt-lookup": 12}
DEFAULT_MODEL_NUM_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: a proposer's name (proposers.PROPOSERS). draft_model: the draft artifact's path (method
    draft-model: a smaller Qwen3 with the target's vocabulary). num_tokens: the most draft tokens one step
    verifies (k; None: the method's default, DEFAULT_NUM_TOKENS; adaptive: each request's k moves between 1 and this with its acceptance, and a
    request whose drafts keep failing stops drafting for a while; gate: the engine drafts only at the
    batch sizes where that is measured to pay). prompt_lookup_min / _max: the
    n-gram lengths prompt lookup matches, longest first. skip_layers (layer-skip): the decoder layers
    the draft leaves out, instead of those the artifact names."""

    method: str = "prompt-lookup"
    num_tokens: int | None = None
    adaptive: bool = True
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    skip_layers: tuple[int, ...] | None = None  # layer-skip: instead of the artifact's draft layers (experiments)
    # drafting only at batch sizes where it is measured faster than plain decoding (draft_gate.py); None:
    # on a CUDA device (a CPU's reference ops time nothing a GPU would). Never without `adaptive`.
    gate: bool | None = None
    # draft-model and layer-skip with decode graphs: a greedy draft's steps after the first replay as one
    # chain of decode steps (engine/decode_chains.py) instead of one decode graph replay a step. Off by
    # default: on the bench's trained pair (H200, 64b5af2) it measured no faster for the draft model
    # (0.61-0.62x plain either way at batch 1) and slower for layer skip (0.55 against 0.69x on free
    # generation), and its graphs, captured at first use per step count, cost timed passes at batch 8
    chain: bool = False

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS:
            raise ValueError(f"speculative method {self.method!r} is unknown; choose one of {', '.join(PROPOSERS)}")
        if self.num_tokens is None:
            object.__setattr__(self, "num_tokens", DEFAULT_NUM_TOKENS.get(self.method, DEFAULT_MODEL_NUM_TOKENS))
        if (self.method == "draft-model") != (self.draft_model is not None):
            raise ValueError(
                "the draft-model method takes a draft artifact (draft_model=PATH), and only it does"
                f" (method {self.method!r}, draft_model {self.draft_model!r})"
            )
        if not 1 <= self.num_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_tokens must be 1..{MAX_DRAFT_TOKENS} (got {self.num_tokens})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                f"(got {self.prompt_lookup_min}, {self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """'METHOD' or 'METHOD:key=value,...' (keys: this class's fields, e.g. 'prompt-lookup:num_tokens=6',
        'draft-model:draft_model=/models/qwen3-0.6b-fp8'; a path holding ',' or '=' needs SpeculativeConfig)."""
        method, _, options = text.strip().partition(":")
        known = {f.name: f.type for f in fields(cls) if f.name not in ("method", "skip_layers")}
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in options.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in known:
                raise ValueError(f"speculative option {item!r}: expected key=value with key one of {', '.join(known)}")
            if known[key] == "str | None":
                if not value.strip():
                    raise ValueError(f"speculative option {key}: expected a value")
                values[key] = value.strip()
            elif known[key] in ("bool", "bool | None"):
                if value.strip().lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"speculative option {key}: expected true or false (got {value!r})")
                values[key] = value.strip().lower() in ("true", "1")
            else:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ValueError(f"speculative option {key}: expected an integer (got {value!r})") from None
        return cls(method.strip(), **values)
