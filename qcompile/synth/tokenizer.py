"""A Qwen-shaped byte-level BPE tokenizer, trained here, offline, in about a second.

Qwen3's tokenizer is byte-level BPE (NFC, Qwen's split regex, GPT-2 byte alphabet) with 26 added
tokens from <|endoftext|> (151643) to </think> (151668). This module builds one with the same
pipeline and the same added tokens, trained on a fixed set of Python standard-library files (on
every machine, no download). Its vocabulary is laid out as

    [0, trained)               byte alphabet + learned merges
    [trained, specials_start)  placeholders <|reserved_N|>, reachable by no merge
    [specials_start, +26)      Qwen's added tokens, in Qwen's order

so that `specials_start` can be the config's `bos_token_id`: 151643 for the real presets, the end
of the trained vocabulary for the tiny ones. Config ids and tokenizer ids then agree.
The corpus is the running Python's own standard library, so the trained merges are reproducible
on one installation and may differ between Python versions.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from qcompile.errors import ArtifactError

# (content, special): Qwen3's added tokens in id order; ids are specials_start + position
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# a Qwen3-VL config.json's token ids -> the added token each names
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
MAX_TRAINED_VOCAB = 8192  # enough merges for realistic token counts; more would not train in a second
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Standard-library files present in every CPython since 3.11: English prose (the pydoc topics)
# and Python source. Read in this order, each capped, until CORPUS_BYTES.
CORPUS_FILES: tuple[tuple[str, int], ...] = (
    ("pydoc_data/topics.py", 600_000),
    ("argparse.py", 100_000),
    ("typing.py", 100_000),
    ("inspect.py", 100_000),
    ("difflib.py", 80_000),
    ("enum.py", 80_000),
    ("ast.py", 60_000),
    ("dataclasses.py", 60_000),
    ("collections/__init__.py", 50_000),
    ("email/message.py", 50_000),
    ("functools.py", 40_000),
    ("heapq.py", 25_000),
    ("textwrap.py", 20_000),
    ("csv.py", 16_000),
    ("json/decoder.py", 12_000),
    ("string.py", 12_000),
)
CORPUS_BYTES = 1_500_000

# Qwen3's chat format, tools included: the tools' JSON schemas listed in a system turn, an
# assistant's calls as <tool_call> blocks of {"name", "arguments"} JSON, and each run of tool
# results as one user turn of <tool_response> blocks (the wording of the tools preamble is ours)
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nThese functions are available; their signatures are in <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, write its name and arguments as JSON in <tool_call></tool_call> tags:\\n' }}
    {{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message['content'] if message['content'] is string else '' %}
    {%- if tools and loop.first and message['role'] == 'system' %}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or loop.previtem['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem['role'] != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for call in message['tool_calls'] %}
            {%- set function = call['function'] if call['function'] is defined else call %}
            {{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{"name": ' + (function['name'] | tojson) + ', "arguments": ' }}
            {{- function['arguments'] if function['arguments'] is string else (function['arguments'] | tojson) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


@dataclass(frozen=True)
class TokenizerLayout:
    """Where each part of the vocabulary sits (see the module docstring)."""

    trained: int  # byte alphabet + merges: ids [0, trained)
    specials_start: int  # id of <|endoftext|>; Qwen's added tokens follow

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TokenizerLayout:
        """The layout whose ids match the config's bos/eos ids and fit in its vocab_size (a Qwen3-VL
        config's text_config ones), and, for Qwen3-VL, whose vision tokens are the config's ids."""
        text = text_part(config)
        bos, eos, vocab = text.get("bos_token_id"), text.get("eos_token_id"), text.get("vocab_size")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (bos, eos, vocab)):
            raise ArtifactError(
                f"config needs integer bos_token_id, eos_token_id and vocab_size to lay out a tokenizer, "
                f"got {bos!r}, {eos!r}, {vocab!r}"
            )
        layout = cls(trained=min(bos, MAX_TRAINED_VOCAB), specials_start=bos)
        if bos < 256:
            raise ArtifactError(f"bos_token_id {bos} leaves no room for the 256-token byte alphabet below it")
        if eos != layout.token_id(IM_END):
            raise ArtifactError(
                f"eos_token_id {eos} must be bos_token_id + 2 ({layout.token_id(IM_END)}), where "
                f"{IM_END} follows {ENDOFTEXT} as in Qwen's vocabulary"
            )
        if vocab < layout.size:
            raise ArtifactError(
                f"vocab_size {vocab} is too small for the tokenizer: its {len(QWEN_ADDED_TOKENS)} added "
                f"tokens start at bos_token_id {bos}, so vocab_size must be at least {layout.size}"
            )
        for key, token in VISION_TOKENS.items():
            if key in config and config[key] != layout.token_id(token):
                raise ArtifactError(
                    f"{key} {config[key]!r} must be {layout.token_id(token)}, the id of {token} among the "
                    f"added tokens that start at bos_token_id {bos}, as in Qwen's vocabulary"
                )
        return layout

    @property
    def size(self) -> int:
        """Number of tokens, added tokens included (the config's vocab_size may pad beyond it)."""
        return self.specials_start + len(QWEN_ADDED_TOKENS)

    def token_id(self, content: str) -> int:
        names = [name for name, _ in QWEN_ADDED_TOKENS]
        return self.specials_start + names.index(content)


def text_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a config.json holding the text model's ids: a Qwen3-VL config's text_config, else
    the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def training_corpus(limit: int = CORPUS_BYTES) -> list[str]:
    """The fixed training texts, read from the running Python's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    left = limit
    for name, cap in CORPUS_FILES:
        path = root / name
        if left <= 0:
            break
        if path.is_file():
            text = path.read_bytes()[: min(cap, left)].decode("utf-8", errors="ignore")
            texts.append(text)
            left -= len(text)
    if sum(map(len, texts)) < 100_000:
        raise ArtifactError(f"{root}: too little of the Python standard library found to train a tokenizer")
    return texts


def build_tokenizer(layout: TokenizerLayout, corpus: Iterable[str] | None = None) -> Tokenizer:
    """Train the BPE on `corpus` (default: `training_corpus()`), pad it to `layout.specials_start`
    with placeholders, add Qwen's tokens."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.NFC()
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer_tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=layout.trained,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    trainer_tok.train_from_iterator(training_corpus() if corpus is None else corpus, trainer)

    # Pad the model's own vocabulary (not added tokens: 150k of those would make every load slow).
    # Byte-level pre-tokenization splits "<|reserved_9|>" apart, so no merge can ever produce it.
    data = json.loads(trainer_tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for token_id in range(len(vocab), layout.specials_start):
        vocab[f"<|reserved_{token_id}|>"] = token_id
    if len(vocab) != layout.specials_start or sorted(vocab.values()) != list(range(layout.specials_start)):
        raise AssertionError("placeholder tokens collided with trained ones")  # cannot happen; checked anyway
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.add_tokens(
        [
            AddedToken(name, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
            for name, special in QWEN_ADDED_TOKENS
        ]
    )
    for name, _ in QWEN_ADDED_TOKENS:
        if tokenizer.token_to_id(name) != layout.token_id(name):
            raise AssertionError(f"{name} landed at {tokenizer.token_to_id(name)}, not {layout.token_id(name)}")
    return tokenizer


def tokenizer_config(layout: TokenizerLayout) -> dict[str, Any]:
    """tokenizer_config.json in the shape Qwen3 publishes, with our own chat template."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(layout.specials_start + i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (name, special) in enumerate(QWEN_ADDED_TOKENS)
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: stop on <|im_end|> or <|endoftext|>, greedy by default."""
    text = text_part(config)
    bos = text["bos_token_id"]
    return {
        "bos_token_id": bos,
        "do_sample": False,
        "eos_token_id": [text["eos_token_id"], bos],
        "pad_token_id": bos,
    }


def write_tokenizer_files(
    config: Mapping[str, Any], out_dir: str | Path, corpus: Iterable[str] | None = None
) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json,
    the BPE trained on `corpus` (default: `training_corpus()`)."""
    out = Path(out_dir)
    layout = TokenizerLayout.from_config(config)
    tokenizer = build_tokenizer(layout, corpus)
    files = {
        "tokenizer_config.json": tokenizer_config(layout),
        "special_tokens_map.json": {"eos_token": IM_END, "pad_token": ENDOFTEXT},
        "generation_config.json": generation_config(config),
    }
    written = [out / "tokenizer.json"]
    tokenizer.save(str(written[0]))
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(out / name)
    return written
