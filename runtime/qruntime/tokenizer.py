"""The artifact's tokenizer (HF `tokenizers` + the checkpoint's Jinja chat template, no transformers)
and incremental detokenization for streaming with stop strings.

Follows transformers 5 (`TokenizersBackend`): BOS/EOS come from tokenizer.json's post-processor alone
(tokenizer_config.json's add_bos_token / add_eos_token are ignored when tokenizer.json exists, as there;
Qwen adds none); `clean_up_tokenization_spaces` is not applied (ignored for BPE there too); the chat
template renders in a sandboxed Jinja environment with `raise_exception`, `tojson` and `strftime_now`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from qruntime.bounded_json import loads
from qruntime.shown import clip
from qruntime.stop_strings import StopMatcher

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # written by newer transformers; wins over tokenizer_config's
REPLACEMENT = "\ufffd"  # what decoding makes of an incomplete UTF-8 sequence
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, as vLLM does
MAX_HELD_TOKENS = 16  # undecodable bytes held back longer than this are released as U+FFFD


class TokenizerError(ValueError):
    """Missing or malformed tokenizer files, a bad chat template or bad chat messages."""


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = loads(path.read_bytes(), what=str(path))
    except (OSError, ValueError) as exc:  # ValueError: malformed JSON, or past bounded_json's bounds
        raise TokenizerError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(config: Mapping[str, Any], key: str, path: Path) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict or null."""
    value = config.get(key)
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{path}: {key} must be a string, {{'content': str}} or null, got {config[key]!r:.100}")
    return value


def _token_ids(config: Mapping[str, Any], key: str, path: Path) -> list[int]:
    """An id field of config.json / generation_config.json: an int, a list of ints or absent."""
    value = config.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: {key} must be an integer or a list of integers, got {value!r:.100}")
    return values


def _compile_template(source: str, where: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trim/lstrip blocks)."""

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"{where}: the chat template does not compile ({exc})") from exc


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """The artifact's tokenizer: HF `tokenizers` for text <-> ids, the checkpoint's Jinja chat template."""

    backend: BackendTokenizer = field(repr=False)
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ... as the chat template sees them
    chat_template: jinja2.Template | None = field(repr=False)
    template_source: str  # where the chat template came from, for error messages
    chat_template_text: str | None = field(default=None, repr=False)  # its source, for pickling
    has_text: ClassVar[bool] = True  # TokenIdsOnly: False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled by its parts, the chat template by its source (a compiled Jinja template does not
        pickle): the server's engine process hands its tokenizer to the HTTP process so."""
        split = self.backend.encode_special_tokens  # a setting of ours, not of tokenizer.json: passed on by hand
        parts = (self.backend, split, self.eos_token_ids, self.bos_token_id, dict(self.special_tokens))
        return _rebuilt_tokenizer, (*parts, self.chat_template_text, self.template_source)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, generation_config.json and config.json from `path`."""
        root = Path(path)
        tok_path, cfg_path = root / TOKENIZER_JSON, root / TOKENIZER_CONFIG
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: not found; {root} has no tokenizer")
        try:
            backend = BackendTokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{tok_path}: cannot be loaded ({exc})") from exc
        map_path = root / "special_tokens_map.json"
        cfg, token_map = _read_json(cfg_path), _read_json(map_path)
        found_in, special = {}, {}  # special_tokens_map.json (legacy) only fills what tokenizer_config.json lacks
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            found_in[key] = cfg_path if key in cfg else map_path
            if value := _token_content(cfg if key in cfg else token_map, key, found_in[key]):
                special[key] = value

        def token_id(key: str) -> int | None:
            if key not in special:
                return None
            if (found := backend.token_to_id(special[key])) is None:
                raise TokenizerError(f"{found_in[key]}: {key} {special[key]!r} is not a token of {TOKENIZER_JSON}")
            return found

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        if not isinstance(split := cfg.get("split_special_tokens", False), bool):
            raise TokenizerError(f"{cfg_path}: split_special_tokens must be true or false, got {split!r}")
        backend.encode_special_tokens = split

        configs = _model_configs(root)
        eos_ids = set(_ids_in(configs, "eos_token_id"))
        if eos_id is not None:
            eos_ids.add(eos_id)
        if bos_id is None:  # Qwen has no BOS token; the generation config still names one (<|endoftext|>)
            bos_ids = _ids_in(configs, "bos_token_id")
            bos_id = bos_ids[0] if bos_ids else None

        template_path = root / CHAT_TEMPLATE_FILE
        source, where = cfg.get("chat_template"), f"{cfg_path} chat_template"
        if template_path.is_file():
            source, where = template_path.read_text(encoding="utf-8"), str(template_path)
        if source is not None and not isinstance(source, str):
            raise TokenizerError(f"{where} must be a Jinja template string, got {type(source).__name__}")
        template = _compile_template(source, where) if source is not None else None
        return cls(backend, frozenset(eos_ids), bos_id, special, template, where if template else str(root), source)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (config.json's vocab_size may be padded beyond it)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special tokens written in it are recognised); BOS/EOS as tokenizer.json adds them.

        TokenizerError for what is not text: a non-str, or a str holding a lone surrogate."""
        if not isinstance(text, str):
            raise TokenizerError(f"can only tokenize text (got {type(text).__name__})")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(
                f"the text holds a lone surrogate ({exc.object[exc.start]!a} at character {exc.start}), which is not text"
            ) from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a multi-byte character is not text on its own):
        its byte-level BPE piece mapped back through GPT-2's byte alphabet, Qwen's; a piece outside
        that alphabet (another kind of vocabulary) gives its decoded text's UTF-8."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render `messages` ({'role': str, 'content': str, ...}) with the chat template.

        `template_kwargs` become template variables too (e.g. enable_thinking=False, tools=[...]).
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.template_source}: the artifact has no chat template "
                f"(no chat_template in {TOKENIZER_CONFIG}, no {CHAT_TEMPLATE_FILE})"
            )
        checked = []
        for index, message in enumerate(messages):
            # an assistant message that only calls tools may have no content (OpenAI's null)
            content = message.get("content") if isinstance(message, Mapping) else None
            if not (
                isinstance(message, Mapping)
                and isinstance(message.get("role"), str)
                and (isinstance(content, str) or (content is None and message.get("tool_calls")))
            ):
                raise TokenizerError(
                    f"messages[{index}] must be a mapping with str 'role' and 'content' (or tool_calls), got {message!r:.100}"
                )
            checked.append(dict(message))
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        try:
            return self.chat_template.render(variables, messages=checked, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"{self.template_source}: the chat template failed: {clip(str(exc), 200)}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
            # what the messages or template variables make the template's own expressions raise
            raise TokenizerError(
                f"{self.template_source}: the chat template failed on these messages "
                f"({type(exc).__name__}: {clip(str(exc), 200)})"
            ) from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Ids of the rendered chat (the template writes its own special tokens, so none are added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kw), add_special_tokens=False)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte (byte-level BPE), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _model_configs(root: Path) -> list[tuple[dict[str, Any], Path]]:
    """generation_config.json then config.json ({} when absent), each with its path."""
    return [(_read_json(path), path) for path in (root / "generation_config.json", root / "config.json")]


def _ids_in(configs: list[tuple[dict[str, Any], Path]], key: str) -> list[int]:
    """The ids `key` names in each config, in order."""
    return [i for config, path in configs for i in _token_ids(config, key, path)]


def _rebuilt_tokenizer(
    backend: BackendTokenizer,
    split_special_tokens: bool,
    eos_token_ids: frozenset[int],
    bos_token_id: int | None,
    special_tokens: dict[str, str],
    template_text: str | None,
    template_source: str,
) -> Tokenizer:
    backend.encode_special_tokens = split_special_tokens
    template = _compile_template(template_text, template_source) if template_text is not None else None
    return Tokenizer(backend, eos_token_ids, bos_token_id, special_tokens, template, template_source, template_text)


@dataclass(frozen=True)
class TokenIdsOnly:
    """Stands in for the tokenizer of an artifact compiled with --no-tokenizer (manifest "tokenizer":
    false), as vLLM's skip_tokenizer_init: prompts are token ids, outputs are token ids with empty
    text, generation stops at the EOS ids of generation_config.json / config.json; text prompts, chat
    and stop strings are refused with a TokenizerError saying why."""

    eos_token_ids: frozenset[int]
    source: str  # the artifact, for error messages
    bos_token_id: int | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    has_text: ClassVar[bool] = False

    @classmethod
    def from_dir(cls, path: str | Path) -> TokenIdsOnly:
        root = Path(path)
        return cls(frozenset(_ids_in(_model_configs(root), "eos_token_id")), str(root))

    def _refuse(self, what: str) -> NoReturn:
        raise TokenizerError(
            f"{self.source} has no tokenizer (compiled with --no-tokenizer): {what}; give prompts as token ids"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._refuse("text cannot be tokenized")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *args: Any, **kwargs: Any) -> str:
        self._refuse("there is no chat template")

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *args: Any, **kwargs: Any) -> list[int]:
        self._refuse("there is no chat template")


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive, for streaming, with stop strings.

    Each step decodes a short window: the tokens since the last point where the text was complete,
    after the chunk before it as context (vLLM's prefix/read offsets), so characters spanning tokens
    come out whole and long outputs cost O(1) per token. Text that may begin a stop string is held
    back until it cannot. The earliest stop string to complete wins (on a tie, the one starting first);
    finding it costs O(new text) per token, whatever the number of stop strings (stop_strings.py).
    With `min_tokens`, stop strings are looked for only in the text of the output tokens after the
    first min_tokens (as vLLM's detokenizer, since its PR 22014): earlier text is released as it comes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | TokenIdsOnly,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        stops = tuple(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r:.200}")
        self._stops = StopMatcher(stops) if stops else None
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        context = [int(i) for i in prompt_ids[-CONTEXT_TOKENS:]]
        prefix = self._decode(context)
        if prefix.endswith(REPLACEMENT):  # a prompt ending mid-character would swallow the output's first bytes
            context, prefix = [], ""
        self._ids = context  # window: context chunk, then tokens since the text was last complete
        self._read = len(context)  # where the context chunk ends in self._ids
        self._prefix_len = len(prefix)  # characters the context chunk decodes to
        self._sent = 0  # characters after the context already passed on while the window is held
        self._pending = ""  # released by decoding, held back as a possible stop-string prefix
        self._parts: list[str] = []
        self._done = False
        self._added = 0  # output tokens taken
        self._min_tokens = min_tokens
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        """The output text released so far (everything, after flush()); never contains a stop string."""
        return "".join(self._parts)

    def add(self, token_id: int) -> str:
        """Take the next output token; return the text it makes final ("" while text is held back)."""
        if self._done:
            raise RuntimeError("flush() has ended this request; no more tokens can be added")
        if self.stop_matched is not None:
            return ""
        self._ids.append(int(token_id))
        self._added += 1
        return self._release(self._step(final=False), final=False)

    def flush(self) -> str:
        """End the request: release the text still held back (up to a stop string, if one completes)."""
        ended, self._done = self._done or self.stop_matched is not None, True
        return "" if ended else self._release(self._step(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _step(self, final: bool) -> str:
        """The new decoded text; holds back a trailing U+FFFD, which may be a character still arriving."""
        text = self._decode(self._ids)
        start = self._prefix_len + self._sent
        if not final and text.endswith(REPLACEMENT) and len(self._ids) - self._read < MAX_HELD_TOKENS:
            new = text.rstrip(REPLACEMENT)[start:]
            self._sent += len(new)
            return new
        # the text is complete here: the tokens since the context become the next window's context
        del self._ids[: self._read]
        self._read, self._sent = len(self._ids), 0
        self._prefix_len = len(self._decode(self._ids))
        return text[start:]

    def _release(self, new: str, final: bool) -> str:
        buffer = self._pending + new  # _pending: the characters the matcher holds (held) before `new`
        matching = self._stops is not None and self._added > self._min_tokens
        hit = self._stops.feed(new) if matching else None
        if hit is not None:
            end, length = hit
            end += len(self._pending)
            cut = end - length
            self.stop_matched = buffer[cut:end]
            out, self._pending = buffer[:cut], ""
        else:
            keep = 0 if final or not matching else self._stops.held
            out, self._pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        if out:
            self._parts.append(out)
        return out
