"""qruntime.tokenizer: parity with transformers on the synthetic Qwen3 checkpoint, clear errors, and
streaming detokenization (characters spanning tokens, stop strings). Random inputs are fresh each run;
the seed is printed, so a failure can be replayed."""

import json
import random
import re
import shutil
import subprocess
import sys

import pytest
from qruntime.tokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer, Tokenizer, TokenizerError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "<|fim_pad|>"]
POOL = (
    list("abcdefghijklmnopqrstuvwxyz ABCXYZ 0123456789 .,;:!?'\"()[]{}<>|\\/-_=+*&^%$#@~`\n\t  ")
    + list("éèêëàçñøåßüöÄ€£")
    + list("你好世界中文字日本語한국어")
    + ["🎉", "👍🏽", "🧑\u200d💻", "😀", "🇯🇵", "e\u0301", "\u200b", "𝔘"]
    + SPECIALS
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
)


def random_text(rng: random.Random, max_len: int = 60) -> str:
    return "".join(rng.choice(POOL) for _ in range(rng.randint(1, max_len)))


def copy_tokenizer(src, dst, **config_changes):
    """Copy the tokenizer files of `src` to `dst`, updating keys of the named JSON files (`...` deletes one)."""
    dst.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    for name, changes in config_changes.items():
        path = dst / f"{name}.json"
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps({k: v for k, v in data.items() if v is not ...}))
    return dst


def byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of the single-byte token for `byte` (GPT-2's byte-to-character alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = chr(byte) if byte in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(byte))
    return tok.backend.token_to_id(char)


def stream(tok, ids, prompt_ids=(), **kwargs):
    """Feed `ids` one by one; return the detokenizer, the deltas and the flush() result."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), **kwargs)
    deltas = [detok.add(i) for i in ids]
    return detok, deltas, detok.flush()


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer.from_dir(tiny_ckpt)


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.fixture
def rng():
    seed = random.randrange(2**32)
    print(f"random seed {seed}")
    return random.Random(seed)


def test_encode_decode_match_transformers(tok, hf, rng):
    texts = ["", "Hello, world!", "  leading\n\ttabs  ", "naïve café 你好 🎉👍🏽", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts + [random_text(rng) for _ in range(40)]:
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert tok.encode("<|im_start|>") == [hf.convert_tokens_to_ids("<|im_start|>")]
    for _ in range(20):  # arbitrary ids, invalid UTF-8 and placeholder tokens included
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("bos_in_tokenizer_json", [True, False])
def test_bos_as_transformers(tiny_ckpt, tmp_path, add_bos, bos_in_tokenizer_json):
    """transformers 5 takes BOS/EOS from tokenizer.json's post-processor and ignores add_bos_token there."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors
    from transformers import AutoTokenizer

    changes = {"bos_token": "<|endoftext|>", "add_bos_token": add_bos, "add_eos_token": add_bos}
    path = copy_tokenizer(tiny_ckpt, tmp_path, tokenizer_config=changes)
    if bos_in_tokenizer_json:
        backend = Backend.from_file(str(path / "tokenizer.json"))
        bos = ("<|endoftext|>", backend.token_to_id("<|endoftext|>"))
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair="$A $B", special_tokens=[bos]
        )
        backend.save(str(path / "tokenizer.json"))
    tok, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    for text in ["hi there", "你好 <|im_end|>"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text) and (ids[0] == tok.bos_token_id) == bos_in_tokenizer_json
        assert (
            tok.encode(text, add_special_tokens=False)
            == hf.encode(text, add_special_tokens=False)
            == ids[bos_in_tokenizer_json:]
        )


def test_qwen_adds_no_bos(tok):
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.bos_token_id == tok.backend.token_to_id("<|endoftext|>")  # from generation_config.json


def chats(rng):
    for turns in (1, 2, 3, 5):
        roles = ["system"] * (turns > 2) + [("user", "assistant")[i % 2] for i in range(turns - (turns > 2))]
        yield [{"role": role, "content": random_text(rng, 30)} for role in roles]


@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_matches_transformers(tok, hf, rng, thinking):
    for messages in chats(rng):
        for gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen, **thinking)
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **thinking)
        expected = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False, **thinking
        )
        assert tok.encode_chat(messages, **thinking) == expected
    if thinking == {"enable_thinking": False}:
        assert tok.apply_chat_template(messages, **thinking).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_features_as_transformers(tiny_ckpt, tmp_path):
    from transformers import AutoTokenizer

    template = (  # trim_blocks / lstrip_blocks: block lines leave no newline or indent behind
        "{% set ns = namespace(n=0) %}\n{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "{% set ns.n = ns.n + 1 %}{{ bos_token ~ m.role | upper }}: {{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
        "{{ ns.n }} {{ tools | tojson }} {{ {'k': 'ü<'} | tojson(indent=1) }}"
        "{% if add_generation_prompt %}{{ strftime_now('%Y') | length }}{% endif %}"
    )
    config = {"chat_template": template, "bos_token": "<|endoftext|>"}
    path = copy_tokenizer(tiny_ckpt, tmp_path, tokenizer_config=config)
    messages = [
        {"role": "user", "content": " a "},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "b"},
    ]
    tools = [{"name": "f", "description": "ö"}]
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, tools=tools)
    assert ours == AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours.startswith("<|endoftext|>USER: a<|im_end|>\n<|endoftext|>ASSISTANT: b<|im_end|>\n2 [{")


def test_vocab_size_and_eos_union(tiny_ckpt, tmp_path, tok, hf):
    assert tok.vocab_size == len(hf) == tok.backend.get_vocab_size(with_added_tokens=True) == 538
    im_end, endoftext = tok.backend.token_to_id("<|im_end|>"), tok.backend.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == frozenset({im_end, endoftext})  # generation_config list + config + eos_token
    path = copy_tokenizer(
        tiny_ckpt,
        tmp_path,
        generation_config={"eos_token_id": 5},
        config={"eos_token_id": [7, 8]},
        tokenizer_config={"eos_token": "<think>"},
    )
    assert Tokenizer.from_dir(path).eos_token_ids == frozenset({5, 7, 8, tok.backend.token_to_id("<think>")})
    path = copy_tokenizer(
        tiny_ckpt, tmp_path / "b", generation_config={"eos_token_id": ...}, config={"eos_token_id": ...}
    )
    assert Tokenizer.from_dir(path).eos_token_ids == frozenset({im_end})
    path = copy_tokenizer(  # the legacy special_tokens_map.json fills in what tokenizer_config.json lacks
        tiny_ckpt, tmp_path / "c", tokenizer_config={"eos_token": ...}, special_tokens_map={"eos_token": "<think>"}
    )
    assert Tokenizer.from_dir(path).eos_token_ids == frozenset({im_end, endoftext, tok.backend.token_to_id("<think>")})


def test_file_errors_name_the_file(tiny_ckpt, tmp_path):
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json")) + ": not found"):
        Tokenizer.from_dir(tmp_path)
    cases = [
        ("tokenizer.json", "{not json", "tokenizer.json: cannot be loaded"),
        ("tokenizer_config.json", "{", "tokenizer_config.json: malformed JSON"),
        ("special_tokens_map.json", "{", "special_tokens_map.json: malformed JSON"),
        ("tokenizer_config.json", "[1]", "tokenizer_config.json: expected a JSON object"),
        (
            "tokenizer_config.json",
            '{"eos_token": "<nope>"}',
            "tokenizer_config.json: eos_token '<nope>' is not a token",
        ),
        ("tokenizer_config.json", '{"eos_token": 3}', "tokenizer_config.json: eos_token must be a string"),
        (
            "tokenizer_config.json",
            '{"split_special_tokens": "yes"}',
            "tokenizer_config.json: split_special_tokens must be true or false",
        ),
        (
            "tokenizer_config.json",
            '{"chat_template": "{% for %}"}',
            "tokenizer_config.json chat_template: the chat template does not compile",
        ),
        ("generation_config.json", '{"eos_token_id": "x"}', "generation_config.json: eos_token_id must be an integer"),
        ("config.json", '{"eos_token_id": [1, true]}', "config.json: eos_token_id must be an integer"),
    ]
    for i, (name, content, message) in enumerate(cases):
        path = copy_tokenizer(tiny_ckpt, tmp_path / str(i))
        (path / name).write_text(content)
        with pytest.raises(TokenizerError, match=re.escape(message)):
            Tokenizer.from_dir(path)


def test_chat_errors(tiny_ckpt, tmp_path, tok):
    bare = Tokenizer.from_dir(copy_tokenizer(tiny_ckpt, tmp_path, tokenizer_config={"chat_template": ...}))
    assert bare.encode("hi") == tok.encode("hi")
    with pytest.raises(TokenizerError, match="the artifact has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    bad = [[{"role": "user"}], [{"role": "user", "content": "a"}, {"role": "user", "content": None}], ["hi"]]
    for index, messages in zip([0, 1, 0], bad, strict=True):
        with pytest.raises(
            TokenizerError, match=re.escape(f"messages[{index}] must be a mapping with str 'role' and 'content'")
        ):
            tok.apply_chat_template(messages)
    raising = "{{ raise_exception('only user turns, please') }}"
    path = copy_tokenizer(tiny_ckpt, tmp_path / "r", tokenizer_config={"chat_template": raising})
    with pytest.raises(
        TokenizerError, match="tokenizer_config.json chat_template: the chat template failed: only user turns"
    ):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "hi"}])
    (path / "chat_template.jinja").write_text("{{ messages[0].content }}!")  # as newer transformers saves it
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    sandboxed = "{{ messages.__class__.__mro__ }}"
    path = copy_tokenizer(tiny_ckpt, tmp_path / "s", tokenizer_config={"chat_template": sandboxed})
    with pytest.raises(TokenizerError, match="the chat template failed: .*unsafe"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_module_does_not_import_transformers():
    code = "import qruntime.tokenizer, sys; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_on_random_text(tok, rng, skip):
    assert len(tok.encode("🎉")) > 1 and len(tok.encode("你")) > 1  # characters do span tokens here
    for _ in range(40):
        text = random_text(rng)
        ids, prompt = tok.encode(text), tok.encode(random_text(rng))
        prompt = prompt[: rng.randint(0, len(prompt))]  # may end mid-character
        detok, deltas, tail = stream(tok, ids, prompt, skip_special_tokens=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == detok.text == expected, text
        assert "\ufffd" not in "".join(deltas), text  # no half character released early
        assert detok.stop_matched is None


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("日本語 and 🎉 ok")
    for cut in range(len(ids) + 1):  # output starting inside a character decodes as decode() does: with U+FFFD
        detok, deltas, tail = stream(tok, ids[cut:], ids[:cut])
        assert "".join(deltas) + tail == tok.decode(ids[cut:]), cut
    assert any(tok.decode(ids[cut:]).startswith("\ufffd") for cut in range(len(ids)))


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_on_random_ids(tok, rng, skip):
    for _ in range(40):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 60))]
        detok, deltas, tail = stream(
            tok, ids, [rng.randrange(tok.vocab_size) for _ in range(3)], skip_special_tokens=skip
        )
        assert "".join(deltas) + tail == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_window_stays_bounded(tok, rng, monkeypatch):
    widths = []
    decode = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, **kw: widths.append(len(ids)) or decode(self, ids, **kw))
    garbage = [byte_token(tok, 0x80)] * 100  # lone continuation bytes: never a complete character
    ids = tok.encode("".join(rng.choice(POOL) for _ in range(600))) + garbage + tok.encode("ok 你好")
    detok, deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == decode(tok, ids)
    assert max(widths) <= 2 * MAX_HELD_TOKENS + 1 and len(widths) < 3 * len(ids)
    assert deltas[-1] == "好" and "\ufffd" * 100 in detok.text


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("The answer is 42. END OF STORY, and more")
    assert not any("END OF" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], stop=["END OF"])
    deltas = [detok.add(i) for i in ids]
    assert detok.stop_matched == "END OF" and "".join(deltas) == detok.text == "The answer is 42. "
    assert deltas[-1] == "" and detok.flush() == "" and detok.text == "The answer is 42. "


def test_stop_string_at_start_and_never(tok):
    detok, deltas, tail = stream(tok, tok.encode("STOP right there"), stop=["STOP"])
    assert (detok.stop_matched, detok.text, set(deltas), tail) == ("STOP", "", {""}, "")
    detok, deltas, tail = stream(tok, tok.encode("wait for zz"), stop=["zzz", "never"])
    assert ("".join(deltas), tail, detok.text, detok.stop_matched) == ("wait for ", "zz", "wait for zz", None)


def test_earliest_stop_wins(tok):
    for stops in (["four", "two"], ["two", "four"]):
        detok, deltas, _ = stream(tok, tok.encode("one two three four"), stop=stops)
        assert (detok.stop_matched, "".join(deltas), detok.text) == ("two", "one ", "one ")
    # both complete inside one token: the one a stream would see first ("t" ends before "return") wins
    assert len(tok.encode(" return")) == 1
    for stops in (["return", "t"], ["t", "return"]):
        detok, _, _ = stream(tok, tok.encode("x return y"), stop=stops)
        assert (detok.stop_matched, detok.text) == ("t", "x re")
    detok, _, _ = stream(tok, tok.encode("x return y"), stop=["return", "ret"])  # same end: the longer
    assert (detok.stop_matched, detok.text) == ("ret", "x ")


def test_random_stop_strings(tok, rng):
    for _ in range(40):
        ids = tok.encode(random_text(rng))
        full = tok.decode(ids)
        stops = ["never-in-here"]
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(full) + 1)
            stops.append(full[start : start + rng.randint(1, 6)] or "absent")
        hits = [(i + len(s), i, s) for s in stops if (i := full.find(s)) >= 0]
        end, cut, matched = min(hits) if hits else (None, len(full), None)
        detok, deltas, tail = stream(tok, ids, stop=stops)
        assert (detok.stop_matched, "".join(deltas) + tail, detok.text) == (matched, full[:cut], full[:cut]), stops


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hello<|im_end|>world<think>x</think><|endoftext|>")
    detok, deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == "helloworld<think>x</think>"  # <think> is an added token, not a special one
    detok, deltas, tail = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "hello<|im_end|>world<think>x</think><|endoftext|>"
    detok, deltas, tail = stream(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert (detok.stop_matched, detok.text, tail) == ("<|im_end|>", "hello", "")


def test_detokenizer_misuse(tok):
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])
    detok = IncrementalDetokenizer(tok, [])
    assert detok.flush() == "" and detok.text == ""
    with pytest.raises(RuntimeError, match="flush"):
        detok.add(1)


@pytest.mark.parametrize("split", [False, True])
def test_a_pickled_tokenizer_is_the_same_tokenizer(tiny_ckpt, tmp_path, rng, split):
    """The server's engine process sends its tokenizer to the HTTP process by pickle: the copy
    encodes, decodes and renders chats as the original does, split_special_tokens included."""
    import pickle

    copy_tokenizer(tiny_ckpt, tmp_path, tokenizer_config={"split_special_tokens": split})
    original = Tokenizer.from_dir(tmp_path)
    copy = pickle.loads(pickle.dumps(original))
    assert copy.backend.encode_special_tokens is split
    assert (copy.eos_token_ids, copy.bos_token_id, dict(copy.special_tokens)) == (
        original.eos_token_ids,
        original.bos_token_id,
        dict(original.special_tokens),
    )
    for _ in range(20):
        text = random_text(rng) + rng.choice(["", "<|im_end|>", "<|endoftext|>"])
        ids = original.encode(text)
        assert copy.encode(text) == ids and copy.decode(ids) == original.decode(ids)
    messages = [{"role": "user", "content": random_text(rng)}]
    assert copy.apply_chat_template(messages, enable_thinking=False) == original.apply_chat_template(
        messages, enable_thinking=False
    )
    assert copy.template_source == original.template_source and copy.chat_template_text


def test_stop_strings_are_looked_for_only_after_min_tokens(tok, rng):
    """As vLLM's detokenizer: the text of the first min_tokens tokens is never matched; the first stop
    string in the text of a later token ends the output there."""
    ids = tok.encode("one stop, two stop, three stop, four")
    texts = [tok.decode(ids[: i + 1]) for i in range(len(ids))]  # the text after each token
    for min_tokens in range(len(ids)):
        detok, deltas, tail = stream(tok, ids, stop=["stop"], min_tokens=min_tokens)
        whole = "".join(deltas) + tail
        searched_from = len(texts[min_tokens - 1]) if min_tokens else 0  # text of the tokens after the first min_tokens
        at = texts[-1].find("stop", searched_from)  # a stop string wholly in that text (the matcher starts there)
        if at < 0:
            assert detok.stop_matched is None and whole == texts[-1], min_tokens
        else:
            assert detok.stop_matched == "stop" and whole == texts[-1][:at], (min_tokens, whole)
    # min_tokens 0 is the plain behaviour
    assert stream(tok, ids, stop=["stop"], min_tokens=0)[0].text == "one "
