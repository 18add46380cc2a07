"""Request bodies of /v1/completions and /v1/chat/completions -> engine sequences, or a 4xx APIError
naming the field. Prompts are tokenized here (the tokenizer is immutable, so any thread may use it),
which lets every limit be checked before a request reaches the engine thread.

Defaults follow OpenAI: temperature 1, top_p 1, n 1; max_tokens 16 for completions (capped by the
room the prompt leaves) and all of that room for chat. Extensions as in vLLM: top_k, ignore_eos,
stop_token_ids, skip_special_tokens, return_token_ids, chat_template_kwargs. With n > 1 and a seed,
choice j samples with seed + j. Unknown fields are ignored; known ones the engine cannot honour
(the deprecated functions, ...) are refused rather than silently dropped. Structured output: `response_format` {"type": "json_object"} or {"type": "json_schema",
"json_schema": {"schema": ...}} and vLLM's guided_json / guided_regex / guided_choice /
guided_grammar (one per request; engine/structured.py, llguidance), compiled here first so a
constraint that does not compile is a 400 naming its field.
Chat `tools` (tool_choice "auto", the default with tools) are rendered through the artifact's chat
template and the replies' <tool_call> blocks come back as tool_calls (qruntime.tool_calls). Completions' best_of b >= n
generates b sequences per prompt and returns the n with the highest mean token logprob (OpenAI's
"highest log probability per token"; not streamed when b > n). `max_thinking_tokens` (this
server's extra) caps each <think> block: after that many tokens in it, the next is </think>.
Chat content parts: text parts are joined. Image parts (OpenAI's image_url, data URLs) are taken
by a Qwen3-VL model (ServedModel.vision; serve/images.py: checked, then decoded and preprocessed
here, each image's tokens expanded in the prompt, the pixel values sent with its sequences); a
text-only model checks them (qruntime.vision.prompt) and then refuses them.

Logprobs: completions' `logprobs` k, chat's `logprobs` + `top_logprobs` k (0 to 20), and completions'
`echo` (the prompt's text, and with logprobs its tokens' logprobs, before the completion's); they
are the model's raw logprobs (engine/logprobs.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qruntime.engine.sampling_params import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams
from qruntime.engine.structured import StructuredOutput, StructuredOutputError
from qruntime.reasoning import prompt_opens_thinking
from qruntime.serve.errors import APIError, invalid
from qruntime.serve.images import (
    ServedVision,
    check_no_vision_tokens,
    expand_chat_ids,
    load_chat_images,
    split_chat_images,
)
from qruntime.serve.limits import RequestLimits
from qruntime.shown import shown
from qruntime.tokenizer import TokenIdsOnly, Tokenizer, TokenizerError
from qruntime.vision.preprocess import DecodedImages
from qruntime.vision.prompt import ImageLimits, PromptImageError, split_images
from qruntime.vision.prompt_images import probe_images

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 1 << 63

# field -> the values that mean "off"; anything else asks for something the engine does not do
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # the deprecated forms of tools / tool_choice
    "function_call": (None, "none", "auto"),
}


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's extras
OPEN_TAIL_TOKENS = 8  # the prompt's last tokens, decoded to see whether its template opened a <think> block
REASONING_PARSERS = ("qwen3",)
# template variables the server sets itself; chat_template_kwargs may set any other
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})
# a text-only model's image parts are checked (and then refused) within these; a client's image is
# never a local path, and the body cap (--max-body-bytes) bounds the bytes first
IMAGE_LIMITS = ImageLimits(allow_local_files=False)


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against; immutable, so shared freely with the HTTP side."""

    name: str
    tokenizer: Tokenizer | TokenIdsOnly
    vocab_size: int
    max_model_len: int
    created: int  # unix time the server started, /v1/models's `created`
    max_sequences: int  # most sequences (prompts x n) one request may ask for: the server's --max-waiting
    limits: RequestLimits = RequestLimits()
    reasoning_parser: str | None = None  # --reasoning-parser: "qwen3" splits chat replies' <think> blocks off
    vision: ServedVision | None = None  # a Qwen3-VL model's image settings (None: text-only, images refused)


@dataclass(frozen=True)
class SequenceSpec:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    vision: DecodedImages | None = None  # the prompt's images (decoded, CPU), whose tokens prompt_ids holds


@dataclass(frozen=True)
class GenerationRequest:
    """A parsed request: its sequences (n per prompt, choice index = prompt_index * n + j)."""

    chat: bool
    sequences: tuple[SequenceSpec, ...]
    prompt_lens: tuple[int, ...]  # tokens of each prompt, for `usage`
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    return_token_ids: bool
    reasoning: bool = False  # chat replies' thinking returned apart, as reasoning_content (qruntime.reasoning)
    thinking_opened: bool = False  # the rendered prompt ends in an open <think>: replies start in the block
    logprobs: int | None = None  # top logprobs per token to return (None: no logprobs)
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    n: int = 1  # choices returned per prompt
    tools: bool = False  # chat with tools (tool_choice auto): replies' <tool_call> blocks come back as tool_calls
    parallel_tool_calls: bool = True  # False: a reply's first call only
    best_of: int = 1  # sequences generated per prompt (>= n): the n likeliest are returned (completions)
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's logprob, rank and top k (None: none)
    images: int = 0  # images in the request's prompt (a Qwen3-VL model's chat)


# --- fields ---------------------------------------------------------------------------------------
def _int(body: Mapping[str, Any], name: str, default: int | None, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} must be an integer (got {shown(value)})", "invalid_type")
    if minimum is not None and value < minimum:
        raise invalid(name, f"{name} must be >= {minimum} (got {value})")
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"{name} must be a number (got {shown(value)})", "invalid_type")
    if not math.isfinite(value):
        raise invalid(name, f"{name} must be a finite number (got {value})")
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be a boolean (got {shown(value)})", "invalid_type")
    return value


def _stop(body: Mapping[str, Any], limits: RequestLimits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", f"stop must be a non-empty string or a list of them (got {shown(value)})", "invalid_type")
    if len(stops) > limits.max_stop:
        raise invalid("stop", f"stop has {len(stops)} strings; this server takes at most {limits.max_stop}")
    if (chars := sum(map(len, stops))) > limits.max_stop_chars:
        raise invalid(
            "stop", f"the stop strings hold {chars} characters; this server takes at most {limits.max_stop_chars}"
        )
    return tuple(stops)


def _logit_bias(body: Mapping[str, Any], model: ServedModel) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias}, at most max_logit_bias entries, ids in the vocabulary
    (SamplingParams checks the biases' range)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise invalid(
            "logit_bias", f"logit_bias must be an object of token id -> bias (got {shown(value)})", "invalid_type"
        )
    if len(value) > model.limits.max_logit_bias:
        raise invalid(
            "logit_bias",
            f"logit_bias has {len(value)} entries; this server takes at most {model.limits.max_logit_bias}",
        )
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= model.vocab_size:
            raise invalid(
                "logit_bias",
                f"logit_bias: {shown(key)} is not a token id (the vocabulary is ids 0..{model.vocab_size - 1})",
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise invalid(
                "logit_bias", f"logit_bias[{shown(key)}] must be a number (got {shown(bias)})", "invalid_type"
            )
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _int_list(body: Mapping[str, Any], name: str, most: int, below: int | None = None) -> tuple[int, ...]:
    """A list of at most `most` integers in [0, below)."""
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise invalid(name, f"{name} must be a list of non-negative integers (got {shown(value)})", "invalid_type")
    if len(value) > most:
        raise invalid(name, f"{name} has {len(value)} entries; this server takes at most {most}")
    if below is not None and (too_big := [v for v in value if v >= below]):
        raise invalid(name, f"{name}: {shown(too_big[0])} is not a token id (the vocabulary is ids 0..{below - 1})")
    return tuple(value)


def check_model(body: Mapping[str, Any], model: ServedModel) -> None:
    """`model` may be omitted; given, it must be the served model's id (else 404, as OpenAI and vLLM)."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise invalid("model", f"model must be a string (got {shown(name)})", "invalid_type")
    if name != model.name:
        raise APIError(
            404, f"The model `{name}` does not exist; this server serves `{model.name}`.", "model", "model_not_found"
        )


def _check_unsupported(body: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]]) -> None:
    for name, allowed in table.items():
        value = body.get(name)
        if value is not None and not any(
            value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in allowed
        ):
            raise invalid(name, f"{name}={shown(value)} is not supported by this server", "unsupported")


# --- prompts --------------------------------------------------------------------------------------
def _check_ids(ids: list[int], model: ServedModel, param: str) -> list[int]:
    if not ids:
        raise invalid(param, f"{param} is empty (no tokens)")
    if min(ids) >= 0 and max(ids) < model.vocab_size:
        return ids  # the common case, checked at C speed: a 2,000-token prompt's loop took ~0.3 ms
    for position, token in enumerate(ids):
        if not 0 <= token < model.vocab_size:
            raise invalid(
                param,
                f"{param}: unknown token id {token} at position {position} (the vocabulary is ids 0..{model.vocab_size - 1})",
            )
    return ids


def completion_prompts(value: Any, model: ServedModel) -> list[list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of lists of token ids."""

    def is_ids(item: Any) -> bool:
        return isinstance(item, list) and {int}.issuperset(map(type, item))  # ints, not bools

    if value is None:
        raise invalid("prompt", "prompt is required", "missing")
    if isinstance(value, str) or is_ids(value) and value:
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_ids(p) for p in value):
        items = value
    else:
        raise invalid(
            "prompt",
            f"prompt must be a string, a list of strings, a list of token ids or a list of such lists (got {shown(value)})",
            "invalid_type",
        )
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise invalid("prompt", "prompt is an empty string")
            try:
                item = model.tokenizer.encode(item)
            except TokenizerError as exc:
                raise invalid("prompt", str(exc)) from None
        prompts.append(_check_ids(list(item), model, "prompt"))
        if model.vision is not None:
            check_no_vision_tokens(prompts[-1], model.vision, "prompt")
    return prompts


def _text_content(content: Any, index: int) -> Any:
    """A message's content as text: a string, or a list of {"type": "text", "text": str} parts."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise invalid("messages", f"messages[{index}].content: only text parts are supported (got {shown(part)})")
        texts.append(part["text"])
    return "".join(texts)


def _refuse_images(messages: list[Any], model: ServedModel) -> None:
    """A 400 for content parts other than text. The served models are text-only, so image parts
    are refused; each is checked first (qruntime.vision.prompt: its shape, data URL, base64, bytes,
    count, header and pixels, no pixel decoded) so that a malformed one is named as such."""
    if not any(
        isinstance(m, Mapping)
        and isinstance(m.get("content"), list)
        and any(not (isinstance(p, Mapping) and p.get("type") == "text") for p in m["content"])
        for m in messages
    ):
        return
    text_only = "this model does not take images: send text parts only"
    try:
        split = split_images(messages, IMAGE_LIMITS)
        with contextlib.suppress(ImportError):  # no Pillow (the `vision` extra): the headers go unread
            probe_images(split, IMAGE_LIMITS)
    except PromptImageError as exc:
        raise invalid("messages", f"{exc}; besides, {text_only}") from None
    first = split.images[0].where if split.images else "messages"
    raise invalid("messages", f"{first} is an image, and {text_only} ({model.name} is a text-only model)")


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names


def _tools(body: Mapping[str, Any], model: ServedModel) -> tuple[list[Any] | None, bool, StructuredOutput | None]:
    """(the tools to render in the prompt, whether replies are parsed for calls, the constraint on
    the reply), from `tools` and `tool_choice`: "auto" (the default with tools) renders and parses,
    "none" neither; "required" and a named function render, parse and constrain the reply to calls
    (of any tool, or of that one)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", f"tools must be a list of function tools (got {shown(tools)})", "invalid_type")
        if len(tools) > model.limits.max_tools:
            raise invalid(
                "tools", f"tools has {len(tools)} entries; this server takes at most {model.limits.max_tools}"
            )
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
                raise invalid(
                    "tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}} (got {shown(tool)})"
                )
            name = function.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise invalid(
                    "tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ or - (got {shown(name)})"
                )
            if not isinstance(function.get("description", ""), str):
                raise invalid("tools", f"tools[{i}].function.description must be a string", "invalid_type")
            if not isinstance(function.get("parameters", {}), Mapping):
                raise invalid("tools", f"tools[{i}].function.parameters must be a JSON schema object", "invalid_type")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None, False, None
    if choice == "auto":
        return (tools or None), bool(tools), None
    named = None
    if isinstance(choice, Mapping):
        function = choice.get("function")
        named = function.get("name") if choice.get("type") == "function" and isinstance(function, Mapping) else None
        if not isinstance(named, str):
            raise invalid(
                "tool_choice",
                f"a named tool_choice is {{'type': 'function', 'function': {{'name': ...}}}} (got {shown(choice)})",
            )
    elif choice != "required":
        raise invalid(
            "tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function (got {shown(choice)})"
        )
    if not tools:
        raise invalid("tool_choice", f"tool_choice={shown(choice)} needs tools")
    return tools, True, _tool_call_grammar(tools, named, _bool(body, "parallel_tool_calls", True), model)


def _tool_calls(calls: Any, index: int) -> list[Mapping[str, Any]]:
    """An assistant message's tool_calls, as the template renders them."""
    if not isinstance(calls, list):
        raise invalid("messages", f"messages[{index}].tool_calls must be a list (got {shown(calls)})", "invalid_type")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, str | Mapping):
            raise invalid(
                "messages",
                f"messages[{index}].tool_calls[{k}] must be {{'function': {{'name': str, 'arguments': str}}}} (got {shown(call)})",
            )
    return calls


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: token ids (each image's tokens expanded) and its images' inputs."""

    ids: list[int]
    vision: DecodedImages | None = None
    images: int = 0


def chat_prompt(body: Mapping[str, Any], model: ServedModel, tools: list[Any] | None = None) -> ChatPrompt:
    """`messages` rendered with the artifact's chat template (plus chat_template_kwargs and `tools`).
    For a Qwen3-VL model (model.vision) each image part becomes the image's tokens, checked in this
    order (serve/images.py): the parts and the images' headers, the prompt's length with the images'
    tokens against max_model_len, then the images decoded and preprocessed."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid(
            "messages", f"messages must be a non-empty list of {{role, content}} objects (got {shown(messages)})"
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise invalid(
            "chat_template_kwargs", f"chat_template_kwargs must be an object (got {shown(kwargs)})", "invalid_type"
        )
    if reserved := sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys()):
        raise invalid(
            "chat_template_kwargs",
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them from the request",
        )
    images = None
    if model.vision is None:
        _refuse_images(messages, model)
    else:  # as Engine.chat: add_vision_id labels the images, and is not the template's to see
        if "add_vision_id" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "add_vision_id"}
            add_vision_id = bool(body["chat_template_kwargs"]["add_vision_id"])
        else:
            add_vision_id = False
        images = split_chat_images(messages, model.vision, add_vision_id=add_vision_id)
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise invalid("messages", f"messages[{index}] must be an object (got {shown(message)})", "invalid_type")
        content = images.split.messages[index]["content"] if images is not None else message.get("content")
        entry = {**message, "content": _text_content(content, index)}
        if message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], index)
        rendered.append(entry)
    if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    try:
        ids = model.tokenizer.encode_chat(rendered, **kwargs)
    except TokenizerError as exc:
        raise invalid("messages", str(exc)) from None
    if images is None:
        return ChatPrompt(_check_ids(ids, model, "messages"))
    if not images.split.images:
        return ChatPrompt(_check_ids(expand_chat_ids(ids, None, model.vision), model, "messages"))
    _check_length(len(ids) - len(images.token_counts) + sum(images.token_counts), model)  # before any decoding
    inputs = load_chat_images(images, model.vision)
    return ChatPrompt(
        _check_ids(expand_chat_ids(ids, inputs, model.vision), model, "messages"), inputs, len(images.token_counts)
    )


def _check_length(prompt_len: int, model: ServedModel) -> None:
    """A 400 for a prompt that leaves no room to generate (its images' tokens counted)."""
    if prompt_len >= model.max_model_len:
        raise invalid(
            "messages",
            f"This model's maximum context length is {model.max_model_len} tokens (max_model_len), and the prompt "
            f"with its images has {prompt_len} tokens: at most {model.max_model_len - 1} leave room to generate. "
            "Send fewer or smaller images, or shorten the prompt.",
            "context_length_exceeded",
        )


# --- whole requests -------------------------------------------------------------------------------
def _max_tokens(
    requested: int | None, default: int | None, prompt_len: int, model: ServedModel, param: str, max_param: str
) -> int:
    """max_tokens for one prompt: the request's, or the default capped by the room left; 400 past max_model_len."""
    limit = model.max_model_len
    if prompt_len >= limit:
        raise invalid(
            param,
            f"This model's maximum context length is {limit} tokens (max_model_len), and the prompt has {prompt_len} "
            f"tokens: at most {limit - 1} leave room to generate. Shorten the prompt.",
            "context_length_exceeded",
        )
    room = limit - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > limit:
        raise invalid(
            max_param,
            f"This model's maximum context length is {limit} tokens (max_model_len), but {prompt_len + requested} "
            f"were requested ({prompt_len} in the prompt, {requested} for {max_param}). Lower {max_param} to at most "
            f"{room} or shorten the prompt.",
            "context_length_exceeded",
        )
    return requested


def _build(
    body: Mapping[str, Any],
    prompts: list[list[int]],
    max_param: str,
    requested_max: int | None,
    default_max: int | None,
    model: ServedModel,
    *,
    chat: bool,
    constraint: StructuredOutput | None = None,
    vision: DecodedImages | None = None,
) -> GenerationRequest:
    """`constraint`: the one tool_choice sets (required / a named function), besides which the body
    may set no other. `vision`: the (one) prompt's images, sent with each of its sequences."""
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise invalid("temperature", f"temperature must be >= 0 (got {temperature:g})")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise invalid("top_p", f"top_p must be in (0, 1] (got {top_p:g})")
    top_k = _int(body, "top_k", 0, minimum=-1)  # vLLM's -1 = off, as 0 here
    seed = _int(body, "seed", None, minimum=0)
    if seed is not None and seed >= MAX_SEED:
        raise invalid("seed", f"seed must be < 2**63 (got {seed})")
    n = _int(body, "n", 1, minimum=1)
    if n > model.limits.max_n:
        raise invalid("n", f"n must be <= {model.limits.max_n} (got {n})")
    stream = _bool(body, "stream", False)
    best_of = n if chat else _best_of(body, n, stream, model)
    if best_of * len(prompts) > model.max_sequences:
        name = "best_of" if best_of > n else "n"
        raise invalid(
            name,
            f"the request asks for {best_of * len(prompts)} sequences (prompts x {name}), more than the "
            f"{model.max_sequences} this server queues at once (--max-waiting)",
        )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise invalid("stream_options", f"stream_options must be an object (got {shown(options)})", "invalid_type")
    include_usage = _bool(options or {}, "include_usage", False)
    shared = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": max(top_k, 0),
        "stop": _stop(body, model.limits),
        "stop_token_ids": _int_list(body, "stop_token_ids", model.limits.max_stop_token_ids, model.vocab_size),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "skip_special_tokens": _bool(body, "skip_special_tokens", True),
        "min_p": _number(body, "min_p", 0.0),
        "min_tokens": _int(body, "min_tokens", 0, minimum=0),
        "logit_bias": _logit_bias(body, model),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),  # vLLM's extra
        "max_thinking_tokens": _int(body, "max_thinking_tokens", None, minimum=0),  # ours: a cap on <think> blocks
        "structured": _constraint(body, constraint),
    }
    return_token_ids = _bool(body, "return_token_ids", False)
    logprobs = _logprobs(body, chat)
    echo = not chat and _bool(body, "echo", False)
    if echo and stream and logprobs is not None:
        raise invalid(
            "echo", "echo with logprobs is not supported when streaming (the prompt's logprobs come at the end)"
        )
    shared["logprobs"] = logprobs if best_of == n or logprobs is not None else 0  # best_of ranks by them
    prompt_k = _prompt_logprobs(body, stream)
    wanted = [k for k in (logprobs if echo else None, prompt_k) if k is not None]
    shared["prompt_logprobs"] = max(wanted) if wanted else None
    param = "messages" if chat else "prompt"
    sequences = []
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(requested_max, default_max, len(ids), model, param, max_param)
        for j in range(best_of):
            try:
                params = SamplingParams(max_tokens=max_tokens, seed=None if seed is None else seed + j, **shared)
            except InvalidSamplingParams as exc:  # what the field checks above let through, by its field
                raise invalid(exc.problems[0].field, str(exc.problems[0])) from None
            except ValueError as exc:
                raise invalid(None, str(exc)) from None
            sequences.append(SequenceSpec(p * best_of + j, p, tuple(ids), params, vision))
    return GenerationRequest(
        chat,
        tuple(sequences),
        tuple(map(len, prompts)),
        stream,
        include_usage,
        return_token_ids,
        logprobs=logprobs,
        echo=echo,
        n=n,
        best_of=best_of,
        prompt_logprobs=prompt_k,
    )


def _constraint(body: Mapping[str, Any], from_tools: StructuredOutput | None) -> StructuredOutput | None:
    structured = _structured(body)
    if from_tools is not None and structured is not None:
        raise invalid(
            "tool_choice", "tool_choice required or a named function constrains the reply: no other constraint with it"
        )
    return from_tools or structured


def _tool_call_grammar(tools: list[Any], name: str | None, parallel: bool, model: ServedModel) -> StructuredOutput:
    """The Lark grammar (llguidance) of replies that are tool calls only: one or more of any tool
    (`name` None: tool_choice required; one when not `parallel`), or one call of the named tool;
    each call a <tool_call> block of {"name", "arguments"} JSON, the arguments per the tool's schema."""
    shapes = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        shapes.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": function.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not shapes:
        raise invalid("tool_choice", f"tool_choice names {shown(name)}, which is not one of the tools")
    schema = {**(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}), "x-guidance": {"whitespace_flexible": False}}
    backend = getattr(model.tokenizer, "backend", None)
    # the tags are tokens of Qwen3's vocabulary: named so, the grammar takes the token, not its spelling
    tags = [
        t if backend is not None and backend.token_to_id(t) is not None else json.dumps(t)
        for t in ("<tool_call>", "</tool_call>")
    ]
    repeat = "+" if name is None and parallel else ""
    lark = f'start: call{repeat}\ncall: {tags[0]} "\\n" %json {json.dumps(schema)} "\\n" {tags[1]}\n'
    constraint = StructuredOutput("grammar", lark)
    try:
        constraint.grammar()
    except StructuredOutputError as exc:
        raise invalid("tools", f"the tools' parameters do not make a grammar: {exc}") from None
    return constraint


def _structured(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's output constraint: response_format or one of vLLM's guided_* fields (a 400
    naming the field when it is malformed or does not compile)."""
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    response_format = body.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, Mapping) and response_format.get("type") == "text"
    ):
        given.append("response_format")
    if not given:
        return None
    if len(given) > 1:
        raise invalid(given[1], f"one output constraint per request (got {', '.join(given)})")
    name = given[0]
    value = body[name]
    try:
        if name == "response_format":
            kind = value.get("type") if isinstance(value, Mapping) else None
            if kind == "json_object":
                constraint = StructuredOutput("json_object")
            elif kind == "json_schema" and isinstance(value.get("json_schema"), Mapping):
                schema = value["json_schema"].get("schema", {})
                if not isinstance(schema, Mapping | bool):
                    raise invalid(
                        name, "response_format.json_schema.schema must be a JSON schema object", "invalid_type"
                    )
                constraint = StructuredOutput("json_schema", json.dumps(schema))
            else:
                raise invalid(
                    name,
                    f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}} (got {shown(value)})",
                )
        elif name == "guided_json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, Mapping | bool):
                raise invalid(name, f"guided_json must be a JSON schema (got {shown(value)})", "invalid_type")
            constraint = StructuredOutput("json_schema", json.dumps(schema))
        elif name == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise invalid(name, f"guided_choice must be a non-empty list of non-empty strings (got {shown(value)})")
            constraint = StructuredOutput("choice", tuple(value))
        else:
            if not isinstance(value, str) or not value:
                raise invalid(name, f"{name} must be a non-empty string (got {shown(value)})", "invalid_type")
            constraint = StructuredOutput("regex" if name == "guided_regex" else "grammar", value)
        constraint.grammar()  # a check here, on the HTTP side: the engine's own compile is cached by constraint
    except (StructuredOutputError, ValueError) as exc:
        raise invalid(name, f"{name}: {exc}") from None
    return constraint


def _best_of(body: Mapping[str, Any], n: int, stream: bool, model: ServedModel) -> int:
    """Completions' best_of: sequences per prompt, n by default; more than n cannot be streamed."""
    best_of = _int(body, "best_of", n, minimum=1)
    if best_of < n:
        raise invalid("best_of", f"best_of must be >= n ({n}) (got {best_of})")
    if best_of > model.limits.max_n:
        raise invalid("best_of", f"best_of must be <= {model.limits.max_n} (got {best_of})")
    if stream and best_of > n:
        raise invalid(
            "best_of", "best_of > n cannot be streamed: the best are known only when every sequence has ended"
        )
    return best_of


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """Top logprobs per token: completions' `logprobs` k; chat's `top_logprobs` k when `logprobs` is
    true (0 without it, as OpenAI). None: no logprobs."""
    name = "top_logprobs" if chat else "logprobs"
    if chat and not _bool(body, "logprobs", False):
        if body.get("top_logprobs") is not None:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    k = _int(body, name, 0 if chat else None, minimum=0)
    if k is not None and k > MAX_LOGPROBS:
        raise invalid(name, f"{name} must be <= {MAX_LOGPROBS} (got {k})")
    return k


def _prompt_logprobs(body: Mapping[str, Any], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` k: every prompt token's logprob, rank and the k likeliest (None: none)."""
    k = _int(body, "prompt_logprobs", None, minimum=0)
    if k is not None and k > MAX_LOGPROBS:
        raise invalid("prompt_logprobs", f"prompt_logprobs must be <= {MAX_LOGPROBS} (got {k})")
    if k is not None and stream:
        raise invalid(
            "prompt_logprobs", "prompt_logprobs is not supported when streaming (the prompt's logprobs come at the end)"
        )
    return k


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise invalid(None, f"the request body must be a JSON object (got {type(body).__name__})", "invalid_type")
    return body


def parse_completion(body: Any, model: ServedModel) -> GenerationRequest:
    """POST /v1/completions."""
    body = _object(body)
    check_model(body, model)
    _check_unsupported(body, UNSUPPORTED_COMPLETION)
    requested = _int(body, "max_tokens", None, minimum=1)
    prompts = completion_prompts(body.get("prompt"), model)
    return _build(body, prompts, "max_tokens", requested, COMPLETION_MAX_TOKENS, model, chat=False)


def parse_chat(body: Any, model: ServedModel) -> GenerationRequest:
    """POST /v1/chat/completions (max_completion_tokens wins over the older max_tokens)."""
    body = _object(body)
    check_model(body, model)
    _check_unsupported(body, UNSUPPORTED_CHAT)
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = _int(body, max_param, None, minimum=1)
    tools, parse_calls, constraint = _tools(body, model)
    chat = chat_prompt(body, model, tools)
    prompt = chat.ids
    request = _build(
        body, [prompt], max_param, requested, None, model, chat=True, constraint=constraint, vision=chat.vision
    )
    if chat.images:
        request = dataclasses.replace(request, images=chat.images)
    if parse_calls:
        request = dataclasses.replace(request, tools=True, parallel_tool_calls=_bool(body, "parallel_tool_calls", True))
    if model.reasoning_parser is None:
        return request
    tail = model.tokenizer.decode(prompt[-OPEN_TAIL_TOKENS:], skip_special_tokens=False)
    return dataclasses.replace(request, reasoning=True, thinking_opened=prompt_opens_thinking(tail))
