"""The synthetic tokenizer: loads in tokenizers and transformers, round-trips, ids match the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from qcompile.errors import ArtifactError
from qcompile.synth import get_preset, write_tokenizer_files
from qcompile.synth.tokenizer import QWEN_ADDED_TOKENS, TokenizerLayout, build_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a: int, b: int) -> int:\n\treturn a + b  # 42\n",
    "Ünïcödé: naïve café, 世界, Здравствуйте, 🙂, tabs\tand  double  spaces",
    "",
]


@pytest.fixture(scope="module")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer files of a real preset (vocabulary padded up to Qwen's 151643), no weights."""
    out = tmp_path_factory.mktemp("qwen3-tokenizer")
    config = get_preset("qwen3-8b").config()
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer_files(config, out)
    return out


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def test_tokenizers_library_round_trips(tiny_ckpt):
    tokenizer = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    for text in TEXTS:
        encoding = tokenizer.encode(text)
        assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
    # merges were learned: common words take fewer tokens than bytes
    assert len(tokenizer.encode(TEXTS[0]).ids) < len(TEXTS[0].encode()) * 0.75


def test_vocabulary_fits_the_config(tiny_ckpt, tiny_odd_ckpt):
    for ckpt in (tiny_ckpt, tiny_odd_ckpt):
        config = _config(ckpt)
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        assert tokenizer.get_vocab_size() == config["bos_token_id"] + len(QWEN_ADDED_TOKENS) <= config["vocab_size"]
    assert Tokenizer.from_file(str(tiny_odd_ckpt / "tokenizer.json")).get_vocab_size() == 538  # no padding rows


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "qwen_tokenizer_dir"])
def test_transformers_tokenizer_ids_match_config(fixture, request):
    from transformers import AutoTokenizer

    path = request.getfixturevalue(fixture)
    config = _config(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == config["bos_token_id"]
    assert tokenizer.pad_token_id == config["bos_token_id"]
    for offset, (name, _) in enumerate(QWEN_ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(name) == config["bos_token_id"] + offset
    assert len(tokenizer) == config["bos_token_id"] + len(QWEN_ADDED_TOKENS) <= config["vocab_size"]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["bos_token_id"] == config["bos_token_id"]
    assert config["eos_token_id"] in generation["eos_token_id"]
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert max(ids, default=0) < config["bos_token_id"]  # plain text never hits a placeholder
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("a<|im_end|>b<think>c", add_special_tokens=False)
    assert config["eos_token_id"] in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab<think>c"  # <think> is added, not special


def test_padded_vocabulary_placeholders(qwen_tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 151643 + len(QWEN_ADDED_TOKENS)
    assert tokenizer.id_to_token(151642) == "<|reserved_151642|>"
    assert tokenizer.token_to_id("<|im_start|>") == 151644
    assert tokenizer.encode("<|reserved_151642|>").ids != [151642]  # unreachable from text


def test_chat_template_renders_chatml(tiny_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    chatml = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == chatml
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == chatml + "<|im_start|>assistant\n"
    no_think = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == prompt + "<think>\n\n</think>\n\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.eos_token_id) == 4


def test_training_is_deterministic():
    layout = TokenizerLayout(trained=512, specials_start=512)
    assert build_tokenizer(layout).to_str() == build_tokenizer(layout).to_str()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"eos_token_id": 513}, "bos_token_id \\+ 2"),
        ({"vocab_size": 520}, "at least 538"),
        ({"bos_token_id": 100, "eos_token_id": 102}, "byte alphabet"),
        ({"bos_token_id": None}, "integer"),
    ],
)
def test_inconsistent_config_is_refused(changes, message):
    config = {**get_preset("tiny").config(), **changes}
    with pytest.raises(ArtifactError, match=message):
        TokenizerLayout.from_config(config)
